"""Forward FlashAttention kernel in generic Pallas (FA2 loop order).

Grid: (query block, batch, head). Each program owns `block_q` query rows of one head, keeps them and
their output accumulator on chip, and loops over key blocks of its kv head with online softmax in the
log2 domain (scale * log2(e) folded into the logits, so the exponentials are exp2). Causal programs
visit only the key blocks at or below the diagonal, and only tiles that cross the diagonal or the
padded key tail pay for the mask. Outputs: O [batch, q_len, heads, head_dim] and the natural-log LSE
[batch, heads, q_len], the backward's only residual besides the inputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash._compat import SQUEEZED, triton_params
from pallas_flash.kernels import tiles


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, is_causal, kv_len, block_q, block_kv,
                    num_q_blocks, num_kv_blocks):
    q_block = tiles.launch_order(pl.program_id(0), num_q_blocks, is_causal)
    q = q_ref[...]
    head_dim = q.shape[-1]
    logit_scale = scale * tiles.LOG2E

    def visit(kv_block, carry, *, masked):
        acc, row_max, row_sum = carry
        k_slice = pl.ds(kv_block * block_kv, block_kv)
        s = tiles.dot(q, k_ref[k_slice, :], trans_b=True) * logit_scale
        if masked:
            mask = tiles.tile_mask(q_block * block_q, kv_block * block_kv, block_q, block_kv,
                                   is_causal=is_causal, kv_len=kv_len)
            s = jnp.where(mask, s, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
        shift = tiles.safe_exp_shift(new_max)
        p = jnp.exp2(s - shift[:, None])
        correction = jnp.exp2(row_max - shift)
        row_sum = correction * row_sum + jnp.sum(p, axis=1)
        v = v_ref[k_slice, :]
        acc = correction[:, None] * acc + tiles.dot(p.astype(v.dtype), v)
        return acc, new_max, row_sum

    carry = (jnp.zeros((block_q, head_dim), jnp.float32),
             jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    first_masked, end = tiles.kv_block_range(q_block, block_q=block_q, block_kv=block_kv,
                                             num_kv_blocks=num_kv_blocks, kv_len=kv_len, is_causal=is_causal)
    carry = lax.fori_loop(0, first_masked, functools.partial(visit, masked=False), carry)
    acc, row_max, row_sum = lax.fori_loop(first_masked, end, functools.partial(visit, masked=True), carry)

    empty = row_sum == 0.0  # no visible key: output 0, lse -inf
    safe_sum = jnp.where(empty, 1.0, row_sum)
    o_ref[...] = (acc / safe_sum[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (row_max + jnp.log2(safe_sum)) * tiles.LN2)


def forward(q, k, v, *, scale, is_causal, kv_len, block_q, block_kv, num_warps, num_stages, interpret):
    """Padded inputs -> (O, LSE).

    q: [batch, q_pad, heads, head_dim_pad]; k, v: [batch, kv_pad, kv_heads, head_dim_pad], with q_pad a
    multiple of block_q, kv_pad of block_kv, head_dim_pad a power of two. `kv_len` is the unpadded key
    length. Returns o like q and lse [batch, heads, q_pad] float32.
    """
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    num_q_blocks, num_kv_blocks = q_pad // block_q, kv_pad // block_kv

    def q_map(i, b, h):
        return b, tiles.launch_order(i, num_q_blocks, is_causal), h, 0

    def kv_map(i, b, h):
        return b, 0, h // group, 0

    def lse_map(i, b, h):
        return b, h, tiles.launch_order(i, num_q_blocks, is_causal)

    kernel = functools.partial(_forward_kernel, scale=scale, is_causal=is_causal, kv_len=kv_len,
                               block_q=block_q, block_kv=block_kv, num_q_blocks=num_q_blocks,
                               num_kv_blocks=num_kv_blocks)
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, heads),
        in_specs=[pl.BlockSpec((SQUEEZED, block_q, SQUEEZED, head_dim), q_map),
                  pl.BlockSpec((SQUEEZED, kv_pad, SQUEEZED, head_dim), kv_map),
                  pl.BlockSpec((SQUEEZED, kv_pad, SQUEEZED, head_dim), kv_map)],
        out_specs=[pl.BlockSpec((SQUEEZED, block_q, SQUEEZED, head_dim), q_map),
                   pl.BlockSpec((SQUEEZED, SQUEEZED, block_q), lse_map)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32)],
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="flash_forward",
    )(q, k, v)
