"""The portable kernels as one differentiable function: padding, block fitting and the custom_vjp.

Lengths are padded up to block multiples and head_dim to a power of two (tensor-core tiles need
power-of-two shapes; a value head_dim of its own is padded on its own); the kernels mask the padded keys, and
padded query rows are sliced off. The residuals are the unpadded (q, k, v, o, lse): nothing of size seq^2 is
saved.

A score_mod / mask_mod runs staged (`mods.stage`): its per-query and per-key values are computed here in
XLA for every position (`tiles.ProgramStacks`) and read by the kernels, which evaluate the joint rest on
their tiles. The backward differentiates the staged float values in XLA (`jax.vjp` of `Staged.stacks`) and
gets their cotangents from the kernels, so closed-over float arrays get gradients. A mask_mod's block
classes (`mods.block_classes`, on the device) become the kernels' visit tables: blocks it hides everywhere
are never loaded, and it is evaluated only in the blocks it hides in part.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_flash import block_sparse, blocks, masks
from pallas_flash import mods as programs
from pallas_flash.block_sparse import VISITS_HEADER
from pallas_flash.config import KernelConfig, power_of_two_head_dim
from pallas_flash.portable import bwd as portable_bwd
from pallas_flash.portable import fwd as portable_fwd
from pallas_flash.portable import tiles

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


def unsupported_reason(mods: masks.ScoreMods) -> str | None:
    """Why the portable kernels cannot run these score modifiers ("score_mod: <why>" for a program that
    `mods.stage` refuses), or None."""
    for name, program in (("score_mod", mods.score_mod), ("mask_mod", mods.mask_mod)):
        if program is not None:
            _, reason = programs.stage(program)
            if reason is not None:
                return f"{name}: {reason}"
    return None


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


def _mask_mod_classes(
    mods: masks.ScoreMods, mod_arrays: masks.ModArrays, *, batch, heads, q_len, kv_len, block_q, block_kv
):
    """The mask_mod's (anything visible, everything visible) per block_q x block_kv block (`mods.block_classes`,
    on the device), with those block sizes."""
    classes = programs.block_classes(
        mods.mask_mod,
        mod_arrays.mask_consts,
        batch=batch,
        heads=heads,
        q_len=q_len,
        kv_len=kv_len,
        block_q=block_q,
        block_kv=block_kv,
    )
    return classes, (block_q, block_kv)


def _coarsened(classes, *, block_q, block_kv, num_q_blocks, num_kv_blocks):
    """`_mask_mod_classes` (of blocks dividing these) per block_q x block_kv tile of the padded lengths: blocks
    past the lengths hold nothing visible, and nothing that `every` must count."""
    (some, every), (fine_q, fine_kv) = classes
    factor_q, factor_kv = block_q // fine_q, block_kv // fine_kv

    def fold(x, fill, reduce):
        rows, cols = num_q_blocks * factor_q - x.shape[2], num_kv_blocks * factor_kv - x.shape[3]
        x = jnp.pad(x, [(0, 0), (0, 0), (0, rows), (0, cols)], constant_values=fill)
        return reduce(x.reshape(*x.shape[:2], num_q_blocks, factor_q, num_kv_blocks, factor_kv), axis=(3, 5))

    return fold(some, False, jnp.any), fold(every, True, jnp.all)


def _tile_kinds(classes, block_mask, *, block_q, block_kv, q_pad, kv_pad, kv_len, band, has_segments):
    """How a kernel tiling of block_q x block_kv visits each tile under the band, the padded key tail, segment
    ids, a block mask and the mask_mod's `classes`: int32 [batch or 1, heads or 1, q_pad // block_q,
    kv_pad // block_kv], 0 never, 1 with the token mask (and the mask_mod), 2 without. The band's part is
    `blocks.kv_block_range`, the ranges the kernels walk without a table."""
    num_q_blocks, num_kv_blocks = q_pad // block_q, kv_pad // block_kv
    lo, unmasked_lo, unmasked_hi, hi = blocks.kv_block_range(
        jnp.arange(num_q_blocks)[:, None],
        block_q=block_q,
        block_kv=block_kv,
        num_kv_blocks=num_kv_blocks,
        kv_len=kv_len,
        band=band,
        always_mask=has_segments,
    )
    j = jnp.arange(num_kv_blocks)[None, :]
    kind = ((lo <= j) & (j < hi)).astype(jnp.int32) + ((unmasked_lo <= j) & (j < unmasked_hi))
    if block_mask is not None:
        allowed = block_sparse.visible_tiles(block_mask, block_q=block_q, block_kv=block_kv, q_pad=q_pad, kv_pad=kv_pad)
        kind = kind * jnp.asarray(allowed, jnp.int32)
    some, every = _coarsened(
        classes, block_q=block_q, block_kv=block_kv, num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks
    )
    kind = jnp.where(some, kind, 0)
    return jnp.where(every, kind, jnp.minimum(kind, 1))


def _table(kind):
    """Visit-table rows (as `block_sparse.visit_tables`) from tile kinds [b, h, rows, cols], on the device:
    int32 [b, h, rows, width], width a power of two that holds every column (the longest row is not known
    on the host)."""
    order = jnp.argsort(-kind, axis=-1, stable=True).astype(jnp.int32)  # fully visible first, then partly
    counts = [jnp.sum(k, axis=-1, dtype=jnp.int32)[..., None] for k in (kind == 2, kind > 0)]
    table = jnp.concatenate([*counts, order], axis=-1)
    width = 1 << (VISITS_HEADER + kind.shape[-1] - 1).bit_length()
    return jnp.pad(table, [(0, 0)] * 3 + [(0, width - table.shape[-1])])


def _program_stacks(mods: masks.ScoreMods, mod_arrays: masks.ModArrays, *, batch, heads, q_len, kv_len):
    """The programs' staged values (`tiles.ProgramStacks`), and where a closed-over float array reaches the
    score_mod's result, a function (d rows_float, d cols_float) -> the cotangents of its closed-over arrays
    (`jax.vjp` of `Staged.stacks`); else None."""
    mask = (None,) * 4
    if mods.mask_mod is not None:
        mask = tiles.staged(mods.mask_mod).stacks(mod_arrays.mask_consts, batch, heads, q_len, kv_len)
    if mods.score_mod is None:
        return tiles.ProgramStacks(mask=mask), None
    staged = tiles.staged(mods.score_mod)
    consts = mod_arrays.score_consts
    floats = [i for i, c in enumerate(consts) if jnp.issubdtype(c.dtype, jnp.inexact)]

    def float_stacks(float_consts):
        merged = list(consts)
        for i, c in zip(floats, float_consts):
            merged[i] = c
        rows_int, rows_float, cols_int, cols_float = staged.stacks(merged, batch, heads, q_len, kv_len)
        return (rows_float, cols_float), (rows_int, cols_int)

    (rows_float, cols_float), pullback, (rows_int, cols_int) = jax.vjp(
        float_stacks, [consts[i] for i in floats], has_aux=True
    )
    stacks = tiles.ProgramStacks((rows_int, rows_float, cols_int, cols_float), mask)
    if not staged.needs_grad:
        return stacks, None

    def d_consts(d_rows_float, d_cols_float):
        grads = iter(pullback((d_rows_float, d_cols_float))[0])
        return tuple(next(grads) if i in floats else masks.zero_cotangent(c) for i, c in enumerate(consts))

    return stacks, d_consts


def _stack_cotangent(d, stack, length: int):
    """A kernel's gradient of a float stack per (batch, query head) [batch, heads, values, padded length] ->
    the stack's own shape [batch or 1, heads or 1, values, length]; None stays None."""
    if d is None:
        return None
    axes = tuple(axis for axis in (0, 1) if stack.shape[axis] == 1)
    return jnp.sum(d, axis=axes, keepdims=True)[..., :length]


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
    q_len, kv_len, head_dim, head_dim_v = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    fitted = _fitted(config, q_len, kv_len, block_mask)
    block_q, block_kv = fitted.block_q, fitted.block_kv
    q_pad, kv_pad = _round_up(q_len, block_q), _round_up(kv_len, block_kv)
    q_p = _pad_to(_pad_to(q, 1, q_pad), 3, power_of_two_head_dim(head_dim))
    k_p = _pad_to(_pad_to(k, 1, kv_pad), 3, power_of_two_head_dim(head_dim))
    v_p = _pad_to(_pad_to(v, 1, kv_pad), 3, power_of_two_head_dim(head_dim_v))
    batch, heads = q.shape[0], q.shape[2]
    lengths = dict(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)
    tiling = dict(block_q=block_q, block_kv=block_kv, q_pad=q_pad, kv_pad=kv_pad, kv_len=kv_len, band=band)
    if mods.mask_mod is not None:
        classes = _mask_mod_classes(mods, mod_arrays, **lengths, block_q=block_q, block_kv=block_kv)
        visits = _table(_tile_kinds(classes, block_mask, **tiling, has_segments=q_segment_ids is not None))
    else:
        visits = _visits(block_mask, **tiling, has_segments=q_segment_ids is not None, by="query")
    stacks, _ = _program_stacks(mods, mod_arrays, **lengths)
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
        stacks=stacks,
    )
    out, lse = out[:, :q_len, :, :head_dim_v], lse[:, :, :q_len]
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
    modifiers' cotangents (`ModArrays.cotangents`, with dbias and the gradients of the score_mod's closed-over
    float arrays)). Any forward that returns this lse can use it (the Hopper forward does), with the same
    `mods` and `mod_arrays`."""
    d_out, d_lse = cotangents
    q_len, kv_len, head_dim, head_dim_v = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    # dL/dS = P * (dP - delta); a cotangent on the LSE output adds P * d_lse, i.e. delta -= d_lse. (out None: d_lse
    # holds -delta, `attention_backward`'s delta.)
    if out is None:
        delta = -d_lse
    else:
        delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32)) - d_lse
    # +inf makes every recomputed P of a row exactly 0: rows that saw no key, and padded rows.
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * blocks.LOG2E)

    fitted = _fitted(config, q_len, kv_len, block_mask)
    q_pad = _round_up(q_len, max(fitted.block_q_dkv, fitted.block_q_dq))
    kv_pad = _round_up(kv_len, max(fitted.block_kv_dkv, fitted.block_kv_dq))

    def pad_rows(x, rows):
        return _pad_to(_pad_to(x, 1, rows), 3, power_of_two_head_dim(x.shape[3]))

    batch, heads = q.shape[0], q.shape[2]
    lengths = dict(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)
    block_tables = None
    if mods.mask_mod is not None:
        # One evaluation of the mask_mod at the finer of the two tilings (powers of two: it divides the other).
        classes = _mask_mod_classes(
            mods,
            mod_arrays,
            **lengths,
            block_q=min(fitted.block_q_dkv, fitted.block_q_dq),
            block_kv=min(fitted.block_kv_dkv, fitted.block_kv_dq),
        )
        tiling = dict(q_pad=q_pad, kv_pad=kv_pad, kv_len=kv_len, band=band, has_segments=q_segment_ids is not None)
        dkdv_kind = _tile_kinds(classes, block_mask, block_q=fitted.block_q_dkv, block_kv=fitted.block_kv_dkv, **tiling)
        dq_kind = _tile_kinds(classes, block_mask, block_q=fitted.block_q_dq, block_kv=fitted.block_kv_dq, **tiling)
        block_tables = (_table(jnp.swapaxes(dkdv_kind, 2, 3)), _table(dq_kind), (dq_kind > 0).astype(jnp.int32))
    elif block_mask is not None:
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

    stacks, d_score_consts = _program_stacks(mods, mod_arrays, **lengths)
    dq, dk, dv, dbias, d_rows, d_cols = portable_bwd.backward(
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
        stacks=stacks,
    )
    if dbias is not None:  # unpad, in the bias's dtype
        bias = mod_arrays.bias
        dbias = dbias[:, :, : bias.shape[2], : bias.shape[3]].astype(bias.dtype)
    d_consts = None
    if d_score_consts is not None:
        d_consts = d_score_consts(
            _stack_cotangent(d_rows, stacks.score[1], q_len), _stack_cotangent(d_cols, stacks.score[3], kv_len)
        )
    d_mods = mod_arrays.cotangents(dbias, d_consts)
    return (
        dq[:, :q_len, :, :head_dim],
        dk[:, :kv_len, :, :head_dim],
        dv[:, :kv_len, :, :head_dim_v],
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
