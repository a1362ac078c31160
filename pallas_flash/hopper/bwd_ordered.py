"""The one-pass backward's dQ: how its dS K product is split between the consumers, and the deterministic
order of its float32 adds (`HopperBwdConfig.dq_ordered`): which query blocks a key tile visits, each visit's
rank among the key tiles adding to the same block (a global semaphore per block counts them), and a launch
order (descending key tiles, L2-sized groups of (batch, kv head) pairs) in which every wait is deadlock-free."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import _compat, blocks, masks
from pallas_flash.hopper.common import HEAD_DIM_TILE, step_block
from pallas_flash.hopper.config import NUM_CONSUMERS


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


def dq_share(head_dim: int, block_q: int, wg):
    """Warpgroup wg's dQ rows and columns within a query block (`dq_split`)."""
    if dq_split(head_dim, block_q) == "columns":
        return pl.ds(0, block_q), pl.ds(wg * (head_dim // NUM_CONSUMERS), head_dim // NUM_CONSUMERS)
    return pl.ds(wg * (block_q // NUM_CONSUMERS), block_q // NUM_CONSUMERS), pl.ds(0, head_dim)


def split_dq_product(ds_t_smem, k_smem, wg):
    """Warpgroup wg's share of dQ = (dS^T)^T K (`dq_split`): (its columns of the shared dS^T tile, its columns
    of the shared K tile, its dQ rows and columns within the query block)."""
    (_, block_q), head_dim = ds_t_smem.shape, k_smem.shape[-1]
    rows, cols = dq_share(head_dim, block_q, wg)
    if dq_split(head_dim, block_q) == "columns":
        return ds_t_smem, k_smem.at[:, cols], rows, cols
    return ds_t_smem.at[:, rows], k_smem, rows, cols


def visited_q_blocks(
    kv_tile, read_range, *, block_q: int, tile_keys: int, num_q_blocks: int, kv_pad: int, band: masks.Band
):
    """(lo, hi, same): the query blocks [lo, hi) that the dK/dV CTA of key tile `kv_tile` (`tile_keys` keys)
    visits per query head: those its keys' band reaches, intersected with its segment ids' blocks; `same` the
    run of blocks in the tile's one segment (None without ids). `read_range(i)`: entry i of the tile's row of
    `segment_block_ranges`, or None without segment ids. Elementwise: the kernel calls it on its scalars,
    `tile_visits` on every tile at once."""
    q_lo, _, _, q_hi = blocks.q_block_range(
        kv_tile,
        block_q=block_q,
        block_kv=tile_keys,
        num_q_blocks=num_q_blocks,
        kv_len=kv_pad,
        band=band,
        always_mask=True,
    )
    if read_range is None:
        return q_lo, q_hi, None
    q_lo = jnp.maximum(q_lo, read_range(0))
    q_hi = jnp.maximum(jnp.minimum(q_hi, read_range(1)), q_lo)
    return q_lo, q_hi, (read_range(2), read_range(3))


def tile_visits(
    q_ranges,
    *,
    batch: int,
    num_tiles: int,
    block_q: int,
    tile_keys: int,
    num_q_blocks: int,
    kv_pad: int,
    band: masks.Band,
):
    """int32 [batch, num_tiles, num_q_blocks]: 1 where key tile t of example b visits query block j
    (`visited_q_blocks`, the kernel's own rule; the same for every query head)."""
    read = None if q_ranges is None else (lambda i: q_ranges[:, :, i])
    lo, hi, _ = visited_q_blocks(
        jnp.arange(num_tiles, dtype=jnp.int32)[None, :],
        read,
        block_q=block_q,
        tile_keys=tile_keys,
        num_q_blocks=num_q_blocks,
        kv_pad=kv_pad,
        band=band,
    )
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
# MAX_PAIRS_PER_GROUP pairs (a wave then holds ~132 / 32 tiles per pair). On the H100 (head_dim 64,
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


class DqOrder(NamedTuple):
    """What the dq_ordered dK/dV kernel needs beyond the one-pass kernel's: `dq_order_ranks`' int32 table in
    global memory; a global int32 semaphore per (batch, query head, query block), flattened, zero at launch;
    the CTA's (batch, kv head, key tile) (`ordered_cta`); per dQ staging slot a barrier that both consumers'
    dQ is in it (`staged`) and one that the store warp has read it out (`free`)."""

    ranks: object
    semaphores: object
    cta: tuple
    staged: object
    free: object


def store_dq_in_order(
    order: DqOrder, staging, dq_acc_ref, *, batch, kv_head, kv_tile, group: int, q_lo, q_steps, block_q: int
):
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
            rows, cols = dq_share(head_dim, block_q, wg)
            q_rows = pl.ds(q_block * block_q + rows.start, rows.size)
            share, block = staging.at[slot, wg], dq_acc_ref.at[batch, q_rows, kv_head * group + g, cols]
            # The block's first visitor stores (the buffer starts unwritten), the later ones add.
            plgpu.copy_smem_to_gmem(share, block, rank == 0, commit_group=False)
            plgpu.copy_smem_to_gmem(share, block, rank > 0, reduction_op="add", commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)
        plgpu.barrier_arrive(order.free.at[slot])
        _compat.semaphore_signal_gpu(semaphore)
