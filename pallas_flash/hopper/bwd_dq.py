"""The Hopper dQ kernel of the two-pass backward: one CTA per (batch, head, tile of 2 * block_q_dq queries), a
producer streaming K/V blocks through a ring, two consumers with Q, dO, lse2 and delta resident: S = Q K^T,
dP = dO V^T, dS = P (dP - delta), dQ += dS K (optionally pipelined, `HopperBwdConfig.dq_overlap`)."""

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
    dot_t,
    drain_ring,
    load_own_ids,
    masked_edge_loops,
    query_tile_schedule,
    register_ops,
    segment_block_ranges,
    segment_scratch,
    stream_kv_blocks,
    swizzle_transforms,
    tile_visible,
    unmasked_blocks,
    wgmma_operand,
)
from pallas_flash.hopper.config import NUM_CONSUMERS, HopperBwdConfig


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
    dq_ref,
    scoped,
    *,
    scale: float,
    band: masks.Band,
    kv_len: int,
    num_q_tiles: int,
    group: int,
    config: HopperBwdConfig,
    interpreting: bool,
):
    """Grid (batch, heads, q_tiles), 3 warpgroups ("wg"): 0 and 1 consume, 2 produces.

    Shapes and `interpreting` as in `_dkdv_kernel`; dq_ref like q_ref."""
    (
        (q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem),
        resident_ready,
        (k_ready, v_ready),
        (k_free, v_free),
        segments,
    ) = scoped
    has_segments = q_ids_ref is not None
    block_q, block_kv, num_stages = config.block_q_dq, config.block_kv_dq, config.num_stages_dq
    num_kv_blocks = k_ref.shape[1] // block_kv
    dtype = q_ref.dtype
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    tile_start, kv_lo, kv_hi, same = query_tile_schedule(
        num_q_tiles,
        block_q=block_q,
        block_kv=block_kv,
        num_kv_blocks=num_kv_blocks,
        kv_len=kv_len,
        band=band,
        segment_ranges=kv_ranges_ref,
    )
    wg = lax.axis_index("wg")
    iota, zeros, load_vector = register_ops(interpreting)
    consumer_registers, producer_registers = REGISTERS

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        q_start = tile_start + wg * block_q
        rows = (batch, pl.ds(q_start, block_q), head)
        vector = (batch, head, pl.ds(q_start, block_q))
        copies = (
            (q_ref.at[rows], q_smem),
            (do_ref.at[rows], do_smem),
            (lse2_ref.at[vector], lse_smem2.at[wg]),
            (delta_ref.at[vector], delta_smem2.at[wg]),
        )
        for (src, dst), ready in zip(copies, resident_ready):
            plgpu.copy_gmem_to_smem(src, dst, ready.at[wg])
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
        for ready in resident_ready:
            plgpu.barrier_wait(ready.at[wg])
        lse2 = load_vector(lse_smem2.at[wg], row)
        delta = load_vector(delta_smem2.at[wg], row)
        c = scale * LOG2E

        def slot_of(kv_step):
            return lax.rem(kv_step - kv_lo, num_stages)

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

        def d_scores(s, dp, kv_step, slot, *, masked: bool):
            """dS = P (dP - delta) of block kv_step (float32), P recomputed from S and lse2."""
            p = jnp.exp2(s * c - lax.broadcast_in_dim(lse2, s.shape, [0]))
            kv_seg = None
            if has_segments:  # the block's ids ride with K (released with it); every step waits (one wait
                plgpu.barrier_wait(kv_ids_ready.at[slot])  # per phase), masked ones read them
                if masked:
                    kv_seg = load_vector(kv_ids_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
            if masked:
                visible = tile_visible(
                    q_start + iota(s.shape, 0),
                    kv_step * block_kv + iota(s.shape, 1),
                    band=band,
                    kv_len=kv_len if kv_len % block_kv else None,
                    q_seg=q_seg,
                    kv_seg=kv_seg,
                    shape=s.shape,
                    q_axis=0,
                )
                if visible is not None:  # None: traced for a loop that runs no iterations
                    p = jnp.where(visible, p, 0.0)
            return p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))

        def add_ds_k(dq, ds, slot):  # dQ += dS K (dS in the input dtype), waited for
            if interpreting:
                return dq + jnp.dot(
                    ds.astype(dtype), wgmma_operand(k_smem.at[slot]), preferred_element_type=jnp.float32
                )
            return pl.run_state(lambda dq_ref: plgpu.wgmma(dq_ref, ds.astype(dtype), k_smem.at[slot]))(
                plgpu.ACC.init(dq)
            )

        def step(kv_step, dq, *, masked: bool):
            slot = slot_of(kv_step)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])

            s, dp = s_and_dp(slot)
            plgpu.barrier_arrive(v_free.at[slot])
            ds = d_scores(s, dp, kv_step, slot, masked=masked)
            dq = add_ds_k(dq, ds, slot)
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        def overlapped_step(kv_step, carry, *, masked: bool):
            """`config.dq_overlap`: issues S_j and dP_j, then dQ += dS_{j-1} K_{j-1}, waits for S_j and dP_j
            alone (wgmmas complete in order) and computes dS_j while that dQ product runs; K_{j-1} is
            released once it is done, so the ring holds two key blocks per consumer at a time."""
            dq, ds_prev = carry
            slot, prev = slot_of(kv_step), slot_of(kv_step - 1)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            if interpreting:  # the same steps, one product at a time
                s, dp = s_and_dp(slot)
                plgpu.barrier_arrive(v_free.at[slot])
                ds = d_scores(s, dp, kv_step, slot, masked=masked)
                dq = add_ds_k(dq, ds_prev, prev)
            else:

                def products(s_ref, dp_ref, dq_ref):
                    dq_ref[...] = dq
                    issue_s_dp(s_ref, dp_ref, slot)
                    plgpu.wgmma(dq_ref, ds_prev, k_smem.at[prev])
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_j, dP_j done; dQ may run on
                    dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=None)
                    plgpu.barrier_arrive(v_free.at[slot])
                    ds = d_scores(s, dp, kv_step, slot, masked=masked)
                    return dq_ref[...], ds

                dq, ds = pl.run_scoped(
                    products,
                    plgpu.ACC((block_q, block_kv), jnp.float32),
                    plgpu.ACC((block_q, block_kv), jnp.float32),
                    plgpu.ACC(dq.shape, jnp.float32),
                )
            plgpu.barrier_arrive(k_free.at[prev])
            return dq, ds.astype(dtype)

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
        unmasked_lo, unmasked_hi = unmasked_blocks(band_range, (kv_lo, kv_hi), same)
        # Without a left band edge or segment ids, unmasked_lo == kv_lo: no leading edge.
        leading = band.left is not None or has_segments
        dq = zeros((block_q, q_smem.shape[-1]))
        if config.dq_overlap:  # block kv_lo (no dQ product before it) is peeled off and masked; kv_hi > kv_lo
            first = slot_of(kv_lo)
            plgpu.barrier_wait(k_ready.at[first])
            plgpu.barrier_wait(v_ready.at[first])
            s, dp = s_and_dp(first)
            plgpu.barrier_arrive(v_free.at[first])
            ds = d_scores(s, dp, kv_lo, first, masked=True).astype(dtype)
            unmasked_lo, unmasked_hi = (jnp.maximum(edge, kv_lo + 1) for edge in (unmasked_lo, unmasked_hi))
            dq, ds_last = masked_edge_loops(
                overlapped_step, (dq, ds), kv_lo + 1 if leading else None, unmasked_lo, unmasked_hi, kv_hi
            )
            last = slot_of(kv_hi - 1)
            dq = add_ds_k(dq, ds_last, last)
            plgpu.barrier_arrive(k_free.at[last])
        else:
            dq = masked_edge_loops(step, dq, kv_lo if leading else None, unmasked_lo, unmasked_hi, kv_hi)
        q_smem[...] = (dq * scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")
        ids = None if not has_segments else (kv_ids_ref, segments[1], segments[3])
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
            kv_hi=kv_hi,
            kv_ids=ids,
        )
        if interpreting:
            drain_ring((k_free, v_free), num_stages=num_stages, steps=kv_hi - kv_lo)


def dq_pass(
    q,
    k,
    v,
    d_out,
    lse2,
    delta,
    q_ids,
    kv_ids,
    *,
    scale: float,
    band: masks.Band,
    kv_len: int,
    config: HopperBwdConfig,
    interpret,
):
    batch, q_pad, heads, head_dim = q.shape
    block_q, block_kv, num_stages = config.block_q_dq, config.block_kv_dq, config.num_stages_dq
    num_q_tiles = q_pad // (NUM_CONSUMERS * block_q)
    has_segments = q_ids is not None
    transforms = swizzle_transforms()

    def flash_backward_dq_sm90(*refs):  # the kernel's name in profiles
        inputs, rest = refs[:6], refs[6:]
        segment_refs, (dq_ref,) = (rest[:3], rest[3:]) if has_segments else ((None, None, None), rest)
        smem = (
            plgpu.SMEM((NUM_CONSUMERS, block_q, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((NUM_CONSUMERS, block_q, head_dim), d_out.dtype, transforms=transforms),
            plgpu.SMEM((NUM_CONSUMERS, block_q), jnp.float32),
            plgpu.SMEM((NUM_CONSUMERS, block_q), jnp.float32),
            plgpu.SMEM((num_stages, block_kv, head_dim), k.dtype, transforms=transforms),
            plgpu.SMEM((num_stages, block_kv, head_dim), v.dtype, transforms=transforms),
        )
        body = functools.partial(
            _dq_kernel,
            scale=scale,
            band=band,
            kv_len=kv_len,
            num_q_tiles=num_q_tiles,
            group=heads // k.shape[2],
            config=config,
            interpreting=interpret is not None,
        )
        pl.run_scoped(
            lambda *scoped: body(*inputs, *segment_refs, dq_ref, scoped),
            smem,
            (plgpu.Barrier(num_barriers=NUM_CONSUMERS),) * 4,
            (plgpu.Barrier(num_barriers=num_stages),) * 2,
            (plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=num_stages),) * 2,
            segment_scratch(has_segments, (NUM_CONSUMERS, block_q), (num_stages, block_kv)),
            collective_axes="wg",
        )

    operands = (q, k, v, d_out, lse2, delta)
    if has_segments:
        operands += (
            q_ids,
            kv_ids,
            segment_block_ranges(q_ids, kv_ids, rows_per_tile=NUM_CONSUMERS * block_q, cols_per_block=block_kv),
        )
    return plgpu.kernel(
        flash_backward_dq_sm90,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(batch, heads, num_q_tiles),
        grid_names=("batch", "heads", "q_tiles"),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({} if interpret is None else dict(interpret=interpret)),
    )(*operands)
