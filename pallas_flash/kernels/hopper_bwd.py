"""FlashAttention backward for Hopper (sm90), written with Pallas's Mosaic GPU backend.

Two deterministic passes on the forward's residuals (q, k, v, out, lse), after an XLA preprocess
(delta = rowsum(dO * O) - d_lse in float32; lse2 = lse * log2(e), +inf for rows that saw no key and for
padded rows, so that every recomputed P of such a row is exactly 0):

  * dK/dV: one CTA per (batch, kv head, tile of `2 * block_kv_dkv` keys); three warpgroups: a TMA producer
    streaming Q, dO, lse2 and delta blocks of `block_q_dkv` queries through a `num_stages_dkv` ring, and two
    consumers, each owning `block_kv_dkv` key rows with K and V resident in shared memory. Per query block:
    S^T = K Q^T, P^T = exp2(c S^T - lse2), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta),
    dK += dS^T Q, all on wgmma with float32 accumulators. Working in the transposed tiles puts P^T and dS^T
    in registers in the layout the next wgmmas take as their left operand (no transposes). A CTA loops over
    the query heads of its kv head's group (GQA), so dK/dV come out summed over the group.
  * dQ: one CTA per (batch, head, tile of `2 * block_q_dq` queries); a producer streams K/V blocks of
    `block_kv_dq` keys, two consumers of `block_q_dq` rows each with Q, dO, lse2, delta resident:
    S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K.

  * One pass (`HopperBwdConfig.dq_atomic`): the dK/dV kernel also computes each query block's dQ = dS K and
    reduce-adds it into a float32 buffer by TMA, in an order that varies; with `dq_ordered` a store warp of
    the producer adds each (batch, head, query block)'s dQ only after the higher key tiles' (a global
    semaphore per block, `dq_order_ranks`), so dQ is bitwise deterministic; key tiles launch in descending
    order within groups of (batch, kv head) pairs (`ordered_launch`).

Masks as in the forward (`hopper_fwd`): a causal or windowed band (top-left aligned: causal query i sees key
j <= i) bounds the blocks each CTA visits (`tiles.q_block_range` for a dK/dV tile, `tiles.kv_block_range`
for a dQ tile), and only blocks on the band's edges are masked; segment ids (lengths folded in) narrow the
visited blocks further (`segment_block_ranges`), ride the Q ring (dK/dV) or the K ring (dQ), and mask the
blocks that are not wholly inside the tile's one segment.
Ragged lengths are padded in the wrapper: padded query rows have lse2 = +inf and dO = 0 (no contribution),
padded keys are masked in the dQ pass (their dK/dV rows are sliced off). head_dim is padded to a multiple
of 64 (the wgmma contraction granule of a 128-byte swizzle).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import _compat, masks
from pallas_flash.config import H100_SHARED_MEMORY, NUM_CONSUMERS, HopperBwdConfig
from pallas_flash.kernels import tiles
from pallas_flash.kernels.hopper_fwd import (HEAD_DIM_TILE, LOG2E, _pad_axis, _round_up, dot_t, drain_ring,
                                             fill_ring, load_own_ids, padded_head_dim, query_tile_schedule,
                                             register_ops, segment_block_ranges, stream_kv_blocks, tile_visible,
                                             unmasked_blocks, masked_edge_loops)

MAX_HEAD_DIM = 128  # at 256, K and V of a 128-key CTA alone take 128 KiB of shared memory
# setmaxnreg budgets (consumer, producer) of every backward kernel: FA3's 240/24 rather than the forward's 232/40,
# as the consumers hold dK and dV (or dQ) through the step plus, in the one pass, the dQ slice's operands and, in
# the pipelined kernels, the previous step's dS. On the H100, fwd+bwd x cuDNN with 240/24 against 232/40: the
# one pass 3-9% nearer (sixth session of 2026-11-23); the pipelined two passes at head_dim 128 without a causal
# band 2.5-5% nearer, their dK/dV kernel's spills 8 B -> 0 (188 -> 112 B causal); the plain two passes at head_dim
# 64, causal 2k, 2% nearer (session 10 of 2026-11-25). Only the plain two passes at head_dim 128, the default of
# none, measured 0-3% further (sixth session). benchmarks/results/2026-11-23-h100/README.md,
# benchmarks/results/2026-11-25-h100/session10/README.md.
REGISTERS = (240, 24)
# The ordered one pass's producer warp by warp: warp 1 adds dQ in order, the others issue a step's copies ("q": Q
# and the segment ids; "lse2", "do", "delta"). On a full band one warp issues them all: two cost 4-7% there
# (session 11's c13). Under a band (the split step order) dO and delta from a second warp gained 0.5% at 8k and
# 0.7% at 16k (head_dim 64 causal; session 14's c1, three interleaved pairs; session 11's c10: +0.3-1.2%);
# three warps (lse2 and/or delta from warp 3) tied with two (session 14's c2).
ALL_COPIES = ("q", "lse2", "do", "delta")
BANDED_LOAD_WARPS = {0: ("q", "lse2"), 2: ("do", "delta")}

def _transforms():
    # 128-byte swizzle over (8, 64)-element tiles: the layout wgmma reads without bank conflicts.
    return (plgpu.TilingTransform((8, HEAD_DIM_TILE)), plgpu.SwizzleTransform(128))


def dq_split(head_dim: int, block_q: int) -> str | None:
    """How the one-pass kernel's two consumers share a query block's dQ = dS K (`HopperBwdConfig.dq_atomic`):
    "columns", each half of head_dim from all 2 block_kv keys (FA3's split), where half of head_dim is whole
    64-column tiles of the 128-byte swizzle (head_dim 128); else "rows", each half of the block's queries,
    where that half is a whole wgmma M of 64 (block_q >= 128); else None (not supported)."""
    if head_dim // NUM_CONSUMERS % HEAD_DIM_TILE == 0:
        return "columns"
    if block_q // NUM_CONSUMERS % 64 == 0:
        return "rows"
    return None


def _dq_share(head_dim: int, block_q: int, wg):
    """Warpgroup wg's dQ rows and columns within a query block (`dq_split`)."""
    if dq_split(head_dim, block_q) == "columns":
        return pl.ds(0, block_q), pl.ds(wg * (head_dim // NUM_CONSUMERS), head_dim // NUM_CONSUMERS)
    return pl.ds(wg * (block_q // NUM_CONSUMERS), block_q // NUM_CONSUMERS), pl.ds(0, head_dim)


def _dq_split(ds_t_smem, k_smem, wg):
    """Warpgroup wg's share of dQ = (dS^T)^T K (`dq_split`): (its columns of the shared dS^T tile, its columns
    of the shared K tile, its dQ rows and columns within the query block)."""
    (_, block_q), head_dim = ds_t_smem.shape, k_smem.shape[-1]
    rows, cols = _dq_share(head_dim, block_q, wg)
    if dq_split(head_dim, block_q) == "columns":
        return ds_t_smem, k_smem.at[:, cols], rows, cols
    return ds_t_smem.at[:, rows], k_smem, rows, cols


def visited_q_blocks(kv_tile, read_range, *, block_q: int, tile_keys: int, num_q_blocks: int, kv_pad: int,
                     band: masks.Band):
    """(lo, hi, same): the query blocks [lo, hi) that the dK/dV CTA of key tile `kv_tile` (`tile_keys` keys)
    visits per query head: those its keys' band reaches, intersected with its segment ids' blocks; `same` the
    run of blocks in the tile's one segment (None without ids). `read_range(i)`: entry i of the tile's row of
    `segment_block_ranges`, or None without segment ids. Elementwise: the kernel calls it on its scalars,
    `tile_visits` on every tile at once."""
    q_lo, _, _, q_hi = tiles.q_block_range(kv_tile, block_q=block_q, block_kv=tile_keys, num_q_blocks=num_q_blocks,
                                           kv_len=kv_pad, band=band, always_mask=True)
    if read_range is None:
        return q_lo, q_hi, None
    q_lo = jnp.maximum(q_lo, read_range(0))
    q_hi = jnp.maximum(jnp.minimum(q_hi, read_range(1)), q_lo)
    return q_lo, q_hi, (read_range(2), read_range(3))


def tile_visits(q_ranges, *, batch: int, num_tiles: int, block_q: int, tile_keys: int, num_q_blocks: int,
                kv_pad: int, band: masks.Band):
    """int32 [batch, num_tiles, num_q_blocks]: 1 where key tile t of example b visits query block j
    (`visited_q_blocks`, the kernel's own rule; the same for every query head)."""
    read = None if q_ranges is None else (lambda i: q_ranges[:, :, i])
    lo, hi, _ = visited_q_blocks(jnp.arange(num_tiles, dtype=jnp.int32)[None, :], read, block_q=block_q,
                                 tile_keys=tile_keys, num_q_blocks=num_q_blocks, kv_pad=kv_pad, band=band)
    lo, hi = (jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch, num_tiles)) for x in (lo, hi))
    blocks = jnp.arange(num_q_blocks, dtype=jnp.int32)
    return ((blocks >= lo[:, :, None]) & (blocks < hi[:, :, None])).astype(jnp.int32)


def dq_order_ranks(visits):
    """int32 [batch, num_tiles, num_q_blocks]: for `HopperBwdConfig.dq_ordered`, entry (b, t, j) counts the key
    tiles t' > t of example b that visit query block j (`visits`: `tile_visits`). The CTA of tile t adds its
    dQ of block j once that many tiles have added theirs: descending tile order, in which a causal band's
    higher tiles, which start at later query blocks, reach each block first anyway. Rank 0 (the first
    visitor) stores its dQ instead of adding it, so the float32 buffer needs no zero fill."""
    return (jnp.sum(visits, axis=1, keepdims=True) - jnp.cumsum(visits, axis=1)).astype(jnp.int32)


def dq_visited_rows(visits, block_q: int):
    """bool [batch, num_q_blocks * block_q]: query rows in a block that some key tile visits (`visits`:
    `tile_visits`). The dq_ordered kernel writes the other rows of its float32 dQ buffer nowhere (their dQ
    is 0)."""
    return jnp.repeat(jnp.any(visits > 0, axis=1), block_q, axis=1)


# dq_ordered launch: (batch, kv head) pairs in groups; within a group, key tiles in descending order, each tile
# for all the group's pairs. A tile waits only on higher tiles of its own pair, which launched before it
# (deadlock-free under in-order dispatch). A wave of CTAs reduce-adds into the dQ of every pair in its group,
# so groups are sized to keep that dQ in L2: at most DQ_L2_BYTES of it (of the H100's 50 MiB), and at most
# MAX_PAIRS_PER_GROUP pairs (a wave then holds ~132 / 32 tiles per pair). On the H100 (2026-11-23, head_dim 64,
# fwd+bwd x cuDNN): groups of 32 pairs at 16k keys (128 MiB of dQ) 0.65-0.77x, of 4 (16 MiB) 0.99-1.01x; at 8k
# and 16k a 32 MiB budget fell to 0.82-0.89x causal, 16 and 8 MiB measured alike (8 equal or better at 3 of 4
# points), so 8, the furthest from that cliff.
DQ_L2_BYTES = 8 << 20
MAX_PAIRS_PER_GROUP = 32


def pairs_per_group(pairs: int, dq_bytes_per_pair: int) -> int:
    """(batch, kv head) pairs per launch group of the dq_ordered kernel (`ordered_launch`)."""
    return max(1, min(pairs, MAX_PAIRS_PER_GROUP, DQ_L2_BYTES // dq_bytes_per_pair))


def ordered_launch(batch: int, kv_heads: int, num_tiles: int, group: int):
    """(grid, grid_names) of the dq_ordered dK/dV kernel with `group` pairs per group: (pair groups, key tiles,
    pairs in a group), the last CUDA's x (fastest in launch order). `ordered_cta` decodes a CTA's coordinates."""
    return (pl.cdiv(batch * kv_heads, group), num_tiles, group), ("pair_groups", "kv_tiles", "pairs")


def ordered_cta(batch: int, kv_heads: int, num_tiles: int, group: int):
    """(batch, kv head, key tile, active) of this CTA under `ordered_launch`: tiles descend in launch order;
    CTAs past the last pair (the last group may be partial) are inactive and do nothing."""
    pair = lax.axis_index("pair_groups") * group + lax.axis_index("pairs")
    kv_tile = num_tiles - 1 - lax.axis_index("kv_tiles")
    return lax.div(pair, kv_heads), lax.rem(pair, kv_heads), kv_tile, pair < batch * kv_heads


def step_block(step, *, q_lo, q_steps):
    """(query head within the kv head's group, query block) of a dK/dV CTA's step: the CTA visits query blocks
    [q_lo, q_lo + q_steps) of each query head of its group in turn (`q_steps` may be 0)."""
    per_head = jnp.maximum(q_steps, 1)
    return lax.div(step, per_head), q_lo + lax.rem(step, per_head)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_ids_ref, kv_ids_ref, q_ranges_ref,
                 dq_acc_ref, dk_ref, dv_ref, scoped, *, scale: float, band: masks.Band, kv_len: int, group: int,
                 config: HopperBwdConfig, interpreting: bool, dq_order=None):
    """Grid (batch, kv_heads, kv_tiles) (with config.dq_ordered `ordered_launch`'s), 3 warpgroups ("wg"):
    0 and 1 consume, 2 produces (with config.dq_ordered its first warp loads, its second stores dQ).

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
    dq_order: None, or (config.dq_ordered) a `_DqOrder`."""
    ((k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, *dq_staging), (k_ready, v_ready),
     (q_ready, do_ready, lse_ready, delta_ready), free, segments, *ds_barriers) = scoped
    has_segments = q_ids_ref is not None
    block_q, block_kv, num_stages = config.block_q_dkv, config.block_kv_dkv, config.num_stages_dkv
    num_q_blocks = q_ref.shape[1] // block_q
    dtype = q_ref.dtype
    if dq_order is None:
        batch, kv_head = lax.axis_index("batch"), lax.axis_index("kv_heads")
        kv_tile = lax.axis_index("kv_tiles")
    else:
        batch, kv_head, kv_tile = dq_order.cta
    tile_start = kv_tile * (NUM_CONSUMERS * block_kv)
    # Padded keys need a mask only where their dS reaches real rows: the one-pass dQ. (Without it only
    # their own dK/dV rows see them, and those are sliced off.)
    mask_padded_keys = dq_acc_ref is not None and kv_len != k_ref.shape[1]
    # Every step is masked with padded keys to hide; else the band's edges, and with segment ids the query
    # blocks outside the tile's same-segment run.
    always_mask = mask_padded_keys
    # Query blocks this CTA visits per head: those its keys' band reaches (maybe none).
    q_lo, q_hi, same = visited_q_blocks(
        kv_tile, (lambda i: q_ranges_ref[batch, kv_tile, i]) if has_segments else None, block_q=block_q,
        tile_keys=NUM_CONSUMERS * block_kv, num_q_blocks=num_q_blocks, kv_pad=k_ref.shape[1], band=band)
    q_steps = q_hi - q_lo
    total_steps = group * q_steps
    wg = lax.axis_index("wg")
    iota, zeros, load_vector = register_ops(interpreting)
    consumer_registers, producer_registers = REGISTERS

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        v_smem = v_smem2.at[wg]
        # One pass: K of both warpgroups is one [2 block_kv, D] tile (each dQ wgmma reads all of it).
        k_smem = k_smem2.at[wg] if dq_acc_ref is None else k_smem2.at[pl.ds(wg * block_kv, block_kv)]
        kv_start = tile_start + wg * block_kv
        rows = (batch, pl.ds(kv_start, block_kv), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, k_ready.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, v_ready.at[wg])
        column = plgpu.Layout.WGMMA.reduce(0)  # a per-query vector, broadcast along the key rows of S^T
        kv_seg = None
        if has_segments:
            q_ids_smem, kv_ids_smem, q_ids_ready, kv_ids_ready = segments
            kv_seg = load_own_ids(kv_ids_ref, kv_ids_smem, kv_ids_ready, wg=wg, batch=batch, start=kv_start,
                                  size=block_kv, layout=plgpu.Layout.WGMMA.reduce(1), load=load_vector)
        if dq_acc_ref is None:
            plgpu.barrier_wait(k_ready.at[wg])
        else:  # this warpgroup's dQ wgmmas read the other's keys too
            for i in range(NUM_CONSUMERS):
                plgpu.barrier_wait(k_ready.at[i])
        plgpu.barrier_wait(v_ready.at[wg])
        c = scale * LOG2E  # exp(scale * s - lse) = exp2(c * s - lse2)

        # The order of a step's wgmmas. Split: S^T; then dV with dP^T; then dK (and dQ): three groups, the
        # elementwise work between them. Fused: S^T with dP^T (neither needs P^T); then dV, dK (and dQ): two
        # groups, one wait fewer per step, at the price of dP^T's registers live through the softmax. On the
        # H100 (fwd+bwd x cuDNN, head_dim 64; NOTES.md "Order of the wgmmas") fused put the ordered one pass
        # 2-3% nearer cuDNN on a full band but 8% further under a causal band, the free-order one pass 4-6%
        # further on a full band, and the two passes no nearer. So: fused for the ordered one pass on a full
        # band only.
        fused = dq_order is not None and band.is_full
        # `config.delta_in_dp`: where the split order's or dkv_overlap's dP^T wgmma runs (not fused, not
        # interpreting), its accumulator starts at -delta, so it yields dP^T - delta and delta is not live beside
        # P^T, dP^T, dK and dV when dS^T is formed (fewer spills: NOTES.md "delta in dP's accumulator").
        delta_in_dp = config.delta_in_dp and not fused and not interpreting

        def probabilities(s, q_block, slot, *, masked: bool):
            """P^T = exp2(c S^T - lse2) of the step's query block (float32), masked if `masked`."""
            lse2 = load_vector(lse_smem.at[slot], column)
            p = jnp.exp2(s * c - lax.broadcast_in_dim(lse2, s.shape, [1]))
            q_seg = None
            if has_segments:  # every step waits (one wait per phase); masked ones read the ids
                plgpu.barrier_wait(q_ids_ready.at[slot])
                if masked:
                    q_seg = load_vector(q_ids_smem.at[slot], column)
            if masked:
                visible = tile_visible(q_block * block_q + iota(s.shape, 1), kv_start + iota(s.shape, 0),
                                       band=band, kv_len=kv_len if mask_padded_keys else None, q_seg=q_seg,
                                       kv_seg=kv_seg, shape=s.shape, q_axis=1)
                if visible is not None:  # None: traced for a loop that runs no iterations
                    p = jnp.where(visible, p, 0.0)
            return p

        def delta_columns(slot, shape):
            """The step's delta (per query) broadcast over the key rows of a [block_kv, block_q] tile."""
            return lax.broadcast_in_dim(load_vector(delta_smem.at[slot], column), shape, [1])

        def wait_q(slot):  # the step's Q block and its lse2 have landed
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.barrier_wait(lse_ready.at[slot])

        def wait_do(slot):  # and its dO block and delta
            plgpu.barrier_wait(do_ready.at[slot])
            plgpu.barrier_wait(delta_ready.at[slot])

        def step(q_block, carry, *, g, masked: bool):
            dk, dv = carry
            t = g * q_steps + q_block - q_lo  # this warpgroup's step number (`step_block` inverted)
            slot = lax.rem(t, num_stages)
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
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
                s = dot_t(k_smem[...], q_tile[...])
            elif fused:
                s, dp = pl.run_scoped(s_t_dp_t, tile, tile)
            else:
                s = pl.run_scoped(s_t, tile)
            p = probabilities(s, q_block, slot, masked=masked)
            if not fused:
                wait_do(slot)

                def dv_dp_t(refs):  # one wgmma group: a single wait for both
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dv_ref, p.astype(dtype), do_tile)
                    plgpu.wgmma(dp_ref, v_smem, do_tile.transpose((1, 0)))

                if interpreting:
                    dv = dv + jnp.dot(p.astype(dtype), do_tile[...], preferred_element_type=jnp.float32)
                    dp = dot_t(v_smem[...], do_tile[...])
                else:
                    dp_init = -delta_columns(slot, s.shape) if delta_in_dp else zeros(s.shape)
                    dv, dp = pl.run_state(dv_dp_t)((plgpu.ACC.init(dv), plgpu.ACC.init(dp_init)))
            ds = p * dp if delta_in_dp else p * (dp - delta_columns(slot, s.shape))
            if fused:  # the wgmma operands now: float32 P^T dies here
                ds, p = ds.astype(dtype), p.astype(dtype)
            if dq_acc_ref is None:
                def dk_update(dk_ref):
                    plgpu.wgmma(dk_ref, ds.astype(dtype), q_tile)

                if interpreting:
                    dk = dk + jnp.dot(ds.astype(dtype), q_tile[...], preferred_element_type=jnp.float32)
                else:
                    dk = pl.run_state(dk_update)(plgpu.ACC.init(dk))
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv
            # One pass, FA3's split: both warpgroups' dS^T halves go to one shared [2 block_kv, block_q] tile,
            # and each warpgroup computes half of dQ[q block] = dS K from all 2 block_kv keys (half the
            # columns, or at head_dim 64 half the query rows: see `_dq_split`), reduce-added by TMA (unscaled).
            # The dS^T tile is reused every step. Before overwriting it at step t a warpgroup waits on
            # `ds_free` for step t-1's phase, completed by both warpgroups' arrivals after their step t-1 dQ
            # wgmma returned (pl.run_state waits for the wgmma group), i.e. after the last reads of the
            # tile; every phase is waited once (at the next step, or after the loop for the last one).
            # `ds_ready` (two arrivals, each after its half's store and commit_smem) orders the stores before
            # the other warpgroup's dQ wgmma.
            ds_ready, ds_free = ds_barriers
            ds_t_smem, dq_staging_smem = dq_staging
            ds = ds.astype(dtype)

            @pl.when(t > 0)
            def _():
                plgpu.barrier_wait(ds_free)

            ds_t_smem.at[pl.ds(wg * block_kv, block_kv)][...] = ds
            plgpu.commit_smem()
            plgpu.barrier_arrive(ds_ready)
            ds_operand, k_operand, dq_rows, dq_cols = _dq_split(ds_t_smem, k_smem2, wg)

            def dk_dq(dk_ref, dq_ref):  # dK's wgmma is issued before the wait for the other half of dS^T
                plgpu.wgmma(dk_ref, ds, q_tile)
                plgpu.barrier_wait(ds_ready)
                plgpu.wgmma(dq_ref, ds_operand.transpose((1, 0)), k_operand)

            def dv_dk_dq(refs):
                dv_ref, dk_ref, dq_ref = refs
                plgpu.wgmma(dv_ref, p, do_tile)
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
                return dk, dv
            # Two staging slots per warpgroup, one store (its own bulk group) per step: once at most one is
            # in flight (step t-1's), step t-2's has read this slot.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            dq_smem[...] = dq
            plgpu.commit_smem()
            q_rows = pl.ds(q_block * block_q + dq_rows.start, dq_rows.size)
            plgpu.copy_smem_to_gmem(dq_smem, dq_acc_ref.at[batch, q_rows, kv_head * group + g, dq_cols],
                                    reduction_op="add")
            return dk, dv

        def overlapped_step(q_block, carry, *, g, masked: bool):
            """`config.dkv_overlap` (two passes): issues S^T_t, then dK += dS^T_{t-1} Q_{t-1}, waits for S^T_t
            alone (wgmma groups complete in order) and computes P^T_t while that dK product runs; then dV with
            dP^T_t as in `step`. Q_{t-1}'s slot is released once its dK product is done, so the consumer holds
            two slots of the ring. Step 0 has no previous step: its dK product adds zeros (the initial dS^T)
            times its own Q block, which is exact, and it releases nothing."""
            dk, dv, ds_prev = carry
            t = g * q_steps + q_block - q_lo
            slot = lax.rem(t, num_stages)
            prev = jnp.where(t > 0, lax.rem(t + num_stages - 1, num_stages), slot)
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            wait_q(slot)

            if interpreting:  # the same steps, one product at a time
                s = dot_t(k_smem[...], q_tile[...])
                dk = dk + jnp.dot(ds_prev, q_smem.at[prev][...], preferred_element_type=jnp.float32)
                p = probabilities(s, q_block, slot, masked=masked)
                wait_do(slot)
                dv = dv + jnp.dot(p.astype(dtype), do_tile[...], preferred_element_type=jnp.float32)
                dp = dot_t(v_smem[...], do_tile[...])
            else:
                def products(s_ref, dk_ref, dv_ref, dp_ref):
                    dk_ref[...] = dk
                    dv_ref[...] = dv
                    plgpu.wgmma(s_ref, k_smem, q_tile.transpose((1, 0)))
                    plgpu.wgmma(dk_ref, ds_prev, q_smem.at[prev])
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S^T_t done; dK may run on
                    p = probabilities(s, q_block, slot, masked=masked)
                    wait_do(slot)
                    if delta_in_dp:
                        dp_ref[...] = -delta_columns(slot, p.shape)
                    plgpu.wgmma(dv_ref, p.astype(dtype), do_tile)
                    plgpu.wgmma(dp_ref, v_smem, do_tile.transpose((1, 0)))
                    dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=None)
                    return p, dp, dk_ref[...], dv_ref[...]

                tile, accumulator = plgpu.ACC((block_kv, block_q), jnp.float32), plgpu.ACC(dk.shape, jnp.float32)
                p, dp, dk, dv = pl.run_scoped(products, tile, accumulator, accumulator, tile)

            @pl.when(t > 0)
            def _():
                plgpu.barrier_arrive(free.at[prev])

            ds = p * dp if delta_in_dp else p * (dp - delta_columns(slot, p.shape))
            return dk, dv, ds.astype(dtype)

        # Query blocks that see every key of this warpgroup (in its band and, with segment ids, in the tile's
        # one segment) skip the mask (none, with `always_mask`).
        _, *band_range, _ = tiles.q_block_range(
            lax.div(kv_start, block_kv), block_q=block_q, block_kv=block_kv, num_q_blocks=num_q_blocks,
            kv_len=k_ref.shape[1], band=band, always_mask=always_mask)
        unmasked_lo, unmasked_hi = unmasked_blocks(band_range, (q_lo, q_hi), same)

        # Without a left band edge, masked padding or segment ids, unmasked_hi == q_hi: no trailing edge.
        trailing = band.left is not None or always_mask or has_segments

        overlap = config.dkv_overlap and dq_acc_ref is None
        step_fn = overlapped_step if overlap else step

        def head(g, carry):
            return masked_edge_loops(functools.partial(step_fn, g=g), carry, q_lo, unmasked_lo, unmasked_hi,
                                     q_hi if trailing else None)

        shape = (block_kv, k_smem.shape[-1])
        carry = (zeros(shape), zeros(shape))
        if overlap:
            carry += (zeros((block_kv, block_q)).astype(dtype),)
        dk, dv, *ds_last = lax.fori_loop(0, group, head, carry)
        if dq_acc_ref is not None:
            @pl.when(total_steps > 0)
            def _():  # the last step's phase: the other warpgroup's last dQ wgmma has read this K
                plgpu.barrier_wait(ds_barriers[1])
        # K and V of this warpgroup are read by wgmmas that have all returned: reuse them for the output.
        if overlap:  # the last step's dK product, then its slot is free
            last = lax.rem(total_steps + num_stages - 1, num_stages)

            @pl.when(total_steps > 0)
            def _():
                if interpreting:
                    dk_out = dk + jnp.dot(ds_last[0], q_smem.at[last][...], preferred_element_type=jnp.float32)
                else:
                    dk_out = pl.run_state(lambda dk_ref: plgpu.wgmma(dk_ref, ds_last[0], q_smem.at[last]))(
                        plgpu.ACC.init(dk))
                plgpu.barrier_arrive(free.at[last])
                k_smem[...] = (dk_out * scale).astype(dtype)

            @pl.when(total_steps == 0)
            def _():
                k_smem[...] = (dk * scale).astype(dtype)
        else:
            k_smem[...] = (dk * scale).astype(dtype)
        v_smem[...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows], commit_group=False)
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")

        def load(step, slot, wait_free: bool, copies=ALL_COPIES):
            """Step `step`'s copies into ring slot `slot`, those named in `copies` (`ALL_COPIES`)."""
            g, q_block = step_block(step, q_lo=q_lo, q_steps=q_steps)
            head = kv_head * group + g
            queries = pl.ds(q_block * block_q, block_q)
            if wait_free:
                plgpu.barrier_wait(free.at[slot])
            rows = (batch, queries, head)
            if "q" in copies:
                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_ready.at[slot])
                if has_segments:  # ids of the block's queries (read in masked steps, which all steps are then)
                    plgpu.copy_gmem_to_smem(q_ids_ref.at[batch, queries], segments[0].at[slot],
                                            segments[2].at[slot])
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
                store_dq_in_order(dq_order, dq_staging[1], dq_acc_ref, batch=batch, kv_head=kv_head,
                                  kv_tile=kv_tile, group=group, q_lo=q_lo, q_steps=q_steps, block_q=block_q)


class _DqOrder(NamedTuple):
    """What the dq_ordered dK/dV kernel needs beyond the one-pass kernel's: `dq_order_ranks`' int32 table in
    global memory; a global int32 semaphore per (batch, query head, query block), flattened, zero at launch;
    the CTA's (batch, kv head, key tile) (`ordered_cta`); per dQ staging slot a barrier that both consumers'
    dQ is in it (`staged`) and one that the store warp has read it out (`free`)."""
    ranks: object
    semaphores: object
    cta: tuple
    staged: object
    free: object


def store_dq_in_order(order: _DqOrder, staging, dq_acc_ref, *, batch, kv_head, kv_tile, group: int, q_lo, q_steps,
                      block_q: int):
    """The dq_ordered kernel's store warp: for each step t of the CTA (query head g, query block j), once both
    consumers have staged their dQ halves in slot t % 2 and the semaphore of (batch, head, block) counts every
    higher key tile that visits the block (`dq_order_ranks`), reduce-add both halves into dq_acc_ref by TMA
    (store them, if no higher tile visits the block);
    once they have landed, free the slot and add 1 to the semaphore. So each block's float32 sums run in one
    order whatever the timing, and the consumers wait on nothing but a free slot (two slots: they stage step
    t+1 while this warp waits). Signalling step t-1 after issuing step t instead measured the same."""
    _, q_pad, heads, head_dim = dq_acc_ref.shape
    num_q_blocks = q_pad // block_q

    @pl.loop(0, q_steps * group)
    def _store(t):
        slot = lax.rem(t, 2)
        g, q_block = step_block(t, q_lo=q_lo, q_steps=q_steps)
        semaphore = order.semaphores.at[(batch * heads + kv_head * group + g) * num_q_blocks + q_block]
        rank = order.ranks[batch, kv_tile, q_block]
        plgpu.barrier_wait(order.staged.at[slot])
        _compat.semaphore_wait_at_least(semaphore, rank)
        for wg in range(NUM_CONSUMERS):
            rows, cols = _dq_share(head_dim, block_q, wg)
            q_rows = pl.ds(q_block * block_q + rows.start, rows.size)
            share, block = staging.at[slot, wg], dq_acc_ref.at[batch, q_rows, kv_head * group + g, cols]
            # The block's first visitor stores (the buffer starts unwritten), the later ones add.
            plgpu.copy_smem_to_gmem(share, block, rank == 0, commit_group=False)
            plgpu.copy_smem_to_gmem(share, block, rank > 0, reduction_op="add", commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)
        plgpu.barrier_arrive(order.free.at[slot])
        _compat.semaphore_signal_gpu(semaphore)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, q_ids_ref, kv_ids_ref, kv_ranges_ref, dq_ref,
               scoped, *, scale: float, band: masks.Band, kv_len: int, num_q_tiles: int, group: int,
               config: HopperBwdConfig, interpreting: bool):
    """Grid (batch, heads, q_tiles), 3 warpgroups ("wg"): 0 and 1 consume, 2 produces.

    Shapes and `interpreting` as in `_dkdv_kernel`; dq_ref like q_ref."""
    ((q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem), resident_ready, (k_ready, v_ready),
     (k_free, v_free), segments) = scoped
    has_segments = q_ids_ref is not None
    block_q, block_kv, num_stages = config.block_q_dq, config.block_kv_dq, config.num_stages_dq
    num_kv_blocks = k_ref.shape[1] // block_kv
    dtype = q_ref.dtype
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    tile_start, kv_lo, kv_hi, same = query_tile_schedule(num_q_tiles, block_q=block_q, block_kv=block_kv,
                                                         num_kv_blocks=num_kv_blocks, kv_len=kv_len, band=band,
                                                         segment_ranges=kv_ranges_ref)
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
        copies = ((q_ref.at[rows], q_smem), (do_ref.at[rows], do_smem),
                  (lse2_ref.at[vector], lse_smem2.at[wg]), (delta_ref.at[vector], delta_smem2.at[wg]))
        for (src, dst), ready in zip(copies, resident_ready):
            plgpu.copy_gmem_to_smem(src, dst, ready.at[wg])
        row = plgpu.Layout.WGMMA.reduce(1)  # a per-query vector, broadcast along the keys of S
        q_seg = None
        if has_segments:
            q_ids_smem, kv_ids_smem, q_ids_ready, kv_ids_ready = segments
            q_seg = load_own_ids(q_ids_ref, q_ids_smem, q_ids_ready, wg=wg, batch=batch, start=q_start,
                                 size=block_q, layout=row, load=load_vector)
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
                return dot_t(q_smem[...], k_smem.at[slot][...]), dot_t(do_smem[...], v_smem.at[slot][...])

            def products(s_ref, dp_ref):
                issue_s_dp(s_ref, dp_ref, slot)
                return s_ref[...], dp_ref[...]

            return pl.run_scoped(products, plgpu.ACC((block_q, block_kv), jnp.float32),
                                 plgpu.ACC((block_q, block_kv), jnp.float32))

        def d_scores(s, dp, kv_step, slot, *, masked: bool):
            """dS = P (dP - delta) of block kv_step (float32), P recomputed from S and lse2."""
            p = jnp.exp2(s * c - lax.broadcast_in_dim(lse2, s.shape, [0]))
            kv_seg = None
            if has_segments:  # the block's ids ride with K (released with it); every step waits (one wait
                plgpu.barrier_wait(kv_ids_ready.at[slot])  # per phase), masked ones read them
                if masked:
                    kv_seg = load_vector(kv_ids_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
            if masked:
                visible = tile_visible(q_start + iota(s.shape, 0), kv_step * block_kv + iota(s.shape, 1),
                                       band=band, kv_len=kv_len if kv_len % block_kv else None, q_seg=q_seg,
                                       kv_seg=kv_seg, shape=s.shape, q_axis=0)
                if visible is not None:  # None: traced for a loop that runs no iterations
                    p = jnp.where(visible, p, 0.0)
            return p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))

        def add_ds_k(dq, ds, slot):  # dQ += dS K (dS in the input dtype), waited for
            if interpreting:
                return dq + jnp.dot(ds.astype(dtype), k_smem.at[slot][...], preferred_element_type=jnp.float32)
            return pl.run_state(lambda dq_ref: plgpu.wgmma(dq_ref, ds.astype(dtype), k_smem.at[slot]))(
                plgpu.ACC.init(dq))

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

                dq, ds = pl.run_scoped(products, plgpu.ACC((block_q, block_kv), jnp.float32),
                                       plgpu.ACC((block_q, block_kv), jnp.float32), plgpu.ACC(dq.shape, jnp.float32))
            plgpu.barrier_arrive(k_free.at[prev])
            return dq, ds.astype(dtype)

        # Only the band's edges, the ragged last block and (with segment ids) blocks that are not wholly in
        # the tile's one segment pay for the mask.
        _, *band_range, _ = tiles.kv_block_range(
            lax.div(q_start, block_q), block_q=block_q, block_kv=block_kv, num_kv_blocks=num_kv_blocks,
            kv_len=kv_len, band=band, always_mask=False)
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
            dq, ds_last = masked_edge_loops(overlapped_step, (dq, ds), kv_lo + 1 if leading else None,
                                            unmasked_lo, unmasked_hi, kv_hi)
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
        stream_kv_blocks((k_ref, v_ref), (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free), batch=batch,
                         kv_head=lax.div(head, group), block_kv=block_kv, num_stages=num_stages, kv_lo=kv_lo,
                         kv_hi=kv_hi, kv_ids=ids)
        if interpreting:
            drain_ring((k_free, v_free), num_stages=num_stages, steps=kv_hi - kv_lo)


def _segment_scratch(has_segments: bool, q_ids_shape, kv_ids_shape):
    """Shared memory and barriers for segment ids: (query ids, key ids, their "ready" barriers), or None.
    Shapes are (slots, length); one barrier per slot."""
    if not has_segments:
        return None
    return (plgpu.SMEM(q_ids_shape, jnp.int32), plgpu.SMEM(kv_ids_shape, jnp.int32),
            plgpu.Barrier(num_barriers=q_ids_shape[0]), plgpu.Barrier(num_barriers=kv_ids_shape[0]))


def _dkdv(q, k, v, d_out, lse2, delta, q_ids, kv_ids, *, scale: float, band: masks.Band, kv_len: int,
          config: HopperBwdConfig, interpret):
    """(dk, dv), and with config.dq_atomic also dq (float32, unscaled, [batch, q_pad, heads, d])."""
    batch, kv_pad, kv_heads, head_dim = k.shape
    block_q, block_kv, num_stages = config.block_q_dkv, config.block_kv_dkv, config.num_stages_dkv
    has_segments = q_ids is not None
    transforms = _transforms()
    # One pass: K as one [2 block_kv, D] tile, since each dQ wgmma reads both warpgroups' keys.
    k_shape = (NUM_CONSUMERS * block_kv, head_dim) if config.dq_atomic else (NUM_CONSUMERS, block_kv, head_dim)
    smem = [
        plgpu.SMEM(k_shape, k.dtype, transforms=transforms),
        plgpu.SMEM((NUM_CONSUMERS, block_kv, head_dim), v.dtype, transforms=transforms),
        plgpu.SMEM((num_stages, block_q, head_dim), q.dtype, transforms=transforms),
        plgpu.SMEM((num_stages, block_q, head_dim), d_out.dtype, transforms=transforms),
        plgpu.SMEM((num_stages, block_q), jnp.float32),
        plgpu.SMEM((num_stages, block_q), jnp.float32),
    ]
    extra_barriers = ()
    if config.dq_atomic:
        # Both consumers' dS^T in one tile; per (step parity, consumer) its float32 share of dQ for the TMA
        # reduce; two-arrival barriers: that tile written (`ds_ready`), and read by both dQ wgmmas (`ds_free`).
        rows, cols = ((block_q, head_dim // NUM_CONSUMERS) if dq_split(head_dim, block_q) == "columns"
                      else (block_q // NUM_CONSUMERS, head_dim))
        smem += [plgpu.SMEM((NUM_CONSUMERS * block_kv, block_q), q.dtype, transforms=transforms),
                 plgpu.SMEM((2, NUM_CONSUMERS, rows, cols), jnp.float32,
                            transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))]
        extra_barriers = (plgpu.Barrier(num_arrivals=NUM_CONSUMERS),) * 2
        if config.dq_ordered:  # per staging slot: both consumers' dQ is in it; the store warp has read it
            extra_barriers += (plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=2),
                               plgpu.Barrier(num_arrivals=1, num_barriers=2))
    body = functools.partial(_dkdv_kernel, scale=scale, band=band, kv_len=kv_len, group=q.shape[2] // kv_heads,
                             config=config, interpreting=interpret is not None)

    num_q_blocks = q.shape[1] // block_q
    num_tiles = kv_pad // (NUM_CONSUMERS * block_kv)
    # dq_ordered: a pair's float32 dQ covers its kv head's group of query heads
    launch_group = pairs_per_group(batch * kv_heads, q.shape[1] * q.shape[2] // kv_heads * head_dim * 4)

    def flash_backward_dkdv_sm90(*refs):  # the kernel's name in profiles
        inputs, rest = refs[:6], refs[6:]
        segment_refs, rest = (rest[:3], rest[3:]) if has_segments else ((None, None, None), rest)
        ranks = semaphores = None
        if config.dq_ordered:  # the rank table rides behind the inputs; the counters are global semaphores
            ranks, rest = rest[0], rest[1:]
            semaphores = pl.get_global(plgpu.SemaphoreType.REGULAR((batch * q.shape[2] * num_q_blocks,)))
        dq_acc, outputs = (rest[0], rest[1:]) if config.dq_atomic else (None, rest)

        def run(*scoped):
            if ranks is None:
                return body(*inputs, *segment_refs, dq_acc, *outputs, scoped)
            *scoped, staged, free = scoped
            *cta, active = ordered_cta(batch, kv_heads, num_tiles, launch_group)
            order = _DqOrder(ranks, semaphores, tuple(cta), staged, free)
            pl.when(active)(lambda: body(*inputs, *segment_refs, dq_acc, *outputs, tuple(scoped), dq_order=order))

        pl.run_scoped(
            run,
            tuple(smem),
            (plgpu.Barrier(num_barriers=NUM_CONSUMERS),) * 2,
            (plgpu.Barrier(num_barriers=num_stages),) * 4,
            plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=num_stages),
            _segment_scratch(has_segments, (num_stages, block_q), (NUM_CONSUMERS, block_kv)),
            *extra_barriers,
            collective_axes="wg",
        )

    operands = (q, k, v, d_out, lse2, delta)
    q_ranges = None
    if has_segments:
        q_ranges = segment_block_ranges(kv_ids, q_ids, rows_per_tile=NUM_CONSUMERS * block_kv, cols_per_block=block_q)
        operands += (q_ids, kv_ids, q_ranges)
    out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    grid = dict(grid=(batch, kv_heads, num_tiles),
                grid_names=("batch", "kv_heads", "kv_tiles"), num_threads=NUM_CONSUMERS + 1, thread_name="wg")
    compiler_params = plgpu.CompilerParams(approx_math=True)
    interpreter = {} if interpret is None else dict(interpret=interpret)
    if config.dq_ordered:
        visits = tile_visits(q_ranges, batch=batch, num_tiles=num_tiles, block_q=block_q,
                             tile_keys=NUM_CONSUMERS * block_kv, num_q_blocks=num_q_blocks, kv_pad=kv_pad, band=band)
        grid.update(zip(("grid", "grid_names"), ordered_launch(batch, kv_heads, num_tiles, launch_group)))
        # Each block's first visitor stores its dQ, so the float32 buffer is a plain output (no zero fill: 0.04 of
        # 4.6 ms per fwd+bwd call at the bar's head_dim 64, 8k keys); rows no tile visits stay unwritten: zeroed here.
        dq, dk, dv = plgpu.kernel(flash_backward_dkdv_sm90,
                                  out_type=(jax.ShapeDtypeStruct(q.shape, jnp.float32), *out_type),
                                  compiler_params=compiler_params, **grid)(
            *operands, dq_order_ranks(visits))
        return dk, dv, jnp.where(dq_visited_rows(visits, block_q)[:, :, None, None], dq, 0.0)
    if not config.dq_atomic:
        return plgpu.kernel(flash_backward_dkdv_sm90, out_type=out_type, compiler_params=compiler_params, **grid,
                            **interpreter)(*operands)
    # Free order: the dQ accumulator must start at zero and be written in place: a mutable array handed to the
    # kernel (plgpu.kernel's batching wrapper cannot carry one, so the mesh kernel is called directly). It lives
    # in a run_state, whose outside is pure: `_fold_vmap`'s custom_vmap cannot hold a bare `jax.new_ref` (state
    # discharge has no rule for custom_vmap_call).
    def accumulate(refs):
        dq_acc, dk_ref, dv_ref = refs
        dk_ref[...], dv_ref[...] = pl.kernel(flash_backward_dkdv_sm90, out_type=out_type,
                                             mesh=plgpu.Mesh(**grid), compiler_params=compiler_params,
                                             **interpreter)(*operands, dq_acc)

    dq, dk, dv = pl.run_state(accumulate)((jnp.zeros(q.shape, jnp.float32), jnp.empty(k.shape, k.dtype),
                                           jnp.empty(v.shape, v.dtype)))
    return dk, dv, dq


def _dq(q, k, v, d_out, lse2, delta, q_ids, kv_ids, *, scale: float, band: masks.Band, kv_len: int,
        config: HopperBwdConfig, interpret):
    batch, q_pad, heads, head_dim = q.shape
    block_q, block_kv, num_stages = config.block_q_dq, config.block_kv_dq, config.num_stages_dq
    num_q_tiles = q_pad // (NUM_CONSUMERS * block_q)
    has_segments = q_ids is not None
    transforms = _transforms()

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
        body = functools.partial(_dq_kernel, scale=scale, band=band, kv_len=kv_len, num_q_tiles=num_q_tiles,
                                 group=heads // k.shape[2], config=config, interpreting=interpret is not None)
        pl.run_scoped(
            lambda *scoped: body(*inputs, *segment_refs, dq_ref, scoped),
            smem,
            (plgpu.Barrier(num_barriers=NUM_CONSUMERS),) * 4,
            (plgpu.Barrier(num_barriers=num_stages),) * 2,
            (plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=num_stages),) * 2,
            _segment_scratch(has_segments, (NUM_CONSUMERS, block_q), (num_stages, block_kv)),
            collective_axes="wg",
        )

    operands = (q, k, v, d_out, lse2, delta)
    if has_segments:
        operands += (q_ids, kv_ids, segment_block_ranges(q_ids, kv_ids, rows_per_tile=NUM_CONSUMERS * block_q,
                                                         cols_per_block=block_kv))
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


def _fold_vmap(fn):
    """fn(*args), args arrays or None, with `jax.vmap` folded into the leading (batch) axis of every array
    argument and result: for a kernel whose examples along axis 0 are independent but which cannot be
    batched itself (the one-pass dK/dV kernel writes into a mutable dQ buffer, and Mosaic GPU's kernel
    batching only takes a vmapped axis of size 1). Unbatched arguments are broadcast."""
    def call(*args):
        present = [i for i, x in enumerate(args) if x is not None]

        @jax.custom_batching.custom_vmap
        def folded(*arrays):
            full = list(args)
            for i, x in zip(present, arrays):
                full[i] = x
            return fn(*full)

        @folded.def_vmap
        def _(axis_size, in_batched, *arrays):
            arrays = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                      for x, batched in zip(arrays, in_batched)]
            outs = folded(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in arrays))
            outs = jax.tree.map(lambda y: y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:]), outs)
            return outs, jax.tree.map(lambda _: True, outs)

        return folded(*(args[i] for i in present))

    return call


def check_config(config: HopperBwdConfig, head_dim: int, itemsize: int = 2) -> None:
    """Raises ValueError if the tiles do not fit an H100's shared memory at this (padded) head_dim, or if the
    one-pass kernel cannot split dQ between its consumers (`dq_split`)."""
    if config.dq_atomic and dq_split(head_dim, config.block_q_dkv) is None:
        raise ValueError(f"{config}: the one-pass dq_atomic backward at head_dim {head_dim} needs block_q_dkv >= 128 "
                         f"(each consumer computes dQ for half of a query block), got {config.block_q_dkv}")
    for name, needed in (("dK/dV", config.smem_bytes_dkv(head_dim, itemsize)),
                         ("dQ", config.smem_bytes_dq(head_dim, itemsize))):
        if needed > H100_SHARED_MEMORY:
            raise ValueError(f"{config} needs {needed} bytes of shared memory in the {name} kernel at head_dim "
                             f"{head_dim} (the limit is {H100_SHARED_MEMORY})")


def default_config(head_dim: int, kv_len: int, band: masks.Band, deterministic: bool) -> HopperBwdConfig:
    """`HopperBwdConfig.default` for a call with this (padded) head_dim, key length and band."""
    return HopperBwdConfig.default(head_dim, deterministic, kv_len=kv_len, is_causal=band.is_causal)


@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "local_window_size", "config", "interpret"))
def hopper_backward(q, k, v, out, lse, d_out, d_lse, *, scale: float, is_causal: bool = False,
                    local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
                    config: HopperBwdConfig | None = None, interpret=None):
    """Gradients of attention on Hopper from the forward's residuals.

    q [batch, q_len, heads, head_dim], k/v [batch, kv_len, kv_heads, head_dim] (bf16/fp16), out like q,
    lse [batch, heads, q_len] float32 natural log; cotangents d_out like out and d_lse like lse (or None).
    The band and segment ids as in `hopper_fwd.hopper_forward` (the forward's own).
    Returns (dq, dk, dv) shaped and typed like (q, k, v); dk/dv are summed over each kv head's group.
    `interpret`: None compiles for the GPU; an `InterpretGPUParams` runs the two-pass kernels in the Mosaic
    GPU interpreter on CPU (as `hopper_forward`'s; not config.dq_atomic)."""
    band = masks.Band.of(is_causal, local_window_size)
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"key has {kv_heads} heads; query's {heads} heads must be a multiple of it")
    padded_dim = padded_head_dim(head_dim)
    if padded_dim > MAX_HEAD_DIM:
        raise ValueError(f"the Hopper backward takes head_dim <= {MAX_HEAD_DIM}, got {head_dim}")
    config = config or default_config(padded_dim, kv_len, band, deterministic=True)
    check_config(config, padded_dim, q.dtype.itemsize)
    if config.dq_atomic and interpret is not None:
        raise ValueError("the one-pass dq_atomic backward cannot run in the Mosaic GPU interpreter (JAX 0.10.2 "
                         "has no mutable-array kernel argument nor TMA reduce-add there); use dq_atomic=False")

    # dL/dS = P * (dP - delta); a cotangent on the LSE output adds P * d_lse, i.e. delta -= d_lse.
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    if d_lse is not None:
        delta = delta - d_lse.astype(jnp.float32)
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * LOG2E)

    q_pad = _round_up(q_len, math.lcm(config.block_q_dkv, NUM_CONSUMERS * config.block_q_dq))
    kv_pad = _round_up(kv_len, math.lcm(NUM_CONSUMERS * config.block_kv_dkv, config.block_kv_dq))

    def pad(x, rows):
        return _pad_axis(_pad_axis(x, 1, rows), 3, padded_dim)

    qp, dop = pad(q, q_pad), pad(d_out.astype(q.dtype), q_pad)
    kp, vp = pad(k, kv_pad), pad(v, kv_pad)
    # Padded query rows: lse2 = +inf makes their P exactly 0 in both passes.
    lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, q_pad - q_len)), constant_values=jnp.inf)
    delta = _pad_axis(delta, 2, q_pad)
    ids = masks.pad_segment_ids(q_segment_ids, kv_segment_ids, q_pad, kv_pad)

    common = dict(scale=scale, band=band, kv_len=kv_len, config=config, interpret=interpret)
    if config.dq_atomic:
        dk, dv, dq = _fold_vmap(functools.partial(_dkdv, **common))(qp, kp, vp, dop, lse2, delta, *ids)
        dq = (dq * scale).astype(q.dtype)
    else:
        dk, dv = _dkdv(qp, kp, vp, dop, lse2, delta, *ids, **common)
        dq = _dq(qp, kp, vp, dop, lse2, delta, *ids, **common)
    return dq[:, :q_len, :, :head_dim], dk[:, :kv_len, :, :head_dim], dv[:, :kv_len, :, :head_dim]
