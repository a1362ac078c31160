"""The portable kernels as one differentiable function: padding, block fitting and the custom_vjp.

Lengths are padded up to block multiples and head_dim to a power of two (tensor-core tiles need
power-of-two shapes); the kernels mask the padded keys, and padded query rows are sliced off. The
residuals are the unpadded (q, k, v, o, lse): nothing of size seq^2 is saved.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_flash import block_sparse, blocks, masks
from pallas_flash.config import KernelConfig
from pallas_flash.portable import bwd as portable_bwd
from pallas_flash.portable import fwd as portable_fwd

MIN_BLOCK = 16  # smallest tile the tensor cores take


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _fit(block: int, length: int) -> int:
    """Shrink a block for a short sequence so a length-17 call does not pad to 128."""
    return min(block, max(MIN_BLOCK, _next_power_of_two(length)))


def _fitted(config: KernelConfig, q_len: int, kv_len: int, block_mask) -> KernelConfig:
    """Every kernel's blocks fitted to the lengths, and with a block mask to divide its blocks (so the
    mask is uniform over each tile: a 64 x 64 mask runs 64 x 64 tiles or smaller)."""

    def fit(block, length, mask_block):
        block = _fit(block, length)
        return block if block_mask is None else block_sparse.kernel_block(block, mask_block)

    mask_q, mask_kv = (0, 0) if block_mask is None else (block_mask.block_q, block_mask.block_kv)
    return dataclasses.replace(
        config,
        **{name: fit(getattr(config, name), q_len, mask_q) for name in ("block_q", "block_q_dkv", "block_q_dq")},
        **{name: fit(getattr(config, name), kv_len, mask_kv) for name in ("block_kv", "block_kv_dkv", "block_kv_dq")},
    )


def _visits(block_mask, *, block_q, block_kv, q_pad, kv_pad, kv_len, band, has_segments, by: str):
    """The visit table of one kernel (`by` "query" or "key" rows) as an int32 array, or None (no mask)."""
    if block_mask is None:
        return None
    by_query, by_key = block_sparse.visit_tables(
        block_mask,
        block_q=block_q,
        block_kv=block_kv,
        q_pad=q_pad,
        kv_pad=kv_pad,
        kv_len=kv_len,
        band=band,
        always_mask=has_segments,
    )
    return jnp.asarray(by_query if by == "query" else by_key)


def _pad_to(x, axis: int, size: int, value=0.0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _flash(q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, scale, band, config, interpret, mods, block_mask):
    return _flash_fwd(
        q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, scale, band, config, interpret, mods, block_mask
    )[0]


def _flash_fwd(q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, scale, band, config, interpret, mods, block_mask):
    q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[3]
    fitted = _fitted(config, q_len, kv_len, block_mask)
    block_q, block_kv = fitted.block_q, fitted.block_kv
    q_pad, kv_pad = _round_up(q_len, block_q), _round_up(kv_len, block_kv)
    dim_pad = max(MIN_BLOCK, _next_power_of_two(head_dim))
    q_p = _pad_to(_pad_to(q, 1, q_pad), 3, dim_pad)
    k_p = _pad_to(_pad_to(k, 1, kv_pad), 3, dim_pad)
    v_p = _pad_to(_pad_to(v, 1, kv_pad), 3, dim_pad)
    visits = _visits(
        block_mask,
        block_q=block_q,
        block_kv=block_kv,
        q_pad=q_pad,
        kv_pad=kv_pad,
        kv_len=kv_len,
        band=band,
        has_segments=q_segment_ids is not None,
        by="query",
    )
    out, lse = portable_fwd.forward(
        q_p,
        k_p,
        v_p,
        *masks.pad_segment_ids(q_segment_ids, kv_segment_ids, q_pad, kv_pad),
        mod_arrays,
        visits,
        scale=scale,
        band=band,
        kv_len=kv_len,
        block_q=block_q,
        block_kv=block_kv,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        mods=mods,
    )
    out, lse = out[:, :q_len, :, :head_dim], lse[:, :, :q_len]
    return (out, lse), (q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, out, lse)


def _flash_bwd(scale, band, config, interpret, mods, block_mask, residuals, cotangents):
    q, k, v, q_segment_ids, kv_segment_ids, mod_arrays, out, lse = residuals
    return backward(
        q,
        k,
        v,
        out,
        lse,
        cotangents,
        scale=scale,
        band=band,
        config=config,
        interpret=interpret,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        block_mask=block_mask,
        mods=mods,
        mod_arrays=mod_arrays,
    )


def backward(
    q,
    k,
    v,
    out,
    lse,
    cotangents,
    *,
    scale,
    band,
    config,
    interpret,
    q_segment_ids=None,
    kv_segment_ids=None,
    block_mask=None,
    mods: masks.ScoreMods = masks.ScoreMods(),
    mod_arrays: masks.ModArrays = masks.ModArrays(),
):
    """The backward kernels on forward residuals (unpadded q, k, v, out and the natural-log lse) and the
    cotangents (d_out, d_lse): returns (dq, dk, dv, float0 cotangents for the segment ids, and the score
    modifiers' cotangents (`ModArrays.cotangents`, with dbias)). Any forward that returns this lse can use it
    (the Hopper forward does)."""
    d_out, d_lse = cotangents
    q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[3]
    # dL/dS = P * (dP - delta); a cotangent on the LSE output adds P * d_lse, i.e. delta -= d_lse.
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32)) - d_lse
    # +inf makes every recomputed P of a row exactly 0: rows that saw no key, and padded rows.
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * blocks.LOG2E)

    fitted = _fitted(config, q_len, kv_len, block_mask)
    q_pad = _round_up(q_len, max(fitted.block_q_dkv, fitted.block_q_dq))
    kv_pad = _round_up(kv_len, max(fitted.block_kv_dkv, fitted.block_kv_dq))
    dim_pad = max(MIN_BLOCK, _next_power_of_two(head_dim))

    def pad_rows(x, rows):
        return _pad_to(_pad_to(x, 1, rows), 3, dim_pad)

    block_tables = None
    if block_mask is not None:
        tables = dict(q_pad=q_pad, kv_pad=kv_pad, kv_len=kv_len, band=band, has_segments=q_segment_ids is not None)
        dkdv_visits = _visits(block_mask, block_q=fitted.block_q_dkv, block_kv=fitted.block_kv_dkv, by="key", **tables)
        dq_visits = _visits(block_mask, block_q=fitted.block_q_dq, block_kv=fitted.block_kv_dq, by="query", **tables)
        # dbias runs on the dQ kernel's tiles; it loops over all of them, so it needs the hidden ones named.
        visible = jnp.asarray(
            block_sparse.visible_tiles(
                block_mask, block_q=fitted.block_q_dq, block_kv=fitted.block_kv_dq, q_pad=q_pad, kv_pad=kv_pad
            ),
            jnp.int32,
        )
        block_tables = (dkdv_visits, dq_visits, visible)

    dq, dk, dv, dbias = portable_bwd.backward(
        pad_rows(q, q_pad),
        pad_rows(k, kv_pad),
        pad_rows(v, kv_pad),
        pad_rows(d_out.astype(q.dtype), q_pad),
        _pad_to(lse2, 2, q_pad, jnp.inf),
        _pad_to(delta, 2, q_pad),
        *masks.pad_segment_ids(q_segment_ids, kv_segment_ids, q_pad, kv_pad),
        mod_arrays,
        block_tables,
        scale=scale,
        band=band,
        kv_len=kv_len,
        config=fitted,
        interpret=interpret,
        mods=mods,
    )
    if dbias is not None:  # unpad, in the bias's dtype
        bias = mod_arrays.bias
        dbias = dbias[:, :, : bias.shape[2], : bias.shape[3]].astype(bias.dtype)
    d_mods = mod_arrays.cotangents(dbias)
    return (
        dq[:, :q_len, :, :head_dim],
        dk[:, :kv_len, :, :head_dim],
        dv[:, :kv_len, :, :head_dim],
        masks.integer_cotangent(q_segment_ids),
        masks.integer_cotangent(kv_segment_ids),
        d_mods,
    )


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_portable(
    query,
    key,
    value,
    *,
    scale: float,
    band: masks.Band,
    config: KernelConfig,
    interpret: bool,
    q_segment_ids=None,
    kv_segment_ids=None,
    block_mask=None,
    mods: masks.ScoreMods = masks.ScoreMods(),
    mod_arrays: masks.ModArrays = masks.ModArrays(),
):
    """Shapes and results as `reference.attention_reference`; differentiable in query, key, value and the
    bias (and through the returned LSE). `block_mask`: a `BlockMask` whose False blocks are never loaded. The
    score modifiers are those checked by `api.flash_attention`."""
    return _flash(
        query, key, value, q_segment_ids, kv_segment_ids, mod_arrays, scale, band, config, interpret, mods, block_mask
    )
