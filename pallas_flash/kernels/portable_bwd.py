"""Backward FlashAttention kernels in generic Pallas: recompute P from the saved LSE, never store it.

With delta = rowsum(dO * O) (minus the LSE's own cotangent, if any), per tile:
    P = exp2(S * scale * log2(e) - LSE * log2(e))      dV += P^T dO
    dP = dO V^T      dS = P * (dP - delta)             dK += scale * dS^T Q      dQ += scale * dS K
Two kernels, both deterministic (each output tile is owned by one program; no atomics):
  * dK/dV: grid (key block, batch, kv head); loops over the query heads that share the kv head (GQA
    reduction in registers) and over the query blocks that see the key block.
  * dQ: grid (query block, batch, head); loops over the key blocks the query block sees.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash._compat import SQUEEZED, triton_params
from pallas_flash.kernels import tiles


def _probabilities(q, k, lse2, q_start, k_start, *, logit_scale, masked, is_causal, kv_len):
    """Recomputed P for one [block_q, block_kv] tile (lse2 is the LSE in log2 units, +inf for empty rows)."""
    s = tiles.dot(q, k, trans_b=True) * logit_scale
    if masked:
        mask = tiles.tile_mask(q_start, k_start, q.shape[0], k.shape[0], is_causal=is_causal, kv_len=kv_len)
        s = jnp.where(mask, s, -jnp.inf)
    return jnp.exp2(s - lse2[:, None])


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dk_ref, dv_ref, *, scale, is_causal,
                 kv_len, block_q, block_kv, num_q_blocks, group):
    kv_block = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_start = kv_block * block_kv
    logit_scale = scale * tiles.LOG2E
    # The padded key tail must be masked for every query block that visits it.
    holds_tail = kv_len % block_kv != 0

    def visit(q_block, carry, *, head, masked):
        dk, dv = carry
        q_slice = pl.ds(q_block * block_q, block_q)
        q, do = q_ref[q_slice, head, :], do_ref[q_slice, head, :]
        p = _probabilities(q, k, lse2_ref[head, q_slice], q_block * block_q, k_start, logit_scale=logit_scale,
                           masked=masked, is_causal=is_causal, kv_len=kv_len)
        dv = dv + tiles.dot(p.astype(do.dtype), do, trans_a=True)
        dp = tiles.dot(do, v, trans_b=True)
        ds = (p * (dp - delta_ref[head, q_slice][:, None])).astype(q.dtype)
        dk = dk + tiles.dot(ds, q, trans_a=True)
        return dk, dv

    start, unmasked = tiles.q_block_range(kv_block, block_q=block_q, block_kv=block_kv,
                                          num_q_blocks=num_q_blocks, is_causal=is_causal)
    if holds_tail:
        masked_end = jnp.where((kv_block + 1) * block_kv > kv_len, num_q_blocks, unmasked)
    else:
        masked_end = unmasked

    def per_head(head, carry):
        carry = lax.fori_loop(start, masked_end, functools.partial(visit, head=head, masked=True), carry)
        return lax.fori_loop(masked_end, num_q_blocks, functools.partial(visit, head=head, masked=False), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, per_head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref, *, scale, is_causal, kv_len,
               block_q, block_kv, num_q_blocks, num_kv_blocks):
    q_block = num_q_blocks - 1 - pl.program_id(0) if is_causal else pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse2, delta = lse2_ref[...], delta_ref[...]
    logit_scale = scale * tiles.LOG2E

    def visit(kv_block, dq, *, masked):
        k_slice = pl.ds(kv_block * block_kv, block_kv)
        k, v = k_ref[k_slice, :], v_ref[k_slice, :]
        p = _probabilities(q, k, lse2, q_block * block_q, kv_block * block_kv, logit_scale=logit_scale,
                           masked=masked, is_causal=is_causal, kv_len=kv_len)
        dp = tiles.dot(do, v, trans_b=True)
        ds = (p * (dp - delta[:, None])).astype(k.dtype)
        return dq + tiles.dot(ds, k)

    first_masked, end = tiles.kv_block_range(q_block, block_q=block_q, block_kv=block_kv,
                                             num_kv_blocks=num_kv_blocks, kv_len=kv_len, is_causal=is_causal)
    dq = lax.fori_loop(0, first_masked, functools.partial(visit, masked=False),
                       jnp.zeros(q.shape, jnp.float32))
    dq = lax.fori_loop(first_masked, end, functools.partial(visit, masked=True), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def backward(q, k, v, do, lse2, delta, *, scale, is_causal, kv_len, block_q_dkv, block_kv_dkv, block_q_dq,
             block_kv_dq, num_warps, num_stages, interpret):
    """Padded inputs -> (dq, dk, dv).

    q, do: [batch, q_pad, heads, head_dim_pad]; k, v: [batch, kv_pad, kv_heads, head_dim_pad];
    lse2, delta: [batch, heads, q_pad] float32, lse2 = LSE * log2(e) with +inf on rows that saw no key.
    q_pad must be a multiple of both query blocks, kv_pad of both key blocks.
    """
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    params = triton_params(num_warps, num_stages)
    common = dict(scale=scale, is_causal=is_causal, kv_len=kv_len)

    num_q_blocks = q_pad // block_q_dkv
    dkdv_kernel = functools.partial(_dkdv_kernel, block_q=block_q_dkv, block_kv=block_kv_dkv,
                                    num_q_blocks=num_q_blocks, group=group, **common)
    q_group_spec = pl.BlockSpec((SQUEEZED, q_pad, group, head_dim), lambda j, b, h: (b, 0, h, 0))
    kv_block_spec = pl.BlockSpec((SQUEEZED, block_kv_dkv, SQUEEZED, head_dim), lambda j, b, h: (b, j, h, 0))
    row_group_spec = pl.BlockSpec((SQUEEZED, group, q_pad), lambda j, b, h: (b, h, 0))
    dk, dv = pl.pallas_call(
        dkdv_kernel,
        grid=(kv_pad // block_kv_dkv, batch, kv_heads),
        in_specs=[q_group_spec, kv_block_spec, kv_block_spec, q_group_spec, row_group_spec, row_group_spec],
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=interpret,
        name="flash_backward_dkdv",
    )(q, k, v, do, lse2, delta)

    num_q_blocks = q_pad // block_q_dq

    def q_block_of(i):
        return num_q_blocks - 1 - i if is_causal else i

    dq_kernel = functools.partial(_dq_kernel, block_q=block_q_dq, block_kv=block_kv_dq, num_q_blocks=num_q_blocks,
                                  num_kv_blocks=kv_pad // block_kv_dq, **common)
    q_block_spec = pl.BlockSpec((SQUEEZED, block_q_dq, SQUEEZED, head_dim), lambda i, b, h: (b, q_block_of(i), h, 0))
    kv_full_spec = pl.BlockSpec((SQUEEZED, kv_pad, SQUEEZED, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    row_spec = pl.BlockSpec((SQUEEZED, SQUEEZED, block_q_dq), lambda i, b, h: (b, h, q_block_of(i)))
    dq = pl.pallas_call(
        dq_kernel,
        grid=(num_q_blocks, batch, heads),
        in_specs=[q_block_spec, kv_full_spec, kv_full_spec, q_block_spec, row_spec, row_spec],
        out_specs=q_block_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="flash_backward_dq",
    )(q, k, v, do, lse2, delta)
    return dq, dk, dv
