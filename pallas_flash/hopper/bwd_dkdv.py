"""The Hopper dK/dV kernel: one CTA per (batch, kv head, tile of 2 * block_kv_dkv keys), a producer streaming
Q, dO, lse2 and delta through a ring, two consumers each holding block_kv_dkv key rows with K and V resident;
in the transposed tiles S^T = K Q^T, P^T = exp2(c S^T - lse2), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T -
delta), dK += dS^T Q. With `HopperBwdConfig.dq_atomic` it is the one pass and also adds each query block's
dQ = dS K into a float32 buffer (`bwd_ordered` for the split and the order of those adds). With
`HopperBwdConfig.split_columns` the CTA owns block_kv_dkv keys, K and V resident once, and each consumer
accumulates half of dK's and dV's columns (both compute the block's S^T and dP^T, or with
`HopperBwdConfig.dkv_split_products` one S^T and P^T, the other dP^T and dS^T, shared)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import blocks, masks
from pallas_flash.blocks import LOG2E
from pallas_flash.hopper.bwd_ordered import (
    DqOrder,
    dq_order_ranks,
    dq_split,
    dq_visited_rows,
    ordered_cta,
    ordered_launch,
    pairs_per_group,
    split_dq_product,
    store_dq_in_order,
    tile_visits,
    visited_q_blocks,
)
from pallas_flash.hopper.common import (
    REGISTERS,
    DenseMods,
    add_product,
    biased_logits,
    block_of,
    clip_gap,
    column_half,
    dense_ring,
    dense_tiles,
    dot_t,
    drain_last_phases,
    drain_ring,
    fill_ring,
    hand_over,
    head_dim_transforms,
    launched_item,
    load_own_ids,
    long_tiles_first,
    masked_edge_loops,
    outside_hull_hidden,
    product_t,
    program_mask,
    program_score,
    register_ops,
    segment_block_ranges,
    segment_scratch,
    serves_split_products,
    stack_index,
    step_block,
    step_of,
    swizzle_transforms,
    tile_visible,
    unmasked_blocks,
    wgmma_operand,
)
from pallas_flash.hopper.config import NUM_CONSUMERS, HopperBwdConfig
from pallas_flash.hopper.fwd import KernelDropout, KernelMods, positions

# The ordered one pass's producer warp by warp: warp 1 adds dQ in order, the others issue a step's copies ("q": Q
# and the segment ids; "lse2", "do", "delta"). On a full band one warp issues them all (two cost 4-7% there);
# under a band dO and delta come from a second warp (0.5-0.7% faster on the H100; a third warp tied).
ALL_COPIES = ("q", "lse2", "do", "delta")


BANDED_LOAD_WARPS = {0: ("q", "lse2"), 2: ("do", "delta")}


def _dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse2_ref,
    delta_ref,
    q_ids_ref,
    kv_ids_ref,
    q_ranges_ref,
    rows_ref,
    cols_ref,
    mask_ranges_ref,
    bias_ref,
    mask_ref,
    dq_acc_ref,
    dk_ref,
    dv_ref,
    d_cols_ref,
    scoped,
    *,
    scale: float,
    band: masks.Band,
    kv_len: int,
    group: int,
    config: HopperBwdConfig,
    programs: KernelMods,
    interpreting: bool,
    dq_order=None,
    dropout: KernelDropout | None = None,
    seed_ref=None,
    launch_ref=None,
    dense: DenseMods = DenseMods(),
    split_products: bool = False,
    query_gap: bool = False,
):
    """Grid (batch, kv_heads, kv_tiles) (with config.dq_ordered `ordered_launch`'s), 3 warpgroups ("wg"):
    0 and 1 consume, 2 produces (with config.dq_ordered its first warp loads, its second stores dQ).
    launch_ref: None, or int32 [batch * kv_heads * kv_tiles], the item each CTA takes (`common.long_tiles_first`).
    query_gap: the steps skip the block ranges' gap of query blocks (`Gap`): on where a key tile's visible query
    blocks may form two runs (a mask program that ORs in global queries, `mods.Staged.ors_query_term`; a block
    mask's global query blocks). Off otherwise: the remap spills in the loop (a global-keys call's pass 1.3x
    slower on the H100).

    `interpreting`: as in the forward (`hopper_fwd._kernel`), for JAX's Mosaic GPU interpreter on CPU: the
    wgmmas are plain dots on the same shared-memory tiles and registers (no `pl.run_state`, no transposed
    refs), register layouts are left out, and the producer drains the ring at the end.

    q_ref/do_ref [batch, q_pad, heads, d], k_ref/v_ref [batch, kv_pad, kv_heads, d], lse2_ref/delta_ref
    [batch, heads, q_pad] float32, q_ids_ref/kv_ids_ref None or int32 [batch, q_pad] / [batch, kv_pad],
    q_ranges_ref None or with them the query blocks each key tile's ids may meet (`segment_block_ranges`),
    dk_ref/dv_ref like k_ref (summed over the group's query heads).
    dq_acc_ref: None, or (config.dq_atomic) a float32 [batch, q_pad, heads, d] buffer that each query block's
    dS K is reduce-added into by TMA (unscaled): zeros in free order; unwritten with dq_ordered, whose first
    visitor of a block stores instead.
    dq_order: None, or (config.dq_ordered) a `DqOrder`.
    `programs` (two passes only): the score and mask programs, with rows_ref (riding the Q ring) and cols_ref
    (resident per consumer, every query head of the group) their packed values, mask_ranges_ref the mask
    program's query blocks per (batch, kv head, key tile) (`mask_block_ranges`, over the group's heads), and
    d_cols_ref None or float32 [batch, heads, n, kv_pad]: the gradient of the score program's float column
    values per key (summed over queries).
    `dropout`: None, or the forward's dropout, seed_ref its seed table (`fwd.kernel_dropout`): dV += (P^T keep)
    dO (the 1 / (1 - rate) applied once, to dV), dP^T = Z (V dO^T) with Z = keep / (1 - rate).
    bias_ref/mask_ref (two passes only): None or `dense`'s arrays key-major, [Bd, Hd, kv_pad, q_pad]
    (`dense_operands(..., transpose=True)`), whose [2 block_kv, block_q] tiles ride the Q ring.
    Q, K and dK at query's head_dim, V, dO and dV at value's (may differ).
    `split_products` (`HopperBwdConfig.dkv_split_products`, where `dkdv_pass` serves the call that way): the
    scoped refs end with the shared P^T and dS^T tiles and their four barriers."""
    (
        (k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, *extra_tiles),
        (k_ready, v_ready),
        (q_ready, do_ready, lse_ready, delta_ready),
        free,
        segments,
        (rows_smem, rows_ready, cols_smem, cols_ready, d_cols_smem),
        ring,
        split_barriers,
        *extra_barriers,
    ) = scoped
    split = config.split_columns
    score_mod, mask_mod = programs.score, programs.mask
    has_segments = q_ids_ref is not None
    block_q, block_kv, num_stages = config.block_q_dkv, config.block_kv_dkv, config.num_stages_dkv
    num_q_blocks = q_ref.shape[1] // block_q
    max_position = max(q_ref.shape[1], k_ref.shape[1])  # positions the programs see are below it
    dtype = q_ref.dtype
    if dq_order is None:
        grid = (q_ref.shape[0], k_ref.shape[2], k_ref.shape[1] // (config.row_tiles * block_kv))
        batch, kv_head, kv_tile = launched_item(launch_ref, grid, ("batch", "kv_heads", "kv_tiles"))
    else:
        batch, kv_head, kv_tile = dq_order.cta
    tile_start = kv_tile * (config.row_tiles * block_kv)
    # Padded keys need a mask only where their dS reaches real rows: the one-pass dQ. (Without it only
    # their own dK/dV rows see them, and those are sliced off.)
    mask_padded_keys = dq_acc_ref is not None and kv_len != k_ref.shape[1]
    # Every step is masked with padded keys to hide; else the band's edges, and with segment ids the query
    # blocks outside the tile's same-segment run.
    always_mask = mask_padded_keys
    # Query blocks this CTA visits per head: those its keys' band reaches (maybe none).
    q_lo, q_hi, same = visited_q_blocks(
        kv_tile,
        (lambda i: q_ranges_ref[batch, kv_tile, i]) if has_segments else None,
        block_q=block_q,
        tile_keys=config.row_tiles * block_kv,
        num_q_blocks=num_q_blocks,
        kv_pad=k_ref.shape[1],
        band=band,
    )
    gap = None  # the `Gap` of query blocks the steps skip (`query_gap`)
    if mask_ranges_ref is not None:  # and the query blocks the mask program leaves anything visible in
        b, h = stack_index(mask_ranges_ref, batch, kv_head)
        q_lo = jnp.maximum(q_lo, mask_ranges_ref[b, h, kv_tile, 0])
        q_hi = jnp.maximum(jnp.minimum(q_hi, mask_ranges_ref[b, h, kv_tile, 1]), q_lo)
        full = (mask_ranges_ref[b, h, kv_tile, 2], mask_ranges_ref[b, h, kv_tile, 3])
        same = full if same is None else (jnp.maximum(same[0], full[0]), jnp.minimum(same[1], full[1]))
        if query_gap and dq_order is None:  # the ordered adds count on each tile's blocks forming one run
            gap_range = mask_ranges_ref[b, h, kv_tile, 4], mask_ranges_ref[b, h, kv_tile, 5]
            q_lo, q_hi, gap = clip_gap(q_lo, q_hi, *gap_range)
    # A block mask served by its ranges alone: a tile whose query blocks reach outside their hull hides them.
    hull = None
    if dense.hide_outside_hull:
        hull = mask_ranges_ref[b, h, kv_tile, 0], mask_ranges_ref[b, h, kv_tile, 1]
    steps_hi = step_of(gap, q_hi)  # steps [q_lo, steps_hi) per head visit blocks `block_of(gap, step)`
    q_steps = steps_hi - q_lo
    total_steps = group * q_steps
    wg = lax.axis_index("wg")
    iota, zeros, load_vector = register_ops(interpreting)
    consumer_registers, producer_registers = REGISTERS

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        own = 0 if split else wg  # this consumer's row tile (split_columns: the one both share)
        # One pass: K of both warpgroups is one [2 block_kv, D] tile (each dQ wgmma reads all of it).
        # split_columns: K and V are single tiles (an index would reach the wgmmas as a constant JAX 0.12's
        # lowering of their run_state cannot take).
        v_smem = v_smem2 if split else v_smem2.at[wg]
        if split:
            k_smem = k_smem2
        else:
            k_smem = k_smem2.at[wg] if dq_acc_ref is None else k_smem2.at[pl.ds(wg * block_kv, block_kv)]
        kv_start = tile_start + own * block_kv
        rows = (batch, pl.ds(kv_start, block_kv), kv_head)

        def load_k_and_v():
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, k_ready.at[own])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, v_ready.at[own])

        pl.when(wg == 0)(load_k_and_v) if split else load_k_and_v()
        # split_columns: this consumer's columns of dK (Q's) and dV (dO's); else all of them.
        k_cols, v_cols = (column_half(k_smem, wg), column_half(v_smem, wg)) if split else (None, None)
        column = plgpu.Layout.WGMMA.reduce(0)  # a per-query vector, broadcast along the key rows of S^T
        kv_seg = None
        if has_segments:
            q_ids_smem, kv_ids_smem, q_ids_ready, kv_ids_ready = segments
            kv_seg = load_own_ids(
                kv_ids_ref,
                kv_ids_smem,
                kv_ids_ready,
                wg=wg,
                batch=batch,
                start=kv_start,
                size=block_kv,
                layout=plgpu.Layout.WGMMA.reduce(1),
                load=load_vector,
            )
        if dq_acc_ref is None:
            plgpu.barrier_wait(k_ready.at[own])
        else:  # this warpgroup's dQ wgmmas read the other's keys too
            for i in range(NUM_CONSUMERS):
                plgpu.barrier_wait(k_ready.at[i])
        plgpu.barrier_wait(v_ready.at[own])
        c = scale * LOG2E  # exp(scale * s - lse) = exp2(c * s - lse2)
        if cols_ref is not None:  # this warpgroup's keys' program values, of every query head of the group
            b, h = stack_index(cols_ref, batch, kv_head)
            heads = pl.ds(h * group, group) if cols_ref.shape[1] > 1 else pl.ds(0, 1)
            plgpu.copy_gmem_to_smem(
                cols_ref.at[b, heads, :, pl.ds(kv_start, block_kv)], cols_smem.at[wg], cols_ready.at[wg]
            )
            plgpu.barrier_wait(cols_ready.at[wg])
        grads = score_mod is not None and score_mod.needs_grad

        def column_values(g):  # `ModValues` of this warpgroup's keys for query head g of the group
            head = g if cols_ref is not None and cols_ref.shape[1] > 1 else 0
            return programs.values(
                "col", lambda i: load_vector(cols_smem.at[wg, head, i], plgpu.Layout.WGMMA.reduce(1)), masked=True
            )

        # The order of a step's wgmmas. Split: S^T; then dV with dP^T; then dK (and dQ): three groups, the
        # elementwise work between them. Fused: S^T with dP^T (neither needs P^T); then dV, dK (and dQ): two
        # groups, one wait fewer per step, at the price of dP^T's registers live through the softmax. On the
        # H100 (fwd+bwd x cuDNN, head_dim 64) fused put the ordered one pass
        # 2-3% nearer cuDNN on a full band but 8% further under a causal band, the free-order one pass 4-6%
        # further on a full band, and the two passes no nearer. So: fused for the ordered one pass on a full
        # band only.
        fused = dq_order is not None and band.is_full
        # `config.delta_in_dp`: where the split order's or dkv_overlap's dP^T wgmma runs (not fused, not
        # interpreting), its accumulator starts at -delta, so it yields dP^T - delta and delta is not live beside
        # P^T, dP^T, dK and dV when dS^T is formed (fewer spills).
        # (Not with dropout: dP^T is rescaled before delta is subtracted.)
        delta_in_dp = config.delta_in_dp and not fused and not interpreting and dropout is None

        def kept(q_block, g, shape):
            """With dropout, which of the step's P^T survive (bool [block_kv, block_q]), else None: its query
            rows' hashes vary along the tile's columns."""
            if dropout is None:
                return None
            q_pos = positions(q_block * block_q, block_q, column, interpreting=interpreting)
            row_hash = dropout.row_hash(seed_ref, batch, kv_head * group + g, q_pos)
            return dropout.keep(row_hash, kv_start + iota(shape, 0), q_axis=1)

        def dropped(p, keep):
            """dV's operand: P^T with the dropped entries zeroed (float32)."""
            return p if keep is None else jnp.where(keep, p, 0.0)

        def dropped_dp(dp, keep):
            """dP^T of the dropped, rescaled P^T: Z dP^T."""
            return dp if keep is None else jnp.where(keep, dp * dropout.scale, 0.0)

        def probabilities(s, q_block, slot, *, g, cols, masked: bool):
            """(P^T, pullback): P^T = exp2(c S^T - lse2) of the step's query block (float32), masked if `masked`;
            with a score program P^T of its scores, and pullback(dS^T) = (dS^T taken back through the program
            to the raw logits, the step's part of the gradient of its float column values), else None. g: the
            query head within the group; cols: `column_values(g)`."""
            lse2 = load_vector(lse_smem.at[slot], column)
            position = pullback = None
            if score_mod is not None or (masked and mask_mod is not None):  # the positions the programs read
                position = dict(
                    batch=batch,
                    head=kv_head * group + g,
                    q_idx=lambda: positions(q_block * block_q, block_q, column, interpreting=interpreting),
                    kv_idx=lambda: positions(
                        kv_start, block_kv, plgpu.Layout.WGMMA.reduce(1), interpreting=interpreting
                    ),
                    q_axis=1,
                    tile_shape=s.shape,
                    max_position=max_position,
                )
            if rows_ref is not None:  # the block's values ride the Q ring; every step waits (one wait per phase)
                plgpu.barrier_wait(rows_ready.at[slot])
            rows = programs.values("row", lambda i: load_vector(rows_smem.at[slot, i], column), masked=masked)
            bias, dense_visible = dense_tiles(ring, slot, wg=own, rows=block_kv, load=load_vector, read_mask=masked)
            logit_scale, logit_c, cap_grad = scale, c, None
            if dense.forms_logits:  # the soft cap and the bias act on scale * S^T: natural units from here on
                s, cap_grad = biased_logits(s, bias, scale=scale, soft_cap=dense.soft_cap)
                logit_scale, logit_c = 1.0, LOG2E
            if score_mod is None:
                p = jnp.exp2(s * logit_c - lax.broadcast_in_dim(lse2, s.shape, [1]))
            else:
                logits2, pullback, row2 = program_score(
                    score_mod, s, rows.score, cols.score, scale=logit_scale, grad_side="col" if grads else None,
                    key_before_query=band.keys_before_queries,
                    origin=kv_start,
                    **position
                )  # fmt: skip
                shift = lse2 if row2 is None else lse2 - row2
                p = jnp.exp2(logits2 - lax.broadcast_in_dim(shift, s.shape, [1]))
            if cap_grad is not None:  # dS^T goes back through the program, then the soft cap
                program_pullback = pullback

                def pullback(ds):
                    ds, d_cols = (ds, ()) if program_pullback is None else program_pullback(ds)
                    return cap_grad(ds), d_cols

            q_seg = None
            if has_segments:  # every step waits (one wait per phase); masked ones read the ids
                plgpu.barrier_wait(q_ids_ready.at[slot])
                if masked:
                    q_seg = load_vector(q_ids_smem.at[slot], column)
            if masked:
                q_pos = q_block * block_q + iota(s.shape, 1)
                visible = tile_visible(
                    q_pos,
                    kv_start + iota(s.shape, 0),
                    band=band,
                    kv_len=kv_len if mask_padded_keys else None,
                    q_seg=q_seg,
                    kv_seg=kv_seg,
                    shape=s.shape,
                    q_axis=1,
                )
                if mask_mod is not None:
                    seen = program_mask(mask_mod, rows.mask, cols.mask, **position)
                    visible = seen if visible is None else visible & seen
                if hull is not None:
                    visible = outside_hull_hidden(visible, q_pos, hull, block_q)
                if visible is not None:  # None: traced for a loop that runs no iterations
                    p = jnp.where(visible, p, 0.0)
            if dense_visible is not None:
                p = jnp.where(dense_visible, p, 0.0)
            return p, pullback

        def through_program(ds, pullback, acc):
            """dS^T and the column gradients `acc` after a step, with its score program's `pullback`."""
            if pullback is None:
                return ds, acc
            ds, d_cols = pullback(ds)
            return ds, tuple(a + d for a, d in zip(acc, d_cols))

        def delta_columns(slot, shape):
            """The step's delta (per query) broadcast over the key rows of a [block_kv, block_q] tile."""
            return lax.broadcast_in_dim(load_vector(delta_smem.at[slot], column), shape, [1])

        def wait_q(slot):  # the step's Q block and its lse2 have landed
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.barrier_wait(lse_ready.at[slot])

        def wait_do(slot):  # and its dO block and delta
            plgpu.barrier_wait(do_ready.at[slot])
            plgpu.barrier_wait(delta_ready.at[slot])

        def own_columns(ring, slot, cols):
            """Slot `slot` of the Q or dO ring as this consumer's dK (or dV) product reads it: its half of the
            columns with split_columns (one indexer: JAX 0.12 cannot lower a column slice of an indexed ref)."""
            return ring.at[slot] if cols is None else ring.at[slot, :, cols]

        def step(s, carry, *, g, cols, masked: bool):
            dk, dv, acc = carry
            q_block = block_of(gap, s)
            t = g * q_steps + s - q_lo  # this warpgroup's step number (`step_block` inverted)
            slot = lax.rem(t, num_stages)
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            q_part, do_part = own_columns(q_smem, slot, k_cols), own_columns(do_smem, slot, v_cols)
            wait_q(slot)
            if fused:
                wait_do(slot)

            def s_t(s_ref):
                plgpu.wgmma(s_ref, k_smem, q_tile.transpose((1, 0)))
                return s_ref[...]

            def s_t_dp_t(s_ref, dp_ref):
                plgpu.wgmma(s_ref, k_smem, q_tile.transpose((1, 0)))
                plgpu.wgmma(dp_ref, v_smem, do_tile.transpose((1, 0)))
                return s_ref[...], dp_ref[...]

            tile = plgpu.ACC((block_kv, block_q), jnp.float32)
            if interpreting:
                s = dot_t(wgmma_operand(k_smem), wgmma_operand(q_tile))
            elif fused:
                s, dp = pl.run_scoped(s_t_dp_t, tile, tile)
            else:
                s = pl.run_scoped(s_t, tile)
            p, pullback = probabilities(s, q_block, slot, g=g, cols=cols, masked=masked)
            keep = kept(q_block, g, s.shape)
            p_v = dropped(p, keep)
            if not fused:
                wait_do(slot)

                def dv_dp_t(refs):  # one wgmma group: a single wait for both
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dv_ref, p_v.astype(dtype), do_part)
                    plgpu.wgmma(dp_ref, v_smem, do_tile.transpose((1, 0)))

                if interpreting:
                    dv = dv + jnp.dot(p_v.astype(dtype), wgmma_operand(do_part), preferred_element_type=jnp.float32)
                    dp = dot_t(wgmma_operand(v_smem), wgmma_operand(do_tile))
                else:
                    dp_init = -delta_columns(slot, s.shape) if delta_in_dp else zeros(s.shape)
                    dv, dp = pl.run_state(dv_dp_t)((plgpu.ACC.init(dv), plgpu.ACC.init(dp_init)))
            dp = dropped_dp(dp, keep)
            ds = p * dp if delta_in_dp else p * (dp - delta_columns(slot, s.shape))
            ds, acc = through_program(ds, pullback, acc)
            if fused:  # the wgmma operands now: float32 P^T dies here
                ds, p_v = ds.astype(dtype), p_v.astype(dtype)
            if dq_acc_ref is None:

                def dk_update(dk_ref):
                    plgpu.wgmma(dk_ref, ds.astype(dtype), q_part)

                if interpreting:
                    dk = dk + jnp.dot(ds.astype(dtype), wgmma_operand(q_part), preferred_element_type=jnp.float32)
                else:
                    dk = pl.run_state(dk_update)(plgpu.ACC.init(dk))
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv, acc
            # One pass, FA3's split: both warpgroups' dS^T halves go to one shared [2 block_kv, block_q] tile,
            # and each warpgroup computes half of dQ[q block] = dS K from all 2 block_kv keys (half the
            # columns, or at head_dim 64 half the query rows: see `split_dq_product`), reduce-added by TMA (unscaled).
            # The dS^T tile is reused every step. Before overwriting it at step t a warpgroup waits on
            # `ds_free` for step t-1's phase, completed by both warpgroups' arrivals after their step t-1 dQ
            # wgmma returned (pl.run_state waits for the wgmma group), i.e. after the last reads of the
            # tile; every phase is waited once (at the next step, or after the loop for the last one).
            # `ds_ready` (two arrivals, each after its half's store and commit_smem) orders the stores before
            # the other warpgroup's dQ wgmma.
            ds_ready, ds_free = extra_barriers
            ds_t_smem, dq_staging_smem = extra_tiles
            ds = ds.astype(dtype)

            @pl.when(t > 0)
            def _():
                plgpu.barrier_wait(ds_free)

            ds_t_smem.at[pl.ds(wg * block_kv, block_kv)][...] = ds
            plgpu.commit_smem()
            plgpu.barrier_arrive(ds_ready)
            ds_operand, k_operand, dq_rows, dq_cols = split_dq_product(ds_t_smem, k_smem2, wg)

            def dk_dq(dk_ref, dq_ref):  # dK's wgmma is issued before the wait for the other half of dS^T
                plgpu.wgmma(dk_ref, ds, q_tile)
                plgpu.barrier_wait(ds_ready)
                plgpu.wgmma(dq_ref, ds_operand.transpose((1, 0)), k_operand)

            def dv_dk_dq(refs):
                dv_ref, dk_ref, dq_ref = refs
                plgpu.wgmma(dv_ref, p_v, do_tile)
                dk_dq(dk_ref, dq_ref)

            dq_smem = dq_staging_smem.at[lax.rem(t, 2), wg]
            dq = plgpu.ACC.init(zeros(dq_smem.shape))
            if fused:  # one wgmma group
                dv, dk, dq = pl.run_state(dv_dk_dq)((plgpu.ACC.init(dv), plgpu.ACC.init(dk), dq))
            else:
                dk, dq = pl.run_state(lambda refs: dk_dq(*refs))((plgpu.ACC.init(dk), dq))
            plgpu.barrier_arrive(ds_free)
            plgpu.barrier_arrive(free.at[slot])
            if dq_order is not None:  # the producer's store warp adds it, in order (`store_dq_in_order`)

                @pl.when(t >= 2)
                def _():  # that warp has read step t-2's dQ out of this slot
                    plgpu.barrier_wait(dq_order.free.at[lax.rem(t, 2)])

                dq_smem[...] = dq
                plgpu.commit_smem()
                plgpu.barrier_arrive(dq_order.staged.at[lax.rem(t, 2)])
                return dk, dv, acc
            # Two staging slots per warpgroup, one store (its own bulk group) per step: once at most one is
            # in flight (step t-1's), step t-2's has read this slot.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            dq_smem[...] = dq
            plgpu.commit_smem()
            q_rows = pl.ds(q_block * block_q + dq_rows.start, dq_rows.size)
            plgpu.copy_smem_to_gmem(
                dq_smem, dq_acc_ref.at[batch, q_rows, kv_head * group + g, dq_cols], reduction_op="add"
            )
            return dk, dv, acc

        # dkv_split_products: consumer 0 computes a query block's S^T and P^T, consumer 1 its dP^T and, from P^T
        # passed through shared memory (bf16), dS^T, which it passes back: each then adds its columns of dV and dK
        # from the shared tiles (no product done twice). One slot each: consumer 0 rewrites P^T once both dV
        # products and consumer 1's read of the last step have read it ("p_free", two arrivals), consumer 1
        # rewrites dS^T once both dK products have read it ("ds_free").
        def shared_step(s, carry, *, g, cols, masked: bool):
            dk, dv, acc = carry
            p_smem, ds_smem = extra_tiles
            p_ready, p_free, ds_ready, ds_free = extra_barriers
            q_block = block_of(gap, s)
            t = g * q_steps + s - q_lo
            slot = lax.rem(t, num_stages)
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            wait_q(slot)
            wait_do(slot)

            @pl.when(wg == 0)
            def _():
                s = product_t(k_smem, q_tile, interpreting=interpreting)
                p, _ = probabilities(s, q_block, slot, g=g, cols=cols, masked=masked)
                hand_over(p_smem, p.astype(dtype), ready=p_ready, free=p_free, reuse=t > 0)

            @pl.when(wg == 1)
            def _():
                dp = product_t(v_smem, do_tile, interpreting=interpreting)
                plgpu.barrier_wait(p_ready)
                p = load_vector(p_smem, plgpu.Layout.WGMMA).astype(jnp.float32)
                ds = p * (dp - delta_columns(slot, dp.shape))
                hand_over(ds_smem, ds.astype(dtype), ready=ds_ready, free=ds_free, reuse=t > 0)

            pl.when(wg == 0)(lambda: plgpu.barrier_wait(p_ready))  # consumer 1 waited in its branch
            dv = add_product(dv, p_smem, own_columns(do_smem, slot, v_cols), interpreting=interpreting)
            plgpu.barrier_arrive(p_free)
            plgpu.barrier_wait(ds_ready)
            dk = add_product(dk, ds_smem, own_columns(q_smem, slot, k_cols), interpreting=interpreting)
            plgpu.barrier_arrive(ds_free)
            plgpu.barrier_arrive(free.at[slot])
            return dk, dv, acc

        def overlapped_step(s, carry, *, g, cols, masked: bool):
            """`config.dkv_overlap` (two passes): issues S^T_t, then dK += dS^T_{t-1} Q_{t-1}, waits for S^T_t
            alone (wgmma groups complete in order) and computes P^T_t while that dK product runs; then dV with
            dP^T_t as in `step`. Q_{t-1}'s slot is released once its dK product is done, so the consumer holds
            two slots of the ring. Step 0 has no previous step: its dK product adds zeros (the initial dS^T)
            times its own Q block, which is exact, and it releases nothing."""
            dk, dv, ds_prev, acc = carry
            q_block = block_of(gap, s)
            t = g * q_steps + s - q_lo
            slot = lax.rem(t, num_stages)
            prev = jnp.where(t > 0, lax.rem(t + num_stages - 1, num_stages), slot)
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            q_prev, do_part = own_columns(q_smem, prev, k_cols), own_columns(do_smem, slot, v_cols)
            wait_q(slot)

            if interpreting:  # the same steps, one product at a time
                s = dot_t(wgmma_operand(k_smem), wgmma_operand(q_tile))
                dk = dk + jnp.dot(ds_prev, wgmma_operand(q_prev), preferred_element_type=jnp.float32)
                p, pullback = probabilities(s, q_block, slot, g=g, cols=cols, masked=masked)
                keep = kept(q_block, g, s.shape)
                wait_do(slot)
                dv = dv + jnp.dot(
                    dropped(p, keep).astype(dtype), wgmma_operand(do_part), preferred_element_type=jnp.float32
                )
                dp = dropped_dp(dot_t(wgmma_operand(v_smem), wgmma_operand(do_tile)), keep)
                if pullback is not None:
                    ds = p * dp if delta_in_dp else p * (dp - delta_columns(slot, p.shape))
                    p, acc = through_program(ds, pullback, acc)  # dS^T in place of P^T (dP^T is not read)
            else:

                def products(s_ref, dk_ref, dv_ref, dp_ref):
                    dk_ref[...] = dk
                    dv_ref[...] = dv
                    plgpu.wgmma(s_ref, k_smem, q_tile.transpose((1, 0)))
                    plgpu.wgmma(dk_ref, ds_prev, q_prev)
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S^T_t done; dK may run on
                    p, pullback = probabilities(s, q_block, slot, g=g, cols=cols, masked=masked)
                    keep = kept(q_block, g, s.shape)
                    wait_do(slot)
                    if delta_in_dp:
                        dp_ref[...] = -delta_columns(slot, p.shape)
                    plgpu.wgmma(dv_ref, dropped(p, keep).astype(dtype), do_part)
                    plgpu.wgmma(dp_ref, v_smem, do_tile.transpose((1, 0)))
                    # dP^T is read in this scope to drop entries (dropout) or to form dS^T (a program's pullback
                    # lives here): wait for it then, or ptxas serializes every wgmma of the kernel (C7514: it finds
                    # a wgmma's registers read in flight); else it is read after the scope's own wait.
                    read_here = keep is not None or pullback is not None
                    dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=0 if read_here else None)
                    dp = dropped_dp(dp, keep)
                    if pullback is None:
                        return p, dp, dk_ref[...], dv_ref[...], acc
                    # dS^T in P^T's place.
                    ds = p * dp if delta_in_dp else p * (dp - delta_columns(slot, p.shape))
                    ds, d_cols = through_program(ds, pullback, acc)
                    return ds, dp, dk_ref[...], dv_ref[...], d_cols

                tile = plgpu.ACC((block_kv, block_q), jnp.float32)
                accumulators = plgpu.ACC(dk.shape, jnp.float32), plgpu.ACC(dv.shape, jnp.float32)
                p, dp, dk, dv, acc = pl.run_scoped(products, tile, *accumulators, tile)

            @pl.when(t > 0)
            def _():
                plgpu.barrier_arrive(free.at[prev])

            if score_mod is not None or dense.soft_cap is not None:  # p holds dS^T already (a pullback ran)
                return dk, dv, p.astype(dtype), acc
            ds = p * dp if delta_in_dp else p * (dp - delta_columns(slot, p.shape))
            return dk, dv, ds.astype(dtype), acc

        # Query blocks that see every key of this warpgroup (in its band and, with segment ids, in the tile's
        # one segment) skip the mask (none, with `always_mask`).
        _, *band_range, _ = blocks.q_block_range(
            lax.div(kv_start, block_kv),
            block_q=block_q,
            block_kv=block_kv,
            num_q_blocks=num_q_blocks,
            kv_len=k_ref.shape[1],
            band=band,
            always_mask=always_mask,
        )
        unmasked_lo, unmasked_hi = (step_of(gap, b) for b in unmasked_blocks(band_range, (q_lo, q_hi), same))

        # Without a left band edge, masked padding, segment ids or block ranges (a mask program's, a dense or a
        # block mask's), unmasked_hi == q_hi: no trailing edge.
        trailing = band.left is not None or always_mask or has_segments or mask_ranges_ref is not None

        overlap = config.dkv_overlap and dq_acc_ref is None
        step_fn = overlapped_step if overlap else shared_step if split_products else step

        num_d_cols = 0 if d_cols_ref is None else d_cols_ref.shape[2]

        def head(g, carry):
            """The steps of query head g of the group; with `grads`, its column gradients go out after them."""
            acc = tuple(zeros((block_kv, block_q)).sum(axis=1) for _ in range(num_d_cols))
            *carry, acc = masked_edge_loops(
                functools.partial(step_fn, g=g, cols=column_values(g)),
                (*carry, acc),
                q_lo,
                unmasked_lo,
                unmasked_hi,
                steps_hi if trailing else None,
            )
            if acc:

                def store_d_cols():
                    for i, d_col in enumerate(acc):
                        d_cols_smem.at[wg, i][...] = d_col
                    plgpu.commit_smem()
                    keys = pl.ds(kv_start, block_kv)
                    plgpu.copy_smem_to_gmem(d_cols_smem.at[wg], d_cols_ref.at[batch, kv_head * group + g, :, keys])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging is rewritten for the next head

                pl.when(wg == 0)(store_d_cols) if split else store_d_cols()  # split: both hold the same sums
            return tuple(carry)

        def accumulator_shape(tile, cols):  # [block_kv, this consumer's columns of `tile`]
            return (block_kv, tile.shape[-1] if cols is None else cols.size)

        carry = (zeros(accumulator_shape(k_smem, k_cols)), zeros(accumulator_shape(v_smem, v_cols)))
        if overlap:
            carry += (zeros((block_kv, block_q)).astype(dtype),)
        dk, dv, *ds_last = lax.fori_loop(0, group, head, carry)
        if split_products:  # consumer 0 waits p_free's phases, consumer 1 ds_free's
            drain_last_phases(total_steps, wg, extra_barriers[1::2])
        if split:  # K and V are shared: overwrite them with the results once neither consumer's wgmmas read them
            plgpu.barrier_arrive(split_barriers[0])
            plgpu.barrier_wait(split_barriers[0])

        def store_dk(dk):
            (k_smem if k_cols is None else k_smem.at[:, k_cols])[...] = (dk * scale).astype(dtype)

        if dq_acc_ref is not None:

            @pl.when(total_steps > 0)
            def _():  # the last step's phase: the other warpgroup's last dQ wgmma has read this K
                plgpu.barrier_wait(extra_barriers[1])

        # K and V of this warpgroup are read by wgmmas that have all returned: reuse them for the output.
        if overlap:  # the last step's dK product, then its slot is free
            last = lax.rem(total_steps + num_stages - 1, num_stages)

            q_last = own_columns(q_smem, last, k_cols)

            @pl.when(total_steps > 0)
            def _():
                if interpreting:
                    dk_out = dk + jnp.dot(ds_last[0], wgmma_operand(q_last), preferred_element_type=jnp.float32)
                else:
                    dk_out = pl.run_state(lambda dk_ref: plgpu.wgmma(dk_ref, ds_last[0], q_last))(plgpu.ACC.init(dk))
                plgpu.barrier_arrive(free.at[last])
                store_dk(dk_out)

            @pl.when(total_steps == 0)
            def _():
                store_dk(dk)
        else:
            store_dk(dk)
        dv = dv if dropout is None else dv * dropout.scale
        (v_smem if v_cols is None else v_smem.at[:, v_cols])[...] = dv.astype(dtype)
        plgpu.commit_smem()

        def store_dk_and_dv():
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows], commit_group=False)
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        if split:  # one store of the tiles, once both consumers wrote their halves
            halves_written = split_barriers[1]
            plgpu.barrier_arrive(halves_written)

            @pl.when(wg == 0)
            def _():
                plgpu.barrier_wait(halves_written)
                store_dk_and_dv()

        else:
            store_dk_and_dv()

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")

        def load(step, slot, wait_free: bool, copies=ALL_COPIES):
            """Step `step`'s copies into ring slot `slot`, those named in `copies` (`ALL_COPIES`)."""
            g, q_step = step_block(step, q_lo=q_lo, q_steps=q_steps)
            q_block, head = block_of(gap, q_step), kv_head * group + g
            queries = pl.ds(q_block * block_q, block_q)
            if wait_free:
                plgpu.barrier_wait(free.at[slot])
            rows = (batch, queries, head)
            if "q" in copies:
                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_ready.at[slot])
                if has_segments:  # ids of the block's queries (read in masked steps, which all steps are then)
                    plgpu.copy_gmem_to_smem(q_ids_ref.at[batch, queries], segments[0].at[slot], segments[2].at[slot])
                if rows_ref is not None:  # the programs' values of the block's queries
                    b, h = stack_index(rows_ref, batch, head)
                    plgpu.copy_gmem_to_smem(rows_ref.at[b, h, :, queries], rows_smem.at[slot], rows_ready.at[slot])
                for ref, slots in zip((bias_ref, mask_ref), ring or ()):  # the dense tiles of the CTA's keys
                    if ref is not None:
                        b, h = stack_index(ref, batch, head)
                        keys = pl.ds(tile_start, config.row_tiles * block_kv)
                        plgpu.copy_gmem_to_smem(ref.at[b, h, keys, queries], slots[0].at[slot], slots[1].at[slot])
            if "lse2" in copies:
                plgpu.copy_gmem_to_smem(lse2_ref.at[batch, head, queries], lse_smem.at[slot], lse_ready.at[slot])
            if "do" in copies:
                plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_ready.at[slot])
            if "delta" in copies:
                plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, queries], delta_smem.at[slot], delta_ready.at[slot])

        if dq_order is None:
            fill_ring(load, num_stages=num_stages, steps=total_steps)
            if interpreting:
                drain_ring((free,), num_stages=num_stages, steps=total_steps)
            return

        # Waiting on other CTAs must not hold up the loads or the matmuls: one warp loads, another adds dQ. Under
        # a band (the split step order) the copies leave from several warps at once (`BANDED_LOAD_WARPS`).
        load_warps = {0: ALL_COPIES} if band.is_full else BANDED_LOAD_WARPS

        @plgpu.warp_map
        def _per_warp(warp):
            for load_warp, copies in load_warps.items():

                @pl.when(warp == load_warp)
                def _(copies=copies):
                    fill_ring(functools.partial(load, copies=copies), num_stages=num_stages, steps=total_steps)

            @pl.when(warp == 1)
            def _():
                store_dq_in_order(
                    dq_order,
                    extra_tiles[1],
                    dq_acc_ref,
                    batch=batch,
                    kv_head=kv_head,
                    kv_tile=kv_tile,
                    group=group,
                    q_lo=q_lo,
                    q_steps=q_steps,
                    block_q=block_q,
                )


def dkdv_pass(
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
    query_gap: bool = False,
    interpret,
):
    """(dk, dv), and with config.dq_atomic also dq (float32, unscaled, [batch, q_pad, heads, d]). With a score
    program whose float values need gradients (`needs_grad`, two passes only), also d_cols: float32
    [batch, heads, n, kv_pad], the gradient of each of its float column values per key and query head
    (summed over queries). mod_operands: the programs' packed row and column values and the mask program's
    query blocks per (batch, kv head, key tile) (`mask_block_ranges`), each None where absent; dropout_seed:
    `dropout`'s seed table (`fwd.kernel_dropout`); dense_arrays: `dense`'s (bias, mask) key-major
    (`common.dense_operands(..., transpose=True)`), each None where absent (two passes only). query_gap: the
    steps skip each key tile's gap of query blocks (`_dkdv_kernel`'s; two passes with block ranges only)."""
    batch, kv_pad, kv_heads, head_dim = k.shape
    head_dim_v = v.shape[3]
    block_q, block_kv, num_stages = config.block_q_dkv, config.block_kv_dkv, config.num_stages_dkv
    tiles = config.row_tiles
    has_segments = q_ids is not None
    transforms = swizzle_transforms()  # tiles without a head_dim axis
    # Q and K under one swizzle (S^T = K Q^T), V and dO under theirs (dP^T = V dO^T): each the widest that divides
    # its head_dim's row (64 bytes at 96), with split_columns half of it (64 bytes at 192).
    transforms_qk = head_dim_transforms(head_dim, split=config.split_columns)
    transforms_v = head_dim_transforms(head_dim_v, split=config.split_columns)
    # One pass: K as one [2 block_kv, D] tile, since each dQ wgmma reads both warpgroups' keys.
    # split_columns: one K and one V tile, both consumers'.
    k_shape = (NUM_CONSUMERS * block_kv, head_dim) if config.dq_atomic else (NUM_CONSUMERS, block_kv, head_dim)
    v_shape = (NUM_CONSUMERS, block_kv, head_dim_v)
    if config.split_columns:
        k_shape, v_shape = (block_kv, head_dim), (block_kv, head_dim_v)
    smem = [
        plgpu.SMEM(k_shape, k.dtype, transforms=transforms_qk),
        plgpu.SMEM(v_shape, v.dtype, transforms=transforms_v),
        plgpu.SMEM((num_stages, block_q, head_dim), q.dtype, transforms=transforms_qk),
        plgpu.SMEM((num_stages, block_q, head_dim_v), d_out.dtype, transforms=transforms_v),
        plgpu.SMEM((num_stages, block_q), jnp.float32),
        plgpu.SMEM((num_stages, block_q), jnp.float32),
    ]
    extra_barriers = ()
    if config.dq_atomic:
        # Both consumers' dS^T in one tile; per (step parity, consumer) its float32 share of dQ for the TMA
        # reduce; two-arrival barriers: that tile written (`ds_ready`), and read by both dQ wgmmas (`ds_free`).
        rows, cols = (
            (block_q, head_dim // NUM_CONSUMERS)
            if dq_split(head_dim, block_q) == "columns"
            else (block_q // NUM_CONSUMERS, head_dim)
        )
        smem += [
            plgpu.SMEM((NUM_CONSUMERS * block_kv, block_q), q.dtype, transforms=transforms),
            plgpu.SMEM(
                (2, NUM_CONSUMERS, rows, cols),
                jnp.float32,
                transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)),
            ),
        ]
        extra_barriers = (plgpu.Barrier(num_arrivals=NUM_CONSUMERS),) * 2
        if config.dq_ordered:  # per staging slot: both consumers' dQ is in it; the store warp has read it
            extra_barriers += (
                plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=2),
                plgpu.Barrier(num_arrivals=1, num_barriers=2),
            )
    # dkv_split_products where it serves the call (the others run split_columns' way, without its tiles): a query
    # block's P^T and dS^T between the consumers, and their barriers (p_ready, p_free, ds_ready, ds_free).
    shares_tiles = config.dkv_split_products and serves_split_products(
        mod_operands, dense_arrays, dropout, programs, dense
    )
    if shares_tiles:
        # P^T multiplies the consumer's columns of dO, dS^T its columns of Q: each under that tile's swizzle, the
        # only one wgmma pairs it with.
        smem += [
            plgpu.SMEM((block_kv, block_q), q.dtype, transforms=transforms_v),
            plgpu.SMEM((block_kv, block_q), q.dtype, transforms=transforms_qk),
        ]
        extra_barriers = (
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=NUM_CONSUMERS),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=NUM_CONSUMERS),
        )
    group = q.shape[2] // kv_heads
    rows, cols, _ = mod_operands
    score_mod = programs.score
    num_d_cols = len(score_mod.group("col", "float")) if score_mod is not None and score_mod.needs_grad else 0
    # Row values ride the Q ring; column values are resident per consumer, for each head of the group they vary
    # with; the float column gradients' staging.
    mod_scratch = (
        None if rows is None else plgpu.SMEM((num_stages, rows.shape[2], block_q), jnp.int32),
        None if rows is None else plgpu.Barrier(num_barriers=num_stages),
        None
        if cols is None
        else plgpu.SMEM((NUM_CONSUMERS, group if cols.shape[1] > 1 else 1, cols.shape[2], block_kv), jnp.int32),
        None if cols is None else plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        plgpu.SMEM((NUM_CONSUMERS, num_d_cols, block_kv), jnp.float32) if num_d_cols else None,
    )
    body = functools.partial(
        _dkdv_kernel,
        scale=scale,
        band=band,
        kv_len=kv_len,
        group=group,
        config=config,
        programs=programs,
        interpreting=interpret is not None,
        dropout=dropout,
        dense=dense,
        split_products=shares_tiles,
        query_gap=query_gap,
    )

    num_q_blocks = q.shape[1] // block_q
    num_tiles = kv_pad // (tiles * block_kv)
    # Under block ranges the two passes launch long key tiles first; the one pass keeps its own order.
    launch = None
    if mod_operands[2] is not None and not config.dq_atomic:
        with jax.ensure_compile_time_eval():  # a constant for a block mask's ranges
            launch = long_tiles_first(mod_operands[2], batch=batch, heads=kv_heads, num_tiles=num_tiles)
    # dq_ordered: a pair's float32 dQ covers its kv head's group of query heads
    launch_group = pairs_per_group(batch * kv_heads, q.shape[1] * q.shape[2] // kv_heads * head_dim * 4)

    def flash_backward_dkdv_sm90(*refs):  # the kernel's name in profiles
        inputs, rest = refs[:6], refs[6:]
        segment_refs, rest = (rest[:3], rest[3:]) if has_segments else ((None, None, None), rest)
        rest = list(rest)
        mod_refs = [None if x is None else rest.pop(0) for x in mod_operands]
        mod_refs += [None if x is None else rest.pop(0) for x in dense_arrays]
        seed_ref = None if dropout is None else rest.pop(0)
        launch_ref = rest.pop(0) if launch is not None else None
        if num_d_cols:
            *rest, d_cols_ref = rest
        else:
            d_cols_ref = None
        ranks = semaphores = None
        if config.dq_ordered:  # the rank table rides behind the inputs; the counters are global semaphores
            ranks, rest = rest[0], rest[1:]
            semaphores = pl.get_global(plgpu.SemaphoreType.REGULAR((batch * q.shape[2] * num_q_blocks,)))
        dq_acc, outputs = (rest[0], rest[1:]) if config.dq_atomic else (None, rest)

        def run(*scoped):
            if ranks is None:
                return body(
                    *inputs, *segment_refs, *mod_refs, dq_acc, *outputs, d_cols_ref, scoped, seed_ref=seed_ref,
                    launch_ref=launch_ref,
                )  # fmt: skip
            *scoped, staged, free = scoped
            *cta, active = ordered_cta(batch, kv_heads, num_tiles, launch_group)
            order = DqOrder(ranks, semaphores, tuple(cta), staged, free)
            pl.when(active)(
                lambda: body(
                    *inputs,
                    *segment_refs,
                    *mod_refs,
                    dq_acc,
                    *outputs,
                    None,
                    tuple(scoped),
                    dq_order=order,
                    seed_ref=seed_ref,
                )
            )

        pl.run_scoped(
            run,
            tuple(smem),
            (plgpu.Barrier(num_barriers=NUM_CONSUMERS),) * 2,
            (plgpu.Barrier(num_barriers=num_stages),) * 4,
            plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=num_stages),
            segment_scratch(has_segments, (num_stages, block_q), (NUM_CONSUMERS, block_kv)),
            mod_scratch,
            dense_ring(dense_arrays, num_stages, tiles * block_kv, block_q),
            # split_columns: both consumers are done reading K and V; both wrote their halves of dK and dV
            (plgpu.Barrier(num_arrivals=NUM_CONSUMERS),) * 2 if config.split_columns else None,
            *extra_barriers,
            collective_axes="wg",
        )

    operands = (q, k, v, d_out, lse2, delta)
    q_ranges = None
    if has_segments:
        q_ranges = segment_block_ranges(kv_ids, q_ids, rows_per_tile=tiles * block_kv, cols_per_block=block_q)
        operands += (q_ids, kv_ids, q_ranges)
    operands += tuple(x for x in mod_operands if x is not None)
    operands += tuple(x for x in dense_arrays if x is not None)
    if dropout is not None:
        operands += (dropout_seed,)
    if launch is not None:
        operands += (launch,)
    out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    grid = dict(
        grid=(batch, kv_heads, num_tiles),
        grid_names=("batch", "kv_heads", "kv_tiles"),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
    )
    compiler_params = plgpu.CompilerParams(approx_math=True)
    interpreter = {} if interpret is None else dict(interpret=interpret)
    if config.dq_ordered:
        visits = tile_visits(
            q_ranges,
            batch=batch,
            num_tiles=num_tiles,
            block_q=block_q,
            tile_keys=NUM_CONSUMERS * block_kv,
            num_q_blocks=num_q_blocks,
            kv_pad=kv_pad,
            band=band,
        )
        grid.update(zip(("grid", "grid_names"), ordered_launch(batch, kv_heads, num_tiles, launch_group)))
        # Each block's first visitor stores its dQ, so the float32 buffer is a plain output (no zero fill: 0.04 of
        # 4.6 ms per fwd+bwd call at the bar's head_dim 64, 8k keys); rows no tile visits stay unwritten: zeroed here.
        dq, dk, dv = plgpu.kernel(
            flash_backward_dkdv_sm90,
            out_type=(jax.ShapeDtypeStruct(q.shape, jnp.float32), *out_type),
            compiler_params=compiler_params,
            **grid,
        )(*operands, dq_order_ranks(visits))
        return dk, dv, jnp.where(dq_visited_rows(visits, block_q)[:, :, None, None], dq, 0.0)
    if not config.dq_atomic:
        if num_d_cols:
            out_type += (jax.ShapeDtypeStruct((batch, q.shape[2], num_d_cols, kv_pad), jnp.float32),)
        return plgpu.kernel(
            flash_backward_dkdv_sm90, out_type=out_type, compiler_params=compiler_params, **grid, **interpreter
        )(*operands)

    # Free order: the dQ accumulator must start at zero and be written in place: a mutable array handed to the
    # kernel (plgpu.kernel's batching wrapper cannot carry one, so the mesh kernel is called directly). It lives
    # in a run_state, whose outside is pure: `_fold_vmap`'s custom_vmap cannot hold a bare `jax.new_ref` (state
    # discharge has no rule for custom_vmap_call).
    def accumulate(refs):
        dq_acc, dk_ref, dv_ref = refs
        dk_ref[...], dv_ref[...] = pl.kernel(
            flash_backward_dkdv_sm90,
            out_type=out_type,
            mesh=plgpu.Mesh(**grid),
            compiler_params=compiler_params,
            **interpreter,
        )(*operands, dq_acc)

    dq, dk, dv = pl.run_state(accumulate)(
        (jnp.zeros(q.shape, jnp.float32), jnp.empty(k.shape, k.dtype), jnp.empty(v.shape, v.dtype))
    )
    return dk, dv, dq
