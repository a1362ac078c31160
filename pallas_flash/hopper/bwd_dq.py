"""The Hopper dQ kernel of the two-pass backward: one CTA per (batch, head, tile of 2 * block_q_dq queries), a
producer streaming K/V blocks through a ring, two consumers with Q, dO, lse2 and delta resident: S = Q K^T,
dP = dO V^T, dS = P (dP - delta), dQ += dS K (optionally pipelined, `HopperBwdConfig.dq_overlap`). With
`HopperBwdConfig.split_columns` the CTA owns block_q_dq queries, Q and dO resident once, and each consumer
accumulates half of dQ's columns (both compute the block's S and dP)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import blocks, masks
from pallas_flash.blocks import LOG2E
from pallas_flash.hopper.common import (
    REGISTERS,
    DenseMods,
    add_product,
    biased_logits,
    block_of,
    column_half,
    dense_riders,
    dense_ring,
    dense_tiles,
    dot_t,
    drain_last_phases,
    drain_ring,
    hand_over,
    head_dim_transforms,
    launched_item,
    load_own_ids,
    long_tiles_first,
    masked_edge_loops,
    narrow_to_mask_ranges,
    outside_hull_hidden,
    product_t,
    program_mask,
    program_score,
    query_tile_schedule,
    register_ops,
    segment_block_ranges,
    segment_scratch,
    serves_split_products,
    stack_index,
    step_of,
    stream_kv_blocks,
    tile_visible,
    unmasked_blocks,
    wgmma_operand,
)
from pallas_flash.hopper.config import NUM_CONSUMERS, HopperBwdConfig
from pallas_flash.hopper.fwd import KernelDropout, KernelMods, positions


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    q_ids_ref,
    kv_ids_ref,
    kv_ranges_ref,
    rows_ref,
    cols_ref,
    mask_ranges_ref,
    bias_ref,
    mask_ref,
    dq_ref,
    d_rows_ref,
    dbias_ref,
    scoped,
    *,
    scale: float,
    band: masks.Band,
    kv_len: int,
    num_q_tiles: int,
    group: int,
    config: HopperBwdConfig,
    programs: KernelMods,
    interpreting: bool,
    dropout: KernelDropout | None = None,
    seed_ref=None,
    launch_ref=None,
    dense: DenseMods = DenseMods(),
):
    """Grid (batch, heads, q_tiles), 3 warpgroups ("wg"): 0 and 1 consume, 2 produces. launch_ref: None, or int32
    [batch * heads * q_tiles], the item each CTA takes (`common.long_tiles_first`).

    Shapes and `interpreting` as in `_dkdv_kernel`; dq_ref like q_ref. `programs`: the score and mask
    programs with rows_ref (resident per consumer) and cols_ref (riding the K ring) their packed values,
    mask_ranges_ref the key blocks per query tile of the mask program, the dense and the block mask
    (`mask_block_ranges`), and d_rows_ref None
    or float32 [batch, heads, n, q_pad]: the gradient of the score program's float row values. `dropout`:
    None, or the forward's dropout (dP = Z (dO V^T), Z = keep / (1 - rate)), seed_ref its seed table.
    bias_ref/mask_ref: None or `dense`'s arrays [Bd, Hd, q_pad, kv_pad] (tiles riding the K ring); dbias_ref:
    with a bias, float32 [batch, heads, q_pad, kv_pad]: dS (the gradient of the biased logit) of every tile,
    zeros where the CTA visits no block. Q, K and dQ at query's head_dim, V and dO at value's (may differ)."""
    (
        (q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem),
        resident_ready,
        (k_ready, v_ready),
        (k_free, v_free),
        segments,
        mod_scratch,
        ring,
        dbias_smem,
        split_barriers,
        shared_scratch,
    ) = scoped
    split = config.split_columns
    tile_rows = config.row_tiles * config.block_q_dq
    score_mod, mask_mod = programs.score, programs.mask
    has_segments = q_ids_ref is not None
    block_q, block_kv, num_stages = config.block_q_dq, config.block_kv_dq, config.num_stages_dq
    num_kv_blocks = k_ref.shape[1] // block_kv
    max_position = max(q_ref.shape[1], k_ref.shape[1])  # positions the programs see are below it
    dtype = q_ref.dtype
    grid = (q_ref.shape[0], q_ref.shape[2], num_q_tiles)
    batch, head, grid_tile = launched_item(launch_ref, grid, ("batch", "heads", "q_tiles"))
    tile_start, kv_lo, kv_hi, same = query_tile_schedule(
        num_q_tiles,
        block_q=block_q,
        block_kv=block_kv,
        num_kv_blocks=num_kv_blocks,
        kv_len=kv_len,
        band=band,
        segment_ranges=kv_ranges_ref,
        tile=grid_tile,
        batch=batch,
        tile_rows=tile_rows,
    )
    hull = gap = None
    if mask_ranges_ref is not None:
        kv_lo, kv_hi, same, gap = narrow_to_mask_ranges(
            kv_lo,
            kv_hi,
            same,
            mask_ranges_ref,
            batch=batch,
            head=head,
            tile=lax.div(tile_start, tile_rows),
            num_kv_blocks=num_kv_blocks,
        )
        if dense.hide_outside_hull:
            b, h = stack_index(mask_ranges_ref, batch, head)
            tile = lax.div(tile_start, tile_rows)
            hull = mask_ranges_ref[b, h, tile, 0], mask_ranges_ref[b, h, tile, 1]
    steps_hi = step_of(gap, kv_hi)  # the tile's steps are [kv_lo, steps_hi): the gap's blocks are skipped
    wg = lax.axis_index("wg")
    iota, zeros, load_vector = register_ops(interpreting)
    consumer_registers, producer_registers = REGISTERS

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        own = 0 if split else wg  # this consumer's row tile (split_columns: the one both share)
        # split_columns: Q and dO are single tiles (an index would reach the wgmmas as a constant JAX 0.12's
        # lowering of their run_state cannot take).
        q_smem, do_smem = (q_smem2, do_smem2) if split else (q_smem2.at[wg], do_smem2.at[wg])
        q_start = tile_start + own * block_q
        rows = (batch, pl.ds(q_start, block_q), head)
        vector = (batch, head, pl.ds(q_start, block_q))
        # (source, destination, slot): Q and dO in the row tile's slot, lse2 and delta in each consumer's own
        copies = (
            (q_ref.at[rows], q_smem, own),
            (do_ref.at[rows], do_smem, own),
            (lse2_ref.at[vector], lse_smem2.at[wg], wg),
            (delta_ref.at[vector], delta_smem2.at[wg], wg),
        )
        for (src, dst, slot), ready in zip(copies, resident_ready):
            if split and slot is own:  # one copy of the shared tiles
                pl.when(wg == 0)(functools.partial(plgpu.copy_gmem_to_smem, src, dst, ready.at[slot]))
            else:
                plgpu.copy_gmem_to_smem(src, dst, ready.at[slot])
        # split_columns: this consumer's columns of dQ (K's); else all of them.
        k_cols = column_half(q_smem, wg) if split else None
        row = plgpu.Layout.WGMMA.reduce(1)  # a per-query vector, broadcast along the keys of S
        q_seg = None
        if has_segments:
            q_ids_smem, kv_ids_smem, q_ids_ready, kv_ids_ready = segments
            q_seg = load_own_ids(
                q_ids_ref,
                q_ids_smem,
                q_ids_ready,
                wg=wg,
                batch=batch,
                start=q_start,
                size=block_q,
                layout=row,
                load=load_vector,
            )
        for (_, _, slot), ready in zip(copies, resident_ready):
            plgpu.barrier_wait(ready.at[slot])
        lse2 = load_vector(lse_smem2.at[wg], row)
        delta = load_vector(delta_smem2.at[wg], row)
        c = scale * LOG2E
        column = plgpu.Layout.WGMMA.reduce(0)  # a per-key vector, broadcast along the queries of S
        rows_smem, rows_ready, cols_smem, cols_ready, d_rows_smem = mod_scratch
        if rows_ref is not None:
            plgpu.copy_gmem_to_smem(
                rows_ref.at[(*stack_index(rows_ref, batch, head), slice(None), pl.ds(q_start, block_q))],
                rows_smem.at[wg],
                rows_ready.at[wg],
            )
            plgpu.barrier_wait(rows_ready.at[wg])
        # The programs' staged values of this warpgroup's queries (`ModValues`), resident.
        row_values = programs.values("row", lambda i: load_vector(rows_smem.at[wg, i], row), masked=True)
        grads = score_mod is not None and score_mod.needs_grad
        if dropout is not None:  # this warpgroup's queries' hashes, once
            dropout_hash = dropout.row_hash(
                seed_ref, batch, head, positions(q_start, block_q, row, interpreting=interpreting)
            )

        def slot_of(t):  # the ring slot of step t
            return lax.rem(t - kv_lo, num_stages)

        def issue_s_dp(s_ref, dp_ref, slot):  # S = Q K^T and dP = dO V^T
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            plgpu.wgmma(dp_ref, do_smem, v_smem.at[slot].transpose((1, 0)))

        def s_and_dp(slot):  # S and dP waited for (one wait for both)
            if interpreting:
                return (
                    dot_t(wgmma_operand(q_smem), wgmma_operand(k_smem.at[slot])),
                    dot_t(wgmma_operand(do_smem), wgmma_operand(v_smem.at[slot])),
                )

            def products(s_ref, dp_ref):
                issue_s_dp(s_ref, dp_ref, slot)
                return s_ref[...], dp_ref[...]

            return pl.run_scoped(
                products, plgpu.ACC((block_q, block_kv), jnp.float32), plgpu.ACC((block_q, block_kv), jnp.float32)
            )

        def band_visible(shape, kv_step, slot, *, masked: bool):
            """(visibility of block kv_step's [block_q, block_kv] tile under the band, the ragged last block and
            segment ids, its key positions): (None, None) where not `masked`. The block's ids ride with K (released
            with it): every step waits for them (one wait per phase), masked ones read them."""
            kv_seg = None
            if has_segments:
                plgpu.barrier_wait(kv_ids_ready.at[slot])
                if masked:
                    kv_seg = load_vector(kv_ids_smem.at[slot], column)
            if not masked:
                return None, None
            kv_pos = kv_step * block_kv + iota(shape, 1)
            visible = tile_visible(
                q_start + iota(shape, 0),
                kv_pos,
                band=band,
                kv_len=kv_len if kv_len % block_kv else None,
                q_seg=q_seg,
                kv_seg=kv_seg,
                shape=shape,
                q_axis=0,
            )
            return visible, kv_pos

        def d_scores(s, dp, kv_step, slot, *, masked: bool):
            """(dS, d rows) of block kv_step: dS = P (dP - delta) (float32), P recomputed from S and lse2, with a
            score program taken back through it to the raw logits; d rows: the block's part of the gradient of
            the score program's float row values (one vector each; none without `grads`)."""
            position = pullback = None
            if score_mod is not None or (masked and mask_mod is not None):  # the positions the programs read
                position = dict(
                    batch=batch,
                    head=head,
                    q_idx=lambda: positions(q_start, block_q, row, interpreting=interpreting),
                    kv_idx=lambda: positions(kv_step * block_kv, block_kv, column, interpreting=interpreting),
                    q_axis=0,
                    tile_shape=s.shape,
                    max_position=max_position,
                )
            if cols_ref is not None:  # the block's values ride with K; every step waits (one wait per phase)
                plgpu.barrier_wait(cols_ready.at[slot])
            cols = programs.values("col", lambda i: load_vector(cols_smem.at[slot, i], column), masked=masked)
            bias, dense_visible = dense_tiles(ring, slot, wg=own, rows=block_q, load=load_vector, read_mask=masked)
            logit_scale, logit_c, cap_grad = scale, c, None
            if dense.forms_logits:  # the soft cap and the bias act on scale * s: natural units from here on
                s, cap_grad = biased_logits(s, bias, scale=scale, soft_cap=dense.soft_cap)
                logit_scale, logit_c = 1.0, LOG2E
            if score_mod is None:
                p = jnp.exp2(s * logit_c - lax.broadcast_in_dim(lse2, s.shape, [0]))
            else:
                logits2, pullback, row2 = program_score(
                    score_mod, s, row_values.score, cols.score, scale=logit_scale, grad_side="row" if grads else None,
                    key_before_query=band.keys_before_queries,
                    origin=kv_step * block_kv,
                    **position
                )  # fmt: skip
                shift = lse2 if row2 is None else lse2 - row2
                p = jnp.exp2(logits2 - lax.broadcast_in_dim(shift, s.shape, [0]))
            visible, kv_pos = band_visible(s.shape, kv_step, slot, masked=masked)
            if masked:
                if mask_mod is not None:
                    seen = program_mask(mask_mod, row_values.mask, cols.mask, **position)
                    visible = seen if visible is None else visible & seen
                if hull is not None:
                    visible = outside_hull_hidden(visible, kv_pos, hull, block_kv)
                if visible is not None:  # None: traced for a loop that runs no iterations
                    p = jnp.where(visible, p, 0.0)
            if dense_visible is not None:
                p = jnp.where(dense_visible, p, 0.0)
            if dropout is not None:  # dO V^T is the gradient of the dropped, rescaled P
                keep = dropout.keep(dropout_hash, kv_step * block_kv + iota(s.shape, 1), q_axis=0)
                dp = jnp.where(keep, dp * dropout.scale, 0.0)
            ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))
            ds, d_rows = (ds, ()) if pullback is None else pullback(ds)
            if dbias_ref is not None:  # the gradient of the biased logit, before the soft cap's derivative
                pl.when(wg == 0)(lambda: store_dbias(ds, kv_step)) if split else store_dbias(ds, kv_step)
            return (ds, d_rows) if cap_grad is None else (cap_grad(ds), d_rows)

        def store_dbias(tile, kv_step):
            """This warpgroup's float32 [block_q, block_kv] `tile` of dbias_ref at key block kv_step, through its
            staging tile (once the previous store has read it)."""
            staging = dbias_smem.at[own]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            staging[...] = tile
            plgpu.commit_smem()
            keys = pl.ds(kv_step * block_kv, block_kv)
            plgpu.copy_smem_to_gmem(staging, dbias_ref.at[batch, head, pl.ds(q_start, block_q), keys])

        def add_rows(acc, d_rows):
            return tuple(a + d for a, d in zip(acc, d_rows))

        def k_part(slot):  # the K operand of this consumer's dQ product: its columns with split_columns
            return k_smem.at[slot] if k_cols is None else k_smem.at[slot, :, k_cols]

        def add_ds_k(dq, ds, slot):  # dQ += dS K (dS in the input dtype), waited for
            if interpreting:
                return dq + jnp.dot(ds.astype(dtype), wgmma_operand(k_part(slot)), preferred_element_type=jnp.float32)
            return pl.run_state(lambda dq_ref: plgpu.wgmma(dq_ref, ds.astype(dtype), k_part(slot)))(plgpu.ACC.init(dq))

        def step(t, carry, *, masked: bool):
            dq, acc = carry
            slot, kv_step = slot_of(t), block_of(gap, t)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])

            s, dp = s_and_dp(slot)
            plgpu.barrier_arrive(v_free.at[slot])
            ds, d_rows = d_scores(s, dp, kv_step, slot, masked=masked)
            dq = add_ds_k(dq, ds, slot)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq, add_rows(acc, d_rows)

        def overlapped_step(t, carry, *, masked: bool):
            """`config.dq_overlap`: issues S_j and dP_j, then dQ += dS_{j-1} K_{j-1}, waits for S_j and dP_j
            alone (wgmmas complete in order) and computes dS_j while that dQ product runs; K_{j-1} is
            released once it is done, so the ring holds two key blocks per consumer at a time."""
            dq, ds_prev, acc = carry
            slot, prev, kv_step = slot_of(t), slot_of(t - 1), block_of(gap, t)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            if interpreting:  # the same steps, one product at a time
                s, dp = s_and_dp(slot)
                plgpu.barrier_arrive(v_free.at[slot])
                ds, d_rows = d_scores(s, dp, kv_step, slot, masked=masked)
                dq = add_ds_k(dq, ds_prev, prev)
            else:

                def products(s_ref, dp_ref, dq_ref):
                    dq_ref[...] = dq
                    issue_s_dp(s_ref, dp_ref, slot)
                    plgpu.wgmma(dq_ref, ds_prev, k_part(prev))
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_j, dP_j done; dQ may run on
                    dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=None)
                    plgpu.barrier_arrive(v_free.at[slot])
                    ds, d_rows = d_scores(s, dp, kv_step, slot, masked=masked)
                    return dq_ref[...], ds, d_rows

                dq, ds, d_rows = pl.run_scoped(
                    products,
                    plgpu.ACC((block_q, block_kv), jnp.float32),
                    plgpu.ACC((block_q, block_kv), jnp.float32),
                    plgpu.ACC(dq.shape, jnp.float32),
                )
            plgpu.barrier_arrive(k_free.at[prev])
            return dq, ds.astype(dtype), add_rows(acc, d_rows)

        # dq_split_products: consumer 0 computes a key block's S and P, consumer 1 its dP and, from P passed through
        # shared memory, dS, which it passes back: each then adds its columns of dQ from the shared dS tile (no
        # product done twice). One slot each for P and dS: consumer 0 rewrites P once consumer 1 has read it
        # ("p_free"), consumer 1 rewrites dS once both dQ products of the last step have read it ("ds_free").
        split_products = shared_scratch is not None  # `dq_pass` allocates it where the call takes this way

        def shared_step(step_index, carry, *, masked: bool):
            dq, acc = carry
            p_smem, ds_smem, (p_ready, p_free, ds_ready, ds_free) = shared_scratch
            slot, kv_step = slot_of(step_index), block_of(gap, step_index)
            t = step_index - kv_lo
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])

            @pl.when(wg == 0)
            def _():
                s = product_t(q_smem, k_smem.at[slot], interpreting=interpreting)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(lse2, s.shape, [0]))
                visible, _ = band_visible(s.shape, kv_step, slot, masked=masked)
                if visible is not None:  # None: unmasked, or traced for a loop that runs no iterations
                    p = jnp.where(visible, p, 0.0)
                hand_over(p_smem, p, ready=p_ready, free=p_free, reuse=t > 0)

            @pl.when(wg == 1)
            def _():
                dp = product_t(do_smem, v_smem.at[slot], interpreting=interpreting)
                plgpu.barrier_wait(p_ready)
                p = load_vector(p_smem, plgpu.Layout.WGMMA)
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_free)
                ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))

                hand_over(ds_smem, ds.astype(dtype), ready=ds_ready, free=ds_free, reuse=t > 0)

            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_wait(ds_ready)
            dq = add_product(dq, ds_smem, k_part(slot), interpreting=interpreting)
            plgpu.barrier_arrive(ds_free)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq, acc

        # Only the band's edges, the ragged last block and (with segment ids) blocks that are not wholly in
        # the tile's one segment pay for the mask.
        _, *band_range, _ = blocks.kv_block_range(
            lax.div(q_start, block_q),
            block_q=block_q,
            block_kv=block_kv,
            num_kv_blocks=num_kv_blocks,
            kv_len=kv_len,
            band=band,
            always_mask=False,
        )
        unmasked_lo, unmasked_hi = (step_of(gap, b) for b in unmasked_blocks(band_range, (kv_lo, kv_hi), same))
        # Without a left band edge, segment ids or block ranges (a mask program's, a dense or a block mask's),
        # unmasked_lo == kv_lo: no leading edge.
        leading = band.left is not None or has_segments or mask_ranges_ref is not None
        dq = zeros((block_q, q_smem.shape[-1] if k_cols is None else k_cols.size))
        # The gradient of each float row value of the score program, summed over the visited key blocks.
        num_d_rows = 0 if d_rows_ref is None else d_rows_ref.shape[2]
        acc = tuple(zeros((block_q, block_kv)).sum(axis=1) for _ in range(num_d_rows))
        if config.dq_overlap:  # block kv_lo (no dQ product before it) is peeled off and masked; kv_hi > kv_lo
            first = slot_of(kv_lo)
            plgpu.barrier_wait(k_ready.at[first])
            plgpu.barrier_wait(v_ready.at[first])
            s, dp = s_and_dp(first)
            plgpu.barrier_arrive(v_free.at[first])
            ds, d_rows = d_scores(s, dp, kv_lo, first, masked=True)
            ds = ds.astype(dtype)
            unmasked_lo, unmasked_hi = (jnp.maximum(edge, kv_lo + 1) for edge in (unmasked_lo, unmasked_hi))
            dq, ds_last, acc = masked_edge_loops(
                overlapped_step,
                (dq, ds, add_rows(acc, d_rows)),
                kv_lo + 1 if leading else None,
                unmasked_lo,
                unmasked_hi,
                steps_hi,
            )
            last = slot_of(steps_hi - 1)
            dq = add_ds_k(dq, ds_last, last)
            plgpu.barrier_arrive(k_free.at[last])
        else:
            step_fn = shared_step if split_products else step
            dq, acc = masked_edge_loops(
                step_fn, (dq, acc), kv_lo if leading else None, unmasked_lo, unmasked_hi, steps_hi
            )
            if split_products:  # consumer 0 waits p_free's phases, consumer 1 ds_free's
                drain_last_phases(steps_hi - kv_lo, wg, shared_scratch[2][1::2])

        def store_zeros_and_rows():
            """dbias's zeros outside the visited key blocks and the program's row gradients (split_columns: one
            consumer's, as both hold the same)."""
            if dbias_ref is not None:  # dS is 0 in the key blocks this tile does not visit
                zero_tile = zeros((block_q, block_kv))
                pl.loop(0, kv_lo)(lambda kv_step: store_dbias(zero_tile, kv_step))
                pl.loop(kv_hi, num_kv_blocks)(lambda kv_step: store_dbias(zero_tile, kv_step))
                if gap is not None:
                    pl.loop(gap.start, gap.start + gap.length)(lambda kv_step: store_dbias(zero_tile, kv_step))
            if acc:  # the score program's float row gradients (the d_rows_ref rows of this warpgroup's queries)
                for i, d_row in enumerate(acc):
                    d_rows_smem.at[wg, i][...] = d_row
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(d_rows_smem.at[wg], d_rows_ref.at[batch, head, :, pl.ds(q_start, block_q)])

        def store_dq():
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        if not split:
            store_zeros_and_rows()
            q_smem[...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            store_dq()
            return
        pl.when(wg == 0)(store_zeros_and_rows)
        # Q is shared: overwrite it with dQ once neither consumer's wgmmas read it; one store, once both wrote.
        halves_read, halves_written = split_barriers
        plgpu.barrier_arrive(halves_read)
        plgpu.barrier_wait(halves_read)
        q_smem.at[:, k_cols][...] = (dq * scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(halves_written)

        @pl.when(wg == 0)
        def _():
            plgpu.barrier_wait(halves_written)
            store_dq()

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")
        ids = None if not has_segments else (kv_ids_ref, segments[1], segments[3])
        riders = ()
        if cols_ref is not None:
            b, h = stack_index(cols_ref, batch, head)
            riders = ((lambda keys: cols_ref.at[b, h, :, keys], mod_scratch[2], mod_scratch[3]),)
        riders += dense_riders((bias_ref, mask_ref), ring, batch=batch, head=head, rows=pl.ds(tile_start, tile_rows))
        stream_kv_blocks(
            (k_ref, v_ref),
            (k_smem, v_smem),
            (k_ready, v_ready),
            (k_free, v_free),
            batch=batch,
            kv_head=lax.div(head, group),
            block_kv=block_kv,
            num_stages=num_stages,
            kv_lo=kv_lo,
            kv_hi=steps_hi,
            kv_ids=ids,
            riders=riders,
            gap=gap,
        )
        if interpreting:
            drain_ring((k_free, v_free), num_stages=num_stages, steps=steps_hi - kv_lo)


def dq_pass(
    q,
    k,
    v,
    d_out,
    lse2,
    delta,
    q_ids,
    kv_ids,
    mod_operands=(None, None, None),
    *,
    scale: float,
    band: masks.Band,
    kv_len: int,
    config: HopperBwdConfig,
    programs: KernelMods = KernelMods(),
    dropout: KernelDropout | None = None,
    dropout_seed=None,
    dense_arrays=(None, None),
    dense: DenseMods = DenseMods(),
    interpret,
):
    """dq [batch, q_pad, heads, d]; with a score program whose float values need gradients (`needs_grad`) or a
    dense bias, (dq, d_rows, dbias), each None where absent: d_rows float32 [batch, heads, n, q_pad], the
    gradient of each of the program's float row values per query (summed over keys); dbias float32 [batch,
    heads, q_pad, kv_pad], dS per query head (to be summed over the bias's broadcast dims). mod_operands: the
    programs' packed row and column values and the mask program's key blocks per query tile
    (`mask_block_ranges`), each None where absent; dropout_seed: `dropout`'s seed table
    (`fwd.kernel_dropout`); dense_arrays: `dense`'s (bias, mask) (`common.dense_operands`), each None where
    absent."""
    batch, q_pad, heads, head_dim = q.shape
    head_dim_v = v.shape[3]
    block_q, block_kv, num_stages = config.block_q_dq, config.block_kv_dq, config.num_stages_dq
    tiles = config.row_tiles
    num_q_tiles = q_pad // (tiles * block_q)
    has_segments = q_ids is not None
    # Q and K under one swizzle (S = Q K^T), V and dO under theirs: each the widest that divides its row, with
    # split_columns half of it.
    transforms_qk = head_dim_transforms(head_dim, split=config.split_columns)
    transforms_v = head_dim_transforms(head_dim_v, split=config.split_columns)

    rows, cols, ranges = mod_operands
    score_mod = programs.score
    # Under block ranges long query tiles launch first (`long_tiles_first`; a causal band's grid runs its tiles in
    # reverse, `query_tile_schedule`).
    launch = None
    if ranges is not None:
        reverse = band.right is not None and band.left is None
        with jax.ensure_compile_time_eval():  # a constant for a block mask's ranges
            launch = long_tiles_first(ranges, batch=batch, heads=heads, num_tiles=num_q_tiles, reverse_tiles=reverse)
    # dq_split_products where it serves the call (the others run split_columns' way, without its scratch).
    shares_ds = config.dq_split_products and serves_split_products(mod_operands, dense_arrays, dropout, programs, dense)
    num_d_rows = len(score_mod.group("row", "float")) if score_mod is not None and score_mod.needs_grad else 0

    def flash_backward_dq_sm90(*refs):  # the kernel's name in profiles
        refs = list(refs)
        inputs = [refs.pop(0) for _ in range(6)]
        segment_refs = [refs.pop(0) for _ in range(3)] if has_segments else [None] * 3
        mod_refs = [None if x is None else refs.pop(0) for x in mod_operands]
        dense_refs = [None if x is None else refs.pop(0) for x in dense_arrays]
        seed_ref = None if dropout is None else refs.pop(0)
        launch_ref = None if launch is None else refs.pop(0)
        dq_ref = refs.pop(0)
        d_rows_ref = refs.pop(0) if num_d_rows else None
        dbias_ref = refs.pop(0) if dense.writes_dbias else None
        # Row values per consumer, the column values' ring, their barriers; the float row gradients' staging.
        mod_scratch = (
            None if rows is None else plgpu.SMEM((NUM_CONSUMERS, rows.shape[2], block_q), jnp.int32),
            None if rows is None else plgpu.Barrier(num_barriers=NUM_CONSUMERS),
            None if cols is None else plgpu.SMEM((num_stages, cols.shape[2], block_kv), jnp.int32),
            None if cols is None else plgpu.Barrier(num_barriers=num_stages),
            plgpu.SMEM((NUM_CONSUMERS, num_d_rows, block_q), jnp.float32) if num_d_rows else None,
        )
        resident = (block_q,) if config.split_columns else (NUM_CONSUMERS, block_q)  # split: both consumers' tile
        smem = (
            plgpu.SMEM((*resident, head_dim), q.dtype, transforms=transforms_qk),
            plgpu.SMEM((*resident, head_dim_v), d_out.dtype, transforms=transforms_v),
            plgpu.SMEM((NUM_CONSUMERS, block_q), jnp.float32),
            plgpu.SMEM((NUM_CONSUMERS, block_q), jnp.float32),
            plgpu.SMEM((num_stages, block_kv, head_dim), k.dtype, transforms=transforms_qk),
            plgpu.SMEM((num_stages, block_kv, head_dim_v), v.dtype, transforms=transforms_v),
        )
        body = functools.partial(
            _dq_kernel,
            scale=scale,
            band=band,
            kv_len=kv_len,
            num_q_tiles=num_q_tiles,
            group=heads // k.shape[2],
            config=config,
            programs=programs,
            interpreting=interpret is not None,
            dropout=dropout,
            seed_ref=seed_ref,
            launch_ref=launch_ref,
            dense=dense,
        )
        pl.run_scoped(
            lambda *scoped: body(*inputs, *segment_refs, *mod_refs, *dense_refs, dq_ref, d_rows_ref, dbias_ref, scoped),
            smem,
            (plgpu.Barrier(num_barriers=NUM_CONSUMERS),) * 4,
            (plgpu.Barrier(num_barriers=num_stages),) * 2,
            (plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=num_stages),) * 2,
            segment_scratch(has_segments, (NUM_CONSUMERS, block_q), (num_stages, block_kv)),
            mod_scratch,
            dense_ring(dense_arrays, num_stages, tiles * block_q, block_kv),
            # each row tile's dS tile on its way to dbias (float32, 128-byte swizzle over (8, 32)-element tiles)
            plgpu.SMEM(
                (tiles, block_q, block_kv),
                jnp.float32,
                transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)),
            )
            if dense.writes_dbias
            else None,
            # split_columns: both consumers are done reading Q; both wrote their halves of dQ
            (plgpu.Barrier(num_arrivals=NUM_CONSUMERS),) * 2 if config.split_columns else None,
            # dq_split_products: a block's P (float32) and dS tiles between the consumers, and their barriers (p_ready,
            # p_free, ds_ready, ds_free)
            (
                plgpu.SMEM(
                    (block_q, block_kv),
                    jnp.float32,
                    transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)),
                ),
                # dS multiplies the consumer's columns of K: under K's swizzle, the only one wgmma pairs it with
                plgpu.SMEM((block_q, block_kv), q.dtype, transforms=transforms_qk),
                (
                    plgpu.Barrier(),
                    plgpu.Barrier(),
                    plgpu.Barrier(),
                    plgpu.Barrier(num_arrivals=NUM_CONSUMERS),
                ),
            )
            if shares_ds
            else None,
            collective_axes="wg",
        )

    operands = (q, k, v, d_out, lse2, delta)
    if has_segments:
        operands += (
            q_ids,
            kv_ids,
            segment_block_ranges(q_ids, kv_ids, rows_per_tile=tiles * block_q, cols_per_block=block_kv),
        )
    operands += tuple(x for x in mod_operands if x is not None)
    operands += tuple(x for x in dense_arrays if x is not None)
    if dropout is not None:
        operands += (dropout_seed,)
    if launch is not None:
        operands += (launch,)
    extras = (
        jax.ShapeDtypeStruct((batch, heads, num_d_rows, q_pad), jnp.float32) if num_d_rows else None,
        jax.ShapeDtypeStruct((batch, heads, q_pad, k.shape[1]), jnp.float32) if dense.writes_dbias else None,
    )
    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    has_extras = any(x is not None for x in extras)
    if has_extras:
        out_type = (out_type, *(x for x in extras if x is not None))
    results = plgpu.kernel(
        flash_backward_dq_sm90,
        out_type=out_type,
        grid=(batch, heads, num_q_tiles),
        grid_names=("batch", "heads", "q_tiles"),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({} if interpret is None else dict(interpret=interpret)),
    )(*operands)
    if not has_extras:
        return results
    dq, *rest = results
    return (dq, *(None if x is None else rest.pop(0) for x in extras))
