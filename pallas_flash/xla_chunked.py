"""O(seq)-memory attention in plain JAX: `lax.scan` over key blocks with online softmax.

The default off NVIDIA GPUs (Pallas interpret mode is far too slow for real use). The forward keeps a
running (max, sum, output) per query row; the backward, a `custom_vjp`, rescans the key blocks and
recomputes the probabilities from the saved log-sum-exp, so neither pass holds more than a
[batch, heads, q_len, block_kv] slice of the logits.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import block_sparse, masks

LOG2E = math.log2(math.e)


def _einsum(spec, a, b):
    # float32 inputs get float32 products: XLA on GPU would otherwise round operands to tf32.
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def _blocks(x, block_kv):
    """[batch, kv_len, kv_heads, dim] -> [num_blocks, batch, block_kv, kv_heads, dim], zero padded."""
    batch, kv_len, kv_heads, dim = x.shape
    num_blocks = -(-kv_len // block_kv)
    x = jnp.pad(x, ((0, 0), (0, num_blocks * block_kv - kv_len), (0, 0), (0, 0)))
    return x.reshape(batch, num_blocks, block_kv, kv_heads, dim).swapaxes(0, 1)


def _segment_blocks(kv_segment_ids, block_kv):
    """[batch, kv_len] -> [num_blocks, batch, block_kv] (or None)."""
    if kv_segment_ids is None:
        return None
    return _blocks(kv_segment_ids[..., None, None], block_kv)[..., 0, 0]


def _block_logits2(q, k_blk, start, seg_blk, q_segment_ids, *, scale, band, kv_len, block_mask):
    """Scaled logits of one key block in the log2 domain, masked to -inf: [batch, kv_heads, group, q_len, block]."""
    s = _einsum("bqhgd,bkhd->bhgqk", q, k_blk) * (scale * LOG2E)
    q_pos = jnp.arange(q.shape[1])
    k_pos = start + jnp.arange(k_blk.shape[1])
    segments = {}
    if q_segment_ids is not None:
        segments = dict(q_segment=q_segment_ids[:, None, None, :, None], kv_segment=seg_blk[:, None, None, None, :])
    mask = masks.visible(q_pos[:, None], k_pos[None, :], band=band, kv_len=kv_len, **segments)
    if block_mask is not None:  # expanded for this key chunk only: O(q_len * block_kv)
        mask = block_sparse.combine(mask, block_sparse.token_mask(block_mask, q_pos, k_pos, q.shape[2]))
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _forward(q, k, v, q_segment_ids, kv_segment_ids, scale, band, block_kv, block_mask):
    batch, q_len, kv_heads, group, dim = q.shape
    kv_len = k.shape[1]
    block_kv = min(block_kv, kv_len)

    def step(carry, blk):
        acc, m, l = carry
        idx, k_blk, v_blk, seg_blk = blk
        s = _block_logits2(q, k_blk, idx * block_kv, seg_blk, q_segment_ids, scale=scale, band=band, kv_len=kv_len,
                           block_mask=block_mask)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # Rows with nothing visible yet keep m = -inf; shift them by 0 so exp2 gives 0, not NaN.
        shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp2(s - shift[..., None])
        alpha = jnp.exp2(m - shift)
        l = alpha * l + jnp.sum(p, axis=-1)
        pv = _einsum("bhgqk,bkhd->bhgqd", p.astype(v_blk.dtype), v_blk)
        return (alpha[..., None] * acc + pv, m_new, l), None

    init = (jnp.zeros((batch, kv_heads, group, q_len, dim), jnp.float32),
            jnp.full((batch, kv_heads, group, q_len), -jnp.inf, jnp.float32),
            jnp.zeros((batch, kv_heads, group, q_len), jnp.float32))
    k_blocks, v_blocks = _blocks(k, block_kv), _blocks(v, block_kv)
    xs = (jnp.arange(k_blocks.shape[0]), k_blocks, v_blocks, _segment_blocks(kv_segment_ids, block_kv))
    (acc, m, l), _ = jax.lax.scan(step, init, xs)
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) / LOG2E)
    return out, lse  # out [b, h, g, q, d] float32, lse [b, h, g, q]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _chunked(q, k, v, q_segment_ids, kv_segment_ids, scale, band, block_kv, block_mask):
    return _forward(q, k, v, q_segment_ids, kv_segment_ids, scale, band, block_kv, block_mask)


def _chunked_fwd(q, k, v, q_segment_ids, kv_segment_ids, scale, band, block_kv, block_mask):
    out, lse = _forward(q, k, v, q_segment_ids, kv_segment_ids, scale, band, block_kv, block_mask)
    return (out, lse), (q, k, v, q_segment_ids, kv_segment_ids, out, lse)


def _chunked_bwd(scale, band, block_kv, block_mask, residuals, cotangents):
    q, k, v, q_segment_ids, kv_segment_ids, out, lse = residuals
    d_out, d_lse = cotangents
    kv_len = k.shape[1]
    block_kv = min(block_kv, kv_len)
    # dL/ds = p * (dp - delta) with delta = rowsum(dO * O); a cotangent on lse adds p * d_lse.
    delta = jnp.sum(d_out * out, axis=-1) - d_lse
    # A row that saw no key has lse = -inf; +inf there makes every recomputed p exactly 0.
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)
    d_out_lowp = d_out.astype(q.dtype)

    def step(dq, blk):
        idx, k_blk, v_blk, seg_blk = blk
        s = _block_logits2(q, k_blk, idx * block_kv, seg_blk, q_segment_ids, scale=scale, band=band, kv_len=kv_len,
                           block_mask=block_mask)
        p = jnp.exp2(s - lse2[..., None])
        dv_blk = _einsum("bhgqk,bhgqd->bkhd", p.astype(q.dtype), d_out_lowp)
        dp = _einsum("bhgqd,bkhd->bhgqk", d_out_lowp, v_blk)
        ds = (p * (dp - delta[..., None])).astype(q.dtype)
        dq = dq + _einsum("bhgqk,bkhd->bqhgd", ds, k_blk)
        dk_blk = _einsum("bhgqk,bqhgd->bkhd", ds, q)
        return dq, (dk_blk, dv_blk)

    k_blocks, v_blocks = _blocks(k, block_kv), _blocks(v, block_kv)
    xs = (jnp.arange(k_blocks.shape[0]), k_blocks, v_blocks, _segment_blocks(kv_segment_ids, block_kv))
    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32), xs)

    def unblock(x):  # [num_blocks, batch, block_kv, kv_heads, dim] -> [batch, kv_len, kv_heads, dim]
        x = x.swapaxes(0, 1)
        return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :kv_len]

    return ((dq * scale).astype(q.dtype), (unblock(dk) * scale).astype(k.dtype), unblock(dv).astype(v.dtype),
            _integer_cotangent(q_segment_ids), _integer_cotangent(kv_segment_ids))


def _integer_cotangent(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def attention_chunked(query, key, value, *, scale: float, band: masks.Band, block_kv: int,
                      q_segment_ids=None, kv_segment_ids=None, block_mask=None):
    """Blocked online-softmax attention. Shapes and results as `reference.attention_reference`. A
    `block_mask` is applied as a token mask per key chunk (no block is skipped: XLA's scan has a fixed
    trip count)."""
    batch, q_len, heads, dim = query.shape
    kv_heads = key.shape[2]
    q = query.reshape(batch, q_len, kv_heads, heads // kv_heads, dim)
    out, lse = _chunked(q, key, value, q_segment_ids, kv_segment_ids, scale, band, block_kv, block_mask)
    out = jnp.moveaxis(out.reshape(batch, heads, q_len, dim), 1, 2).astype(query.dtype)
    return out, lse.reshape(batch, heads, q_len)
