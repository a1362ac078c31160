"""Backward FlashAttention kernels in generic Pallas: recompute P from the saved LSE, never store it.

With delta = rowsum(dO * O) (minus the LSE's own cotangent, if any), per tile:
    P = exp2(S * scale * log2(e) - LSE * log2(e))      dV += P^T dO
    dP = dO V^T      dS = P * (dP - delta)             dK += scale * dS^T Q      dQ += scale * dS K
Two kernels, both deterministic (each output tile is owned by one program; no atomics):
  * dK/dV: grid (key block, batch, kv head); loops over the query heads that share the kv head (the GQA
    reduction happens in registers) and over the query blocks that see the key block (the band's range, or
    with a block mask the key block's row of a visit table, per query head). It works on the
    transposed tiles S^T = K Q^T, so that P^T and dS^T come out of the matmuls in the layout the next
    matmuls (P^T dO, dS^T Q) consume, with no transposes of register tiles.
  * dQ: grid (query block, batch, head); loops over the key blocks the query block sees (band or visit table).
  * dBias (only with a bias): grid over the bias's own blocks; see `dbias`.
A visit table (`block_sparse.visit_tables`) is the optional first operand; blocks it does not list are never
loaded. Score modifiers are recomputed per tile as in the forward; dS goes back through the score_mod's
vjp (`tiles.modified_logits`), then with a soft cap is multiplied by 1 - tanh^2 before it meets Q or K
(dBias is dS between the two); with dropout Z = keep / (1 - rate), dV = (P * Z)^T dO and dP = Z * (dO V^T).
Where a closed-over float array reaches the score_mod's result, the dQ kernel also sums the gradient of its
per-query values over keys, and the dK/dV kernel that of its per-key values over queries.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash import blocks, masks
from pallas_flash._compat import SQUEEZED, triton_params
from pallas_flash.portable import tiles


def _dkdv_kernel(
    *refs, scale, band, kv_len, block_q, block_kv, num_q_blocks, group, has_segments, has_visits, mods, num_cols
):
    visits_ref, refs = (refs[0], refs[1:]) if has_visits else (None, refs)
    inputs, (q_seg_ref, kv_seg_ref), mod_refs, (dk_ref, dv_ref, *d_cols_ref) = tiles.split_refs(
        refs, 6, has_segments, mods
    )
    q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref = inputs
    kv_block, batch, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    kv_seg = kv_seg_ref[...] if has_segments else None
    k_start = kv_block * block_kv
    logit_scale = scale * blocks.LOG2E

    def visit(q_block, carry, *, head, masked):
        dk, dv, d_cols = carry
        q_slice = pl.ds(q_block * block_q, block_q)
        q, do = q_ref[q_slice, head, :], do_ref[q_slice, head, :]
        s_t = tiles.dot(k, q, trans_b=True)  # [block_kv, block_q]
        position = dict(
            batch=batch,
            head=kv_head * group + head,
            q_start=q_block * block_q,
            k_start=k_start,
            block_q=block_q,
            block_kv=block_kv,
            keys_major=True,
        )
        grad_factor = score_pullback = None
        if mods.active:
            s_t, grad_factor, score_pullback = tiles.modified_logits(
                s_t * scale, mods, mod_refs, pullback=True, **position
            )
        else:
            s_t = s_t * logit_scale
        if masked:
            mask = tiles.tile_mask(
                q_block * block_q,
                k_start,
                block_q,
                block_kv,
                band=band,
                kv_len=kv_len,
                q_segment=q_seg_ref[q_slice] if has_segments else None,
                kv_segment=kv_seg,
                keys_major=True,
            )
            s_t = jnp.where(tiles.visibility(mask, mods, mod_refs, **position), s_t, -jnp.inf)
        p_t = jnp.exp2(s_t - lse2_ref[head, q_slice][None, :])
        dp_t = tiles.dot(v, do, trans_b=True)
        dropout = tiles.dropout_multiplier(mods, mod_refs, **position)
        if dropout is None:
            dv = dv + tiles.dot(p_t.astype(do.dtype), do)
        else:  # O = (P * Z) V with Z = keep / (1 - rate): dV = (P * Z)^T dO, dP = Z * dO V^T
            dv = dv + tiles.dot((p_t * dropout).astype(do.dtype), do)
            dp_t = dp_t * dropout
        ds_t = p_t * (dp_t - delta_ref[head, q_slice][None, :])
        if score_pullback is not None:  # through the score_mod; its column values' gradients sum over queries
            ds_t, _, d_cols_t = score_pullback(ds_t)
            d_cols = [d + jnp.sum(d_t, axis=1) for d, d_t in zip(d_cols, d_cols_t)]
        if grad_factor is not None:  # through the soft cap
            ds_t = ds_t * grad_factor
        dk = dk + tiles.dot(ds_t.astype(q.dtype), q)
        return dk, dv, d_cols

    if not has_visits:
        block_range = blocks.q_block_range(
            kv_block,
            block_q=block_q,
            block_kv=block_kv,
            num_q_blocks=num_q_blocks,
            kv_len=kv_len,
            band=band,
            always_mask=has_segments,
        )

    def per_head(head, carry):
        visit_head = functools.partial(visit, head=head)
        carry = (*carry, [jnp.zeros((block_kv,), jnp.float32)] * num_cols)
        if has_visits:  # the table lists the query blocks that see this key block, per head
            row = head if visits_ref.shape[0] > 1 else 0
            dk, dv, d_cols = tiles.visit_blocks(lambda i: visits_ref[row, i], visit_head, carry)
        else:
            dk, dv, d_cols = tiles.visit_band(visit_head, carry, block_range)
        for i, d in enumerate(d_cols):  # per query head: the caller sums over the heads a value is shared by
            d_cols_ref[0][head, i, :] = d
        return dk, dv

    dk, dv = lax.fori_loop(0, group, per_head, (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    *refs,
    scale,
    band,
    kv_len,
    block_q,
    block_kv,
    num_q_blocks,
    num_kv_blocks,
    has_segments,
    has_visits,
    mods,
    num_rows,
):
    visits_ref, refs = (refs[0], refs[1:]) if has_visits else (None, refs)
    (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref), (q_seg_ref, kv_seg_ref), mod_refs, (dq_ref, *d_rows_ref) = (
        tiles.split_refs(refs, 6, has_segments, mods)
    )
    q_block = tiles.launch_order(pl.program_id(0), num_q_blocks, reverse=band.right == 0)
    batch, head = pl.program_id(1), pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse2, delta = lse2_ref[...], delta_ref[...]
    q_seg = q_seg_ref[...] if has_segments else None
    logit_scale = scale * blocks.LOG2E

    def visit(kv_block, carry, *, masked):
        dq, d_rows = carry
        k_slice = pl.ds(kv_block * block_kv, block_kv)
        k, v = k_ref[k_slice, :], v_ref[k_slice, :]
        s = tiles.dot(q, k, trans_b=True)
        position = dict(
            batch=batch,
            head=head,
            q_start=q_block * block_q,
            k_start=kv_block * block_kv,
            block_q=block_q,
            block_kv=block_kv,
        )
        grad_factor = score_pullback = None
        if mods.active:
            s, grad_factor, score_pullback = tiles.modified_logits(s * scale, mods, mod_refs, pullback=True, **position)
        else:
            s = s * logit_scale
        if masked:
            mask = tiles.tile_mask(
                q_block * block_q,
                kv_block * block_kv,
                block_q,
                block_kv,
                band=band,
                kv_len=kv_len,
                q_segment=q_seg,
                kv_segment=kv_seg_ref[k_slice] if has_segments else None,
            )
            s = jnp.where(tiles.visibility(mask, mods, mod_refs, **position), s, -jnp.inf)
        p = jnp.exp2(s - lse2[:, None])
        dp = tiles.dot(do, v, trans_b=True)
        dropout = tiles.dropout_multiplier(mods, mod_refs, **position)
        if dropout is not None:
            dp = dp * dropout
        ds = p * (dp - delta[:, None])
        if score_pullback is not None:  # through the score_mod; its row values' gradients sum over keys
            ds, d_rows_tile, _ = score_pullback(ds)
            d_rows = [d + jnp.sum(d_tile, axis=1) for d, d_tile in zip(d_rows, d_rows_tile)]
        if grad_factor is not None:
            ds = ds * grad_factor
        return dq + tiles.dot(ds.astype(k.dtype), k), d_rows

    carry = (jnp.zeros(q.shape, jnp.float32), [jnp.zeros((block_q,), jnp.float32)] * num_rows)
    if has_visits:  # the table lists this query block's key blocks
        dq, d_rows = tiles.visit_blocks(lambda i: visits_ref[i], visit, carry)
    else:
        dq, d_rows = tiles.visit_band(
            visit,
            carry,
            blocks.kv_block_range(
                q_block,
                block_q=block_q,
                block_kv=block_kv,
                num_kv_blocks=num_kv_blocks,
                kv_len=kv_len,
                band=band,
                always_mask=has_segments,
            ),
        )
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    for i, d in enumerate(d_rows):
        d_rows_ref[0][i, :] = d


def dkdv(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    q_segment_ids=None,
    kv_segment_ids=None,
    mod_arrays=masks.ModArrays(),
    visits=None,
    *,
    scale,
    band: masks.Band,
    kv_len,
    mods: masks.ScoreMods = masks.ScoreMods(),
    stacks: tiles.ProgramStacks = tiles.ProgramStacks(),
    block_q,
    block_kv,
    num_warps,
    num_stages,
    interpret,
):
    """dK, dV [batch, kv_pad, kv_heads, head_dim(_v)_pad] from padded inputs, and the score_mod's column gradients
    float32 [batch, heads, values, kv_pad] or None (see `backward`)."""
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    has_segments = q_segment_ids is not None
    num_cols = tiles.num_float_grads(mods, "col")
    kernel = functools.partial(
        _dkdv_kernel,
        scale=scale,
        band=band,
        kv_len=kv_len,
        block_q=block_q,
        block_kv=block_kv,
        num_q_blocks=q_pad // block_q,
        group=group,
        has_segments=has_segments,
        has_visits=visits is not None,
        mods=mods,
        num_cols=num_cols,
    )
    # A program reads all query rows of the `group` query heads that share its kv head.
    # (query/key and value/output head dims may differ)
    q_group_spec, do_group_spec = (
        pl.BlockSpec((SQUEEZED, q_pad, group, d), lambda j, b, h: (b, 0, h, 0)) for d in (head_dim, v.shape[3])
    )
    row_group_spec = pl.BlockSpec((SQUEEZED, group, q_pad), lambda j, b, h: (b, h, 0))
    k_block_spec, v_block_spec = tiles.head_specs(block_kv, lambda j, b, h: (b, j, h, 0), head_dim, v.shape[3])
    in_specs = [q_group_spec, k_block_spec, v_block_spec, do_group_spec, row_group_spec, row_group_spec]
    operands = [q, k, v, do, lse2, delta]
    if has_segments:
        in_specs += [
            pl.BlockSpec((SQUEEZED, q_pad), lambda j, b, h: (b, 0)),
            pl.BlockSpec((SQUEEZED, block_kv), lambda j, b, h: (b, j)),
        ]
        operands += [q_segment_ids, kv_segment_ids]
    mod_ops, mod_specs = tiles.mod_operands(mods, mod_arrays, q_pad, kv_pad, keys_major=True, stacks=stacks)
    in_specs, operands = in_specs + mod_specs, operands + mod_ops
    if visits is not None:
        in_specs = [tiles.visits_spec(visits.shape, lambda j: j, group=group)] + in_specs
        operands = [visits] + operands
    out_specs = [k_block_spec, v_block_spec]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if num_cols:  # per query head of the program's kv head
        out_specs.append(pl.BlockSpec((SQUEEZED, group, num_cols, block_kv), lambda j, b, h: (b, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, num_cols, kv_pad), jnp.float32))
    dk, dv, *d_cols = pl.pallas_call(
        kernel,
        grid=(kv_pad // block_kv, batch, kv_heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="flash_backward_dkdv",
    )(*operands)
    return dk, dv, (d_cols[0] if d_cols else None)


def dq(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    q_segment_ids=None,
    kv_segment_ids=None,
    mod_arrays=masks.ModArrays(),
    visits=None,
    *,
    scale,
    band: masks.Band,
    kv_len,
    mods: masks.ScoreMods = masks.ScoreMods(),
    stacks: tiles.ProgramStacks = tiles.ProgramStacks(),
    block_q,
    block_kv,
    num_warps,
    num_stages,
    interpret,
):
    """dQ [batch, q_pad, heads, head_dim_pad] from padded inputs, and the score_mod's row gradients float32
    [batch, heads, values, q_pad] or None (see `backward`)."""
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    num_q_blocks = q_pad // block_q
    has_segments = q_segment_ids is not None
    num_rows = tiles.num_float_grads(mods, "row")
    kernel = functools.partial(
        _dq_kernel,
        scale=scale,
        band=band,
        kv_len=kv_len,
        block_q=block_q,
        block_kv=block_kv,
        num_q_blocks=num_q_blocks,
        num_kv_blocks=kv_pad // block_kv,
        has_segments=has_segments,
        has_visits=visits is not None,
        mods=mods,
        num_rows=num_rows,
    )

    def q_block_of(i):
        return tiles.launch_order(i, num_q_blocks, reverse=band.right == 0)

    q_block_spec, do_block_spec = tiles.head_specs(
        block_q, lambda i, b, h: (b, q_block_of(i), h, 0), head_dim, v.shape[3]
    )
    k_full_spec, v_full_spec = tiles.head_specs(kv_pad, lambda i, b, h: (b, 0, h // group, 0), head_dim, v.shape[3])
    row_spec = pl.BlockSpec((SQUEEZED, SQUEEZED, block_q), lambda i, b, h: (b, h, q_block_of(i)))
    in_specs = [q_block_spec, k_full_spec, v_full_spec, do_block_spec, row_spec, row_spec]
    operands = [q, k, v, do, lse2, delta]
    if has_segments:
        in_specs += [
            pl.BlockSpec((SQUEEZED, block_q), lambda i, b, h: (b, q_block_of(i))),
            pl.BlockSpec((SQUEEZED, kv_pad), lambda i, b, h: (b, 0)),
        ]
        operands += [q_segment_ids, kv_segment_ids]
    mod_ops, mod_specs = tiles.mod_operands(mods, mod_arrays, q_pad, kv_pad, stacks=stacks)
    in_specs, operands = in_specs + mod_specs, operands + mod_ops
    if visits is not None:
        in_specs, operands = [tiles.visits_spec(visits.shape, q_block_of)] + in_specs, [visits] + operands
    out_specs, out_shape = [q_block_spec], [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if num_rows:
        out_specs.append(
            pl.BlockSpec((SQUEEZED, SQUEEZED, num_rows, block_q), lambda i, b, h: (b, h, 0, q_block_of(i)))
        )
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, num_rows, q_pad), jnp.float32))
    dq_, *d_rows = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="flash_backward_dq",
    )(*operands)
    return dq_, (d_rows[0] if d_rows else None)


def _dbias_kernel(
    *refs,
    scale,
    band,
    kv_len,
    block_q,
    block_kv,
    num_q_blocks,
    num_kv_blocks,
    batch,
    heads,
    group,
    has_segments,
    has_tiles,
    mods,
):
    tiles_ref, refs = (refs[0], refs[1:]) if has_tiles else (None, refs)
    (q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref), (q_seg_ref, kv_seg_ref), mod_refs, (dbias_ref,) = (
        tiles.split_refs(refs, 6, has_segments, mods)
    )
    spans_b, spans_h, spans_q, spans_k = (int(d) for d in mods.bias_dims)
    # The program's dbias tile sums dS over the positions the bias broadcasts over: every batch element,
    # head, query block or key block along a dim of size 1, one (the program's own) along a full dim.
    counts = (
        1 if spans_b else batch,
        1 if spans_h else heads,
        1 if spans_q else num_q_blocks,
        1 if spans_k else num_kv_blocks,
    )
    firsts = tuple(
        pl.program_id(axis) * spans for axis, spans in ((2, spans_b), (3, spans_h), (0, spans_q), (1, spans_k))
    )

    def visit(step, dbias):
        index = []  # decode step into (batch, head, q block, kv block) offsets, the last fastest
        for count in reversed(counts):
            # lax.rem/div, not % and //: jnp's floor versions add a sign fix-up whose boolean operand the
            # Triton lowering rejects (step >= 0, so truncating is the same).
            index.append(lax.rem(step, count))
            step = lax.div(step, count)
        b, h, q_block, kv_block = (first + offset for first, offset in zip(firsts, reversed(index)))
        # Tiles outside the causal/window band, or hidden by the block mask, add nothing: skip their loads
        # and matmuls (as the dQ and dK/dV kernels never visit them).
        lo, _, _, hi = blocks.kv_block_range(
            q_block,
            block_q=block_q,
            block_kv=block_kv,
            num_kv_blocks=num_kv_blocks,
            kv_len=kv_len,
            band=band,
            always_mask=True,
        )
        visible = jnp.logical_and(kv_block >= lo, kv_block < hi)
        if has_tiles:
            tile_b, tile_h = b * int(tiles_ref.shape[0] > 1), h * int(tiles_ref.shape[1] > 1)
            visible = jnp.logical_and(visible, tiles_ref[tile_b, tile_h, q_block, kv_block] != 0)
        return lax.cond(visible, lambda: dbias + tile_ds(b, h, q_block, kv_block), lambda: dbias)

    def tile_ds(b, h, q_block, kv_block):
        """dS of one (query block, key block) tile, summed over the bias's broadcast dims."""
        q_slice, k_slice = pl.ds(q_block * block_q, block_q), pl.ds(kv_block * block_kv, block_kv)
        q, do = q_ref[b, q_slice, h, :], do_ref[b, q_slice, h, :]
        k, v = k_ref[b, k_slice, h // group, :], v_ref[b, k_slice, h // group, :]
        position = dict(
            batch=b, head=h, q_start=q_block * block_q, k_start=kv_block * block_kv, block_q=block_q, block_kv=block_kv
        )
        s, _, score_pullback = tiles.modified_logits(
            tiles.dot(q, k, trans_b=True) * scale, mods, mod_refs, pullback=True, **position
        )
        mask = tiles.tile_mask(
            q_block * block_q,
            kv_block * block_kv,
            block_q,
            block_kv,
            band=band,
            kv_len=kv_len,
            q_segment=q_seg_ref[b, q_slice] if has_segments else None,
            kv_segment=kv_seg_ref[b, k_slice] if has_segments else None,
        )
        mask = tiles.visibility(mask, mods, mod_refs, **position)
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        p = jnp.exp2(s - lse2_ref[b, h, q_slice][:, None])
        dp = tiles.dot(do, v, trans_b=True)
        dropout = tiles.dropout_multiplier(mods, mod_refs, **position)
        if dropout is not None:
            dp = dp * dropout
        ds = p * (dp - delta_ref[b, h, q_slice][:, None])  # d loss / d logit
        if score_pullback is not None:  # the bias is added before the score_mod
            ds = score_pullback(ds)[0]
        if not spans_q:
            ds = jnp.sum(ds, axis=0, keepdims=True)
        if not spans_k:
            ds = jnp.sum(ds, axis=1, keepdims=True)
        return ds

    shape = (block_q if spans_q else 1, block_kv if spans_k else 1)
    dbias = lax.fori_loop(0, math.prod(counts), visit, jnp.zeros(shape, jnp.float32))
    dbias_ref[...] = dbias.astype(dbias_ref.dtype)


def dbias(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    q_segment_ids=None,
    kv_segment_ids=None,
    mod_arrays=masks.ModArrays(),
    visible_tiles=None,
    *,
    scale,
    band: masks.Band,
    kv_len,
    mods: masks.ScoreMods,
    stacks: tiles.ProgramStacks = tiles.ProgramStacks(),
    block_q,
    block_kv,
    num_warps,
    num_stages,
    interpret,
):
    """d loss / d bias in the bias's own broadcast shape, padded: float32 [Bb, Hb, Tqb, Tkb] (Tqb = q_pad or
    1, Tkb = kv_pad or 1). Its own pallas_call, so that XLA drops it when nothing consumes the bias's gradient.
    With a block mask, `visible_tiles` (`block_sparse.visible_tiles`, int32 [batch or 1, heads or 1,
    q_pad // block_q, kv_pad // block_kv]) is the optional first operand: hidden tiles contribute nothing.

    Grid (bias query block, bias key block, bias batch, bias head): each program owns one tile of dbias and
    loops over the batch elements, heads and blocks that the bias broadcasts over, recomputing P and dP
    there (so no reduction crosses programs and nothing of size [batch, heads, q_len, kv_len] is stored).
    """
    batch, q_pad, heads, head_dim = q.shape
    kv_pad, kv_heads = k.shape[1], k.shape[2]
    spans_b, spans_h, spans_q, spans_k = mods.bias_dims
    num_q_blocks, num_kv_blocks = q_pad // block_q, kv_pad // block_kv
    out_shape = (batch if spans_b else 1, heads if spans_h else 1, q_pad if spans_q else 1, kv_pad if spans_k else 1)
    operands = [q, k, v, do, lse2, delta]
    if q_segment_ids is not None:
        operands += [q_segment_ids, kv_segment_ids]
    if visible_tiles is not None:
        operands = [visible_tiles] + operands
    mod_ops, mod_specs = tiles.mod_operands(mods, mod_arrays, q_pad, kv_pad, stacks=stacks)
    kernel = functools.partial(
        _dbias_kernel,
        scale=scale,
        band=band,
        kv_len=kv_len,
        block_q=block_q,
        block_kv=block_kv,
        num_q_blocks=num_q_blocks,
        num_kv_blocks=num_kv_blocks,
        batch=batch,
        heads=heads,
        group=heads // kv_heads,
        has_segments=q_segment_ids is not None,
        has_tiles=visible_tiles is not None,
        mods=mods,
    )
    out_block = (SQUEEZED, SQUEEZED, block_q if spans_q else 1, block_kv if spans_k else 1)
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks if spans_q else 1, num_kv_blocks if spans_k else 1, out_shape[0], out_shape[1]),
        in_specs=[tiles.whole_block_spec(x) for x in operands] + mod_specs,
        out_specs=pl.BlockSpec(out_block, lambda i, j, b, h: (b, h, i, j)),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="flash_backward_dbias",
    )(*operands, *mod_ops)


def backward(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    q_segment_ids=None,
    kv_segment_ids=None,
    mod_arrays=masks.ModArrays(),
    block_tables=None,
    *,
    scale,
    band,
    kv_len,
    config,
    interpret,
    mods: masks.ScoreMods = masks.ScoreMods(),
    stacks: tiles.ProgramStacks = tiles.ProgramStacks(),
):
    """Padded inputs -> (dq, dk, dv, dbias or None, d_rows_float or None, d_cols_float or None).

    q: [batch, q_pad, heads, head_dim_pad], do: [..., head_dim_v_pad]; k, v: [batch, kv_pad, kv_heads,
    head_dim_pad / head_dim_v_pad] (powers of two);
    lse2, delta: [batch, heads, q_pad] float32, lse2 = LSE * log2(e) with +inf on rows that saw no key
    (their recomputed P is then exactly 0); optional segment ids int32 [batch, q_pad] / [batch, kv_pad];
    the score modifiers with their unpadded arrays; with a block mask, `block_tables` = (dkdv_visits,
    dq_visits, visible_tiles): per key block of the dK/dV kernel the query blocks to visit, per query block
    of the dQ kernel the key blocks (`block_sparse.visit_tables`), and the dQ tiling's visible tiles for
    dbias. q_pad must be a multiple of both query blocks of `config`, kv_pad of both key blocks; `kv_len` is
    the unpadded key length. dbias (see `dbias`) is computed when there is a bias; XLA removes it when its
    result is unused. `stacks`: the programs' unpadded staged values (`tiles.ProgramStacks`); with a mask_mod
    the visit tables must be given (see `forward`). Where a closed-over float array reaches the score_mod's
    result, d_rows_float [batch, heads, values, q_pad] (from the dQ kernel, summed over keys) and d_cols_float
    [batch, heads, values, kv_pad] (from the dK/dV kernel, summed over queries) are the gradients of its float
    stacks per query head, not yet summed over a stack's broadcast batch or heads; else None.
    """
    dkdv_visits, dq_visits, visible_tiles = block_tables or (None, None, None)
    common = dict(scale=scale, band=band, kv_len=kv_len, interpret=interpret, mods=mods, stacks=stacks)
    inputs = (q, k, v, do, lse2, delta, q_segment_ids, kv_segment_ids, mod_arrays)
    dk, dv, d_cols = dkdv(
        *inputs,
        dkdv_visits,
        block_q=config.block_q_dkv,
        block_kv=config.block_kv_dkv,
        num_warps=config.num_warps_dkv,
        num_stages=config.num_stages_dkv,
        **common,
    )
    dq_, d_rows = dq(
        *inputs,
        dq_visits,
        block_q=config.block_q_dq,
        block_kv=config.block_kv_dq,
        num_warps=config.num_warps_dq,
        num_stages=config.num_stages_dq,
        **common,
    )
    dbias_ = None
    if mods.bias_dims is not None:
        dbias_ = dbias(
            *inputs,
            visible_tiles,
            block_q=config.block_q_dq,
            block_kv=config.block_kv_dq,
            num_warps=config.num_warps_dq,
            num_stages=_dbias_stages(config, q, mods, mod_arrays),
            **common,
        )
    return dq_, dk, dv, dbias_, d_rows, d_cols


def _dbias_stages(config, q, mods: masks.ScoreMods, mod_arrays: masks.ModArrays) -> int:
    """Pipeline stages for the dbias kernel. Its loop streams Q, dO, K and V tiles (and a bias tile) every
    step, where the dQ kernel keeps Q and dO resident, and Triton buffers `num_stages` copies of them: as
    many stages as fit the dQ kernel's own fitted footprint (1 at head_dim 128 in bf16, where 3 asked for
    288 KiB on the H100, over its 227 KiB, once the loop had more than one step: a bias broadcast over
    batch or heads)."""
    row = q.shape[3] * q.dtype.itemsize
    spans_both = mods.bias_dims[2] and mods.bias_dims[3]
    tile_bytes = mod_arrays.bias.dtype.itemsize if spans_both else 0
    if mods.mask_dims is not None and mods.mask_dims[2] and mods.mask_dims[3]:
        tile_bytes += 4  # the mask travels as int32 (tiles.mod_operands)
    per_stage = (
        2 * config.block_q_dq + 2 * config.block_kv_dq
    ) * row + config.block_q_dq * config.block_kv_dq * tile_bytes
    budget = config.shared_memory(q.shape[3], q.dtype.itemsize, tile_bytes)["dq"]
    return max(1, min(config.num_stages_dq, budget // per_stage))
