"""Mosaic GPU building blocks the Hopper forward and backward kernels share: head_dim padding, register-layout
ops (with their interpreter stand-ins), the K/V (or Q/dO) shared-memory ring a producer warpgroup fills and
consumers drain, and the per-tile block ranges that let a kernel skip invisible blocks and masks."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import blocks, masks
from pallas_flash._compat import smem_vector_load
from pallas_flash.hopper.config import NUM_CONSUMERS

HEAD_DIM_TILE = 64  # a 128-byte swizzle row of 16-bit elements: the wgmma contraction granule
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def padded_head_dim(head_dim: int) -> int:
    """head_dim as the kernel runs it: a multiple of the 64-element swizzle tile."""
    return round_up(head_dim, HEAD_DIM_TILE)


def register_ops(interpreting: bool):
    """(iota, zeros, load): int32 iota and float32 zeros in the wgmma register layout, and a shared-memory
    vector read into a given layout; without layouts when `interpreting` (the Mosaic GPU interpreter has no
    CPU rule for them). Shared by the forward and the backward kernels."""
    if interpreting:
        return (
            lambda shape, axis: lax.broadcasted_iota(jnp.int32, shape, axis),
            lambda shape: jnp.zeros(shape, jnp.float32),
            lambda ref, layout: ref[...],
        )
    return (
        lambda shape, axis: plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA),
        lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA),
        smem_vector_load,
    )


def dot_t(x, y):
    """x y^T in float32 (x [m, k], y [n, k]): the interpreter's stand-in for a wgmma on a transposed ref."""
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def query_tile_schedule(
    num_q_tiles: int,
    *,
    block_q: int,
    block_kv: int,
    num_kv_blocks: int,
    kv_len: int,
    band: masks.Band,
    segment_ranges=None,
    tile=None,
    batch=None,
):
    """The first query row of this CTA's tile of NUM_CONSUMERS * block_q rows (grid axis "q_tiles"), and the
    key blocks [lo, hi) it visits: those its rows' band reaches, narrowed to the tile's `segment_ranges`
    entry (None, or the ref of `segment_block_ranges`), never none (a tile that sees no key still visits
    one block, fully masked, so every loop and barrier keeps one shape), and the tile's same-segment run of
    blocks (None without segment ids; see `unmasked_blocks`). With a causal band (right edge only) the tiles
    run in reverse: the last ones visit the most key blocks, so they launch first. Shared by the forward and
    the dQ kernel. `tile`, `batch`: the tile's indices (default: this CTA's "q_tiles" and "batch")."""
    tile = lax.axis_index("q_tiles") if tile is None else tile
    if band.right is not None and band.left is None:
        tile = num_q_tiles - 1 - tile
    lo, _, _, hi = blocks.kv_block_range(
        tile,
        block_q=NUM_CONSUMERS * block_q,
        block_kv=block_kv,
        num_kv_blocks=num_kv_blocks,
        kv_len=kv_len,
        band=band,
        always_mask=segment_ranges is not None,
    )
    same = None
    if segment_ranges is not None:
        batch = lax.axis_index("batch") if batch is None else batch
        lo = jnp.maximum(lo, segment_ranges[batch, tile, 0])
        hi = jnp.minimum(hi, segment_ranges[batch, tile, 1])
        same = (segment_ranges[batch, tile, 2], segment_ranges[batch, tile, 3])
    lo = jnp.minimum(lo, num_kv_blocks - 1)
    return tile * (NUM_CONSUMERS * block_q), lo, jnp.maximum(hi, lo + 1), same


def tile_visible(q_pos, k_pos, *, band: masks.Band, kv_len, q_seg, kv_seg, shape, q_axis: int):
    """A tile's visibility (`masks.visible`; None: all visible). q_seg/kv_seg: None, or the segment-id vectors
    of the tile's queries and keys, broadcast here along its query axis `q_axis` and the other axis. Shared
    by the forward (query-major tiles) and the backward kernels (dK/dV's are key-major)."""
    ids = {}
    if q_seg is not None:
        ids = dict(
            q_segment=lax.broadcast_in_dim(q_seg, shape, [q_axis]),
            kv_segment=lax.broadcast_in_dim(kv_seg, shape, [1 - q_axis]),
        )
    return masks.visible(q_pos, k_pos, band=band, kv_len=kv_len, **ids)


def load_own_ids(ids_ref, smem, ready, *, wg, batch, start, size: int, layout, load=smem_vector_load):
    """Consumer warpgroup `wg`'s resident segment ids, ids_ref[batch, start:start + size]: TMA into its slot
    of `smem`, then into registers in `layout` (`load` reads a shared-memory vector)."""
    plgpu.copy_gmem_to_smem(ids_ref.at[batch, pl.ds(start, size)], smem.at[wg], ready.at[wg])
    plgpu.barrier_wait(ready.at[wg])
    return load(smem.at[wg], layout)


def unmasked_blocks(band_range, visited, same=None):
    """The blocks a consumer visits without the mask: its band's unmasked blocks (`band_range`, the middle
    two of `blocks.kv_block_range`/`q_block_range`), within the blocks its CTA visits (`visited` = (lo, hi)),
    and with segment ids within the tile's same-segment run (`same`, from `segment_block_ranges`). Returns
    (first, end): the visit order is masked [lo, first), unmasked [first, end), masked [end, hi)."""
    first, end = band_range
    lo, hi = visited
    if same is not None:
        first, end = jnp.maximum(first, same[0]), jnp.minimum(end, same[1])
    first = jnp.clip(first, lo, hi)
    return first, jnp.clip(end, first, hi)


def masked_edge_loops(step, carry, lo, first, end, hi):
    """`step(i, carry, masked=...)` over blocks [lo, hi) in `unmasked_blocks`' order: the masked leading edge
    [lo, first), the unmasked middle [first, end), the masked trailing edge [end, hi). `lo` or `hi` None: that
    edge is known to be empty, so no code is traced for it (an edge that may hold blocks is a loop even for
    one block: the step index must be a traced value)."""
    if lo is not None:
        carry = lax.fori_loop(lo, first, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(first, end, functools.partial(step, masked=False), carry)
    if hi is not None:
        carry = lax.fori_loop(end, hi, functools.partial(step, masked=True), carry)
    return carry


def segment_block_ranges(row_ids, col_ids, *, rows_per_tile: int, cols_per_block: int):
    """Per tile of `rows_per_tile` rows, int32 [batch, num_tiles, 4]: the column blocks [lo, hi) that may
    hold one of its segment ids (lo = hi = 0 where none can), and [same_lo, same_hi), a run of blocks whose
    ids all equal the tile's single id (empty unless the tile has one id and no padding): those need no
    segment mask. row_ids [batch, rows] and col_ids [batch, cols] are padded ids (`pad_segment_ids`). A tile
    and a block may share an id only if their [min, max] id intervals overlap (padding ids left out), so
    [lo, hi) is exact for sorted ids (packed sequences, lengths) and conservative for any others."""
    valid_from = masks.KEY_PADDING_ID + 1  # both padding ids are below this

    def intervals(ids, size):
        ids = ids.reshape(ids.shape[0], -1, size)
        valid = ids >= valid_from
        big = jnp.iinfo(jnp.int32).max
        low, high = jnp.where(valid, ids, big).min(axis=2), jnp.where(valid, ids, -big).max(axis=2)
        return low, high, jnp.logical_and(valid.all(axis=2), low == high)  # ..., one id and no padding

    row_lo, row_hi, row_single = intervals(row_ids, rows_per_tile)
    col_lo, col_hi, col_single = intervals(col_ids, cols_per_block)
    overlap = (row_lo[:, :, None] <= col_hi[:, None, :]) & (col_lo[:, None, :] <= row_hi[:, :, None])
    same = row_single[:, :, None] & col_single[:, None, :] & (row_lo[:, :, None] == col_lo[:, None, :])
    blocks = jnp.arange(overlap.shape[2])

    def first(flags, default):
        return jnp.where(flags.any(axis=2), jnp.argmax(flags, axis=2), default)

    lo = first(overlap, 0)
    hi = jnp.where(overlap.any(axis=2), overlap.shape[2] - jnp.argmax(overlap[:, :, ::-1], axis=2), 0)
    same_lo = first(same, 0)
    # The run of same-segment blocks from same_lo ends at the next block that is not one (ids need not be
    # sorted, so there may be more such blocks after it: they are masked, which is still exact).
    after_run = (blocks >= same_lo[:, :, None]) & ~same
    same_hi = jnp.where(same.any(axis=2), first(after_run, overlap.shape[2]), 0)
    return jnp.stack([lo, hi, same_lo, same_hi], axis=2).astype(jnp.int32)


def stream_kv_blocks(
    gmem, smem, ready, free, *, batch, kv_head, block_kv: int, num_stages: int, kv_lo, kv_hi, kv_ids=None, done=0
):
    """The producer warpgroup's loop (this forward's and the dQ kernel's): TMA key/value blocks kv_lo ..
    kv_hi-1 of (batch, kv_head) into a `num_stages` shared-memory ring. `gmem`, `smem`, `ready`, `free` are
    (key, value) pairs of refs and barriers; slot s is refilled once the consumers arrive on its "free"
    barrier. K of step i + num_stages may land once both consumers finished Q K^T of step i, before they
    finish its P V: K and V have separate "free" barriers. `kv_ids`: None, or (ids ref [batch, kv_pad],
    ring [num_stages, block_kv], ready barriers): the block's segment ids, loaded with K (and released
    with it). `done`: blocks already streamed through the ring (by earlier tiles of a persistent CTA)."""

    def load(step, slot, wait_free: bool):
        keys = pl.ds((kv_lo + step) * block_kv, block_kv)
        for i, (ref, ring, is_ready, is_free) in enumerate(zip(gmem, smem, ready, free)):
            if wait_free:
                plgpu.barrier_wait(is_free.at[slot])
            plgpu.copy_gmem_to_smem(ref.at[batch, keys, kv_head], ring.at[slot], is_ready.at[slot])
            if i == 0 and kv_ids is not None:
                ids_ref, ids_ring, ids_ready = kv_ids
                plgpu.copy_gmem_to_smem(ids_ref.at[batch, keys], ids_ring.at[slot], ids_ready.at[slot])

    fill_ring(load, num_stages=num_stages, steps=kv_hi - kv_lo, done=done)


def fill_ring(load, *, num_stages: int, steps, done=0):
    """A producer's loop over a `num_stages` shared-memory ring: `load(step, slot, wait_free)` for steps
    0 .. steps-1 into slot (done + step) % num_stages, where `done` steps went through the ring before; the
    ring's first `num_stages` steps fill empty slots, each later one waits in `load` for the consumers to
    free its slot (wait_free=True)."""
    filling = jnp.clip(num_stages - done, 0, steps)

    @pl.loop(0, filling)
    def _fill(step):
        load(step, lax.rem(done + step, num_stages), wait_free=False)

    @pl.loop(filling, steps)
    def _stream(step):
        load(step, lax.rem(done + step, num_stages), wait_free=True)


def drain_ring(free, *, num_stages: int, steps):
    """A producer's wait, on each of the ring's "free" barrier arrays `free`, for the consumers to free the
    slots of the ring's last `num_stages` of `steps` steps. The Mosaic GPU interpreter requires every thread
    to observe every phase of a barrier it waits on; on the GPU the kernel ends without it."""

    @pl.loop(jnp.maximum(steps - num_stages, 0), steps)
    def _drain(step):
        for barriers in free:
            plgpu.barrier_wait(barriers.at[lax.rem(step, num_stages)])


# setmaxnreg budgets (consumer, producer) of every backward kernel: FA3's 240/24 rather than the forward's 232/40,
# as the consumers hold dK and dV (or dQ) through the step plus the one pass's dQ operands or the pipelined
# kernels' previous dS; measured 2.5-9% faster than 232/40 on the H100 (docs/performance.md).
REGISTERS = (240, 24)


def swizzle_transforms():
    # 128-byte swizzle over (8, 64)-element tiles: the layout wgmma reads without bank conflicts.
    return (plgpu.TilingTransform((8, HEAD_DIM_TILE)), plgpu.SwizzleTransform(128))


def step_block(step, *, q_lo, q_steps):
    """(query head within the kv head's group, query block) of a dK/dV CTA's step: the CTA visits query blocks
    [q_lo, q_lo + q_steps) of each query head of its group in turn (`q_steps` may be 0)."""
    per_head = jnp.maximum(q_steps, 1)
    return lax.div(step, per_head), q_lo + lax.rem(step, per_head)


def segment_scratch(has_segments: bool, q_ids_shape, kv_ids_shape):
    """Shared memory and barriers for segment ids: (query ids, key ids, their "ready" barriers), or None.
    Shapes are (slots, length); one barrier per slot."""
    if not has_segments:
        return None
    return (
        plgpu.SMEM(q_ids_shape, jnp.int32),
        plgpu.SMEM(kv_ids_shape, jnp.int32),
        plgpu.Barrier(num_barriers=q_ids_shape[0]),
        plgpu.Barrier(num_barriers=kv_ids_shape[0]),
    )


def wgmma_operand(ref):
    """ref[...] in the interpreter's stand-ins for wgmma (`interpreting`), which read shared-memory operands."""
    value = ref[...]
    # wgmma reads via the async proxy; JAX 0.12's interpreter orders a TMA refill after a generic read only if committed
    plgpu.commit_smem()
    return value
