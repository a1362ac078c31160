"""Mosaic GPU building blocks the Hopper forward and backward kernels share: head_dim padding, register-layout
ops (with their interpreter stand-ins), the K/V (or Q/dO) shared-memory ring a producer warpgroup fills and
consumers drain, and the per-tile block ranges that let a kernel skip invisible blocks and masks."""

from __future__ import annotations

import dataclasses
import functools
import typing

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import block_sparse, blocks, masks
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
    """head_dim padded to a multiple of the 64-element (128-byte) swizzle tile."""
    return round_up(head_dim, HEAD_DIM_TILE)


def forward_head_dim(head_dim: int) -> int:
    """head_dim as the forward runs it: a multiple of 32 (96 and 160 run as they are, on 64-byte swizzled tiles;
    80 runs at 96), so a head size between multiples of 64 pays for no more than 31 padded columns."""
    return round_up(head_dim, HEAD_DIM_TILE // 2)


def head_dim_transforms(head_dim: int, itemsize: int = 2, split: bool = False):
    """Shared-memory transforms of a [rows, head_dim] tile for wgmma: (8, S)-element tiles under an S-element
    swizzle, S the widest of 128 and 64 bytes that divides a row (128: no bank conflicts on any read), or with
    `split` half a row (`HopperBwdConfig.split_columns`: each consumer's columns are whole swizzle tiles)."""
    row = head_dim // NUM_CONSUMERS if split else head_dim
    swizzle = 128 if row * itemsize % 128 == 0 else 64
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


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


def column_half(tile, wg):
    """Consumer `wg`'s half of the columns of a [rows, head_dim] shared-memory tile (`HopperBwdConfig.split_columns`;
    whole swizzle tiles under `head_dim_transforms(..., split=True)`): a `pl.ds`."""
    half = tile.shape[-1] // NUM_CONSUMERS
    return pl.ds(wg * half, half)


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
    tile_rows: int | None = None,
):
    """The first query row of this CTA's tile of `tile_rows` rows (default NUM_CONSUMERS * block_q, a block per
    consumer; grid axis "q_tiles"), and the key blocks [lo, hi) it visits: those its rows' band reaches, narrowed to the
    tile's `segment_ranges` entry (None, or the ref of `segment_block_ranges`), never none (a tile that sees no key
    still visits one block, fully masked, so every loop and barrier keeps one shape), and the tile's same-segment run of
    blocks (None without segment ids; see `unmasked_blocks`). With a causal band (right edge only) the tiles run in
    reverse: the last ones visit the most key blocks, so they launch first. Shared by the forward and the dQ kernel.
    `tile`, `batch`: the tile's indices (default: this CTA's "q_tiles" and "batch")."""
    tile = lax.axis_index("q_tiles") if tile is None else tile
    tile_rows = tile_rows or NUM_CONSUMERS * block_q
    if band.right is not None and band.left is None:
        tile = num_q_tiles - 1 - tile
    lo, _, _, hi = blocks.kv_block_range(
        tile,
        block_q=tile_rows,
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
    return tile * tile_rows, lo, jnp.maximum(hi, lo + 1), same


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
    gmem,
    smem,
    ready,
    free,
    *,
    batch,
    kv_head,
    block_kv: int,
    num_stages: int,
    kv_lo,
    kv_hi,
    kv_ids=None,
    riders=(),
    done=0,
    gap=None,
):
    """The producer warpgroup's loop (this forward's and the dQ kernel's): TMA the key/value blocks of steps
    kv_lo .. kv_hi-1 (`gap`: None, or the `Gap` those steps skip) of (batch, kv_head) into a `num_stages`
    shared-memory ring. `gmem`, `smem`, `ready`, `free` are
    (key, value) pairs of refs and barriers; slot s is refilled once the consumers arrive on its "free"
    barrier. K of step i + num_stages may land once both consumers finished Q K^T of step i, before they
    finish its P V: K and V have separate "free" barriers. `kv_ids`: None, or (ids ref [batch, kv_pad],
    ring [num_stages, block_kv], ready barriers): the block's segment ids, loaded with K (and released
    with it). `riders`: more per-key values loaded with K, each (source, ring, ready barriers) where
    `source(keys)` is the gmem ref of the block's keys (a score or mask program's column values, `fwd.py`).
    `done`: blocks already streamed through the ring (by earlier tiles of a persistent CTA)."""

    def load(step, slot, wait_free: bool):
        keys = pl.ds(block_of(gap, kv_lo + step) * block_kv, block_kv)
        for i, (ref, ring, is_ready, is_free) in enumerate(zip(gmem, smem, ready, free)):
            if wait_free:
                plgpu.barrier_wait(is_free.at[slot])
            plgpu.copy_gmem_to_smem(ref.at[batch, keys, kv_head], ring.at[slot], is_ready.at[slot])
            if i == 0 and kv_ids is not None:
                ids_ref, ids_ring, ids_ready = kv_ids
                plgpu.copy_gmem_to_smem(ids_ref.at[batch, keys], ids_ring.at[slot], ids_ready.at[slot])
            for source, ring, is_loaded in riders if i == 0 else ():
                plgpu.copy_gmem_to_smem(source(keys), ring.at[slot], is_loaded.at[slot])

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


def product_t(lhs, rhs, *, interpreting: bool):
    """lhs rhs^T in float32 of [m, D] and [n, D] shared-memory tiles, waited for (a plain dot in the
    interpreter)."""
    if interpreting:
        return dot_t(wgmma_operand(lhs), wgmma_operand(rhs))

    def product(ref):
        plgpu.wgmma(ref, lhs, rhs.transpose((1, 0)))
        return ref[...]

    return pl.run_scoped(product, plgpu.ACC((lhs.shape[0], rhs.shape[0]), jnp.float32))


def add_product(acc, lhs, rhs, *, interpreting: bool):
    """acc + lhs rhs in float32, of shared-memory tiles (a plain dot in the interpreter)."""
    if interpreting:
        return acc + jnp.dot(wgmma_operand(lhs), wgmma_operand(rhs), preferred_element_type=jnp.float32)
    return pl.run_state(lambda ref: plgpu.wgmma(ref, lhs, rhs))(plgpu.ACC.init(acc))


def serves_split_products(mod_operands, dense_arrays, dropout, programs, dense: DenseMods) -> bool:
    """Whether a backward pass's call is one its split products serve (`HopperBwdConfig.dq_split_products`,
    `dkv_split_products`): no score or mask program, dense tiles or dropout, whose operands they leave no room
    for."""
    plain = all(x is None for x in (*mod_operands, *dense_arrays, dropout, programs.score, programs.mask))
    return plain and not (dense.active or dense.forms_logits)


def hand_over(ref, value, *, ready, free, reuse):
    """`value` into the shared tile `ref` for the other consumer: once its readers of the last step are done
    (`free`, waited where `reuse`: from the second step on), stored, fenced for the wgmmas, `ready` arrived."""
    pl.when(reuse)(functools.partial(plgpu.barrier_wait, free))
    ref[...] = value
    plgpu.commit_smem()
    plgpu.barrier_arrive(ready)


def drain_last_phases(steps, wg, waits):
    """After a loop of `steps` steps whose consumers waited each phase of a "free" barrier at the next step: the
    last phase of `waits[i]`, waited by consumer i (none where the loop ran no step)."""

    @pl.when(steps > 0)
    def _():
        for i, barrier in enumerate(waits):
            pl.when(wg == i)(functools.partial(plgpu.barrier_wait, barrier))


# The options `hopper_forward` and `hopper_backward` take as static: the call's, so that both trace once per them.
KERNEL_STATIC_ARGNAMES = (
    "scale",
    "is_causal",
    "local_window_size",
    "config",
    "score_mod",
    "mask_mod",
    "dropout_rate",
    "broadcast_dropout",
    "logits_soft_cap",
    "block_mask",
    "interpret",
)


# ---- a dense bias and mask (arrays over both queries and keys) in the kernels ---------------------------------


@dataclasses.dataclass(frozen=True)
class DenseMods:
    """A kernel's dense bias and mask: arrays [Bd, Hd, rows, cols] (Bd batch or 1, Hd query heads or 1: broadcast
    dims are read at index 0) whose tiles ride a ring beside the streamed blocks and are read on every visited
    block (none is skipped for them). bias: one is added to the logits in float32, natural-log units, after the
    soft cap; mask: one (int8, 0 hides the key) is applied with the other masks; soft_cap: the logit soft cap,
    applied by the kernel itself since it precedes the bias (without a bias the API folds it into the score
    program instead). A mask's tile is read only on masked blocks: the kernels narrow their blocks to its block
    ranges (`sparse_classes`), whose wholly visible run needs none. hide_outside_hull: a `BlockMask` is served by
    those ranges alone (`block_sparse.exact_by_ranges`): masked blocks outside the ranges' hull are hidden
    (`outside_hull_hidden`). bias_grad: the backward's dQ pass writes dS for the bias's gradient (a float32
    [batch, heads, q, kv] buffer); off where the bias is a constant of the differentiated function."""

    bias: bool = False
    mask: bool = False
    soft_cap: float | None = None
    hide_outside_hull: bool = False
    bias_grad: bool = True

    @property
    def active(self) -> bool:
        return self.bias or self.mask

    @property
    def writes_dbias(self) -> bool:
        return self.bias and self.bias_grad

    @property
    def forms_logits(self) -> bool:
        """Whether the kernel forms the logits (`biased_logits`) before any score program: the program then sees
        them at scale 1."""
        return self.bias or self.soft_cap is not None

    @property
    def count(self) -> int:
        """How many dense arrays ride the ring."""
        return int(self.bias) + int(self.mask)


def dense_operands(bias, mask, rows: int, cols: int, *, transpose: bool = False):
    """The kernels' dense arrays from a call's (bias float [Bd, Hd, q_len, kv_len] in its own dtype, mask bool
    like it; each None where absent), padded in XLA to [Bd, Hd, rows, cols] (the mask as int8, padding hidden),
    with `transpose` as [Bd, Hd, cols, rows] (the dK/dV kernel's key-major tiles)."""

    def prepare(x, dtype):
        if x is None:
            return None
        x = pad_axis(pad_axis(x.astype(dtype), 2, rows), 3, cols)
        return jnp.swapaxes(x, 2, 3) if transpose else x

    return prepare(bias, None if bias is None else bias.dtype), prepare(mask, jnp.int8)


def dense_ring(arrays, num_stages: int, rows: int, cols: int):
    """Shared memory for the dense tiles of `arrays` (each None or a [Bd, Hd, ..] array, `dense_operands`): None
    without any, else per array None or (its ring [num_stages, rows, cols], a "ready" barrier per slot). A tile
    sits in 8-row tiles with the widest swizzle its rows fill (<= 128 bytes): the layout that a load into the
    WGMMA register layout reads without bank conflicts (JAX 0.10 finds no such load for an unswizzled tile)."""
    if all(x is None for x in arrays):
        return None

    def ring(x):
        if x is None:
            return None
        swizzle = min(128, cols * x.dtype.itemsize)
        transforms = (plgpu.TilingTransform((8, swizzle // x.dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
        return plgpu.SMEM((num_stages, rows, cols), x.dtype, transforms=transforms), plgpu.Barrier(
            num_barriers=num_stages
        )

    return tuple(ring(x) for x in arrays)


def dense_riders(refs, ring, *, batch, head, rows):
    """`stream_kv_blocks` riders of the dense arrays `refs` (gmem refs or None) into `ring` (`dense_ring`): the
    tile of query rows `rows` (a `pl.ds`) and each streamed block's keys, of (batch, head)."""
    if ring is None:
        return ()
    riders = []
    for ref, slots in zip(refs, ring):
        if ref is not None:
            b, h = stack_index(ref, batch, head)
            riders.append(((lambda keys, ref=ref, b=b, h=h: ref.at[b, h, rows, keys]), *slots))
    return tuple(riders)


def dense_tiles(ring, slot, *, wg, rows: int, load, read_mask: bool = True):
    """(bias tile or None, bool visibility tile or None): consumer `wg`'s `rows` rows of ring slot `slot`
    (`dense_ring`), waited for (every step waits: one wait per phase) and read into the WGMMA register layout by
    `load(ref, layout)`; the bias in its own dtype. `read_mask` False: the mask tile is waited for but not read
    (None), for a block in the run its block ranges (`sparse_ranges`) know to be wholly visible."""
    if ring is None:
        return None, None
    rows = pl.ds(wg * rows, rows)
    tiles = []
    for i, slots in enumerate(ring):
        if slots is None:
            tiles.append(None)
            continue
        smem, ready = slots
        plgpu.barrier_wait(ready.at[slot])
        tiles.append(load(smem.at[slot, rows], plgpu.Layout.WGMMA) if read_mask or i == 0 else None)
    # The slot's next TMA (async proxy) overwrites what these generic reads read: fence them before the slot is
    # released (JAX 0.12's interpreter flags the refill as a race without it).
    plgpu.commit_smem()
    bias, mask = tiles
    return bias, None if mask is None else mask != 0


def biased_logits(s, bias, *, scale: float, soft_cap: float | None):
    """Raw logits s (a float32 tile) -> (x, cap_grad): x = scale * s, soft-capped (`masks.soft_cap`, the divide
    as a multiply: the kernels' division is a precise, slow one), plus the bias tile (None: no bias), in
    natural-log units; cap_grad(d) takes a cotangent of x back to one of scale * s (None without a soft cap)."""
    x = s * scale
    cap_grad = None
    if soft_cap is not None:
        t = jnp.tanh(x * np.float32(1.0 / soft_cap))
        x = t * np.float32(soft_cap)

        def cap_grad(d):
            return d * (1.0 - t * t)

    if bias is not None:
        x = x + bias.astype(jnp.float32)
    return x, cap_grad


# ---- score_mod and mask_mod programs (`mods.Staged`) in the kernels --------------------------------------------


def pack_mod_stacks(stacks, length: int):
    """One int32 stack [Bd, Hd, n, length] of one side's staged values (rows or columns) of several programs, so
    that a kernel loads them with one copy and one barrier: `stacks` are that side's (int, float) stacks of each
    program (`Staged.stacks`, None where empty), broadcast to a common [Bd, Hd], floats bitcast to int32,
    positions zero-padded to `length`. Returns (packed or None, offsets): offsets[i] is the first index of
    stacks[i]'s values in the packed stack (`mod_values` reads them back)."""
    present = [s for s in stacks if s is not None]
    offsets, at = [], 0
    for s in stacks:
        offsets.append(at)
        at += 0 if s is None else s.shape[2]
    if not present:
        return None, tuple(offsets)
    lead = (max(s.shape[0] for s in present), max(s.shape[1] for s in present))
    parts = [
        jnp.broadcast_to(s if s.dtype == jnp.int32 else lax.bitcast_convert_type(s, jnp.int32), lead + s.shape[2:])
        for s in present
    ]
    return pad_axis(jnp.concatenate(parts, axis=2), 3, length), tuple(offsets)


def mod_values(staged, side: str, offsets, read):
    """A program's staged values on one side as `Staged.joint` takes them: (ints, floats), lists of what
    `read(index)` returns for each of its entries in the packed stack (`pack_mod_stacks`; `offsets` the
    (int, float) offsets of this program's stacks there), floats bitcast back from int32."""
    ints = [read(offsets[0] + i) for i in range(len(staged.group(side, "int")))]
    floats = [read(offsets[1] + i) for i in range(len(staged.group(side, "float")))]
    return ints, [lax.bitcast_convert_type(x, jnp.float32) for x in floats]


def stack_index(stack, batch, head):
    """The [batch, head] index of a stack whose leading dims may be 1 (broadcast): 0 there."""
    return (batch if stack.shape[0] > 1 else 0), (head if stack.shape[1] > 1 else 0)


def mask_block_ranges(anything, everything):
    """Per row tile, from a mask program's block classes (`mods.block_classes` at the kernel's tiles: bool
    [..., num_tiles, num_blocks], some / every position visible), int32 [..., num_tiles, RANGE_FIELDS]: the blocks
    [lo, hi) from the first to the last one with anything visible (lo = hi = 0 where none), the longest run
    [full_lo, full_hi) of wholly visible blocks: those need no mask, and the longest run [gap_lo, gap_hi) of
    blocks with nothing visible inside [lo, hi) (empty: 0, 0), which the kernels skip (`Gap`). Other blocks inside
    [lo, hi) with nothing visible are still visited, masked."""
    n = anything.shape[-1]
    full = everything & anything  # a tile past q_len has nothing valid: it is not "full"
    index = jnp.arange(n, dtype=jnp.int32)

    def first(flags, default):
        return jnp.where(flags.any(axis=-1), jnp.argmax(flags, axis=-1), default)

    lo = first(anything, 0)
    hi = jnp.where(anything.any(axis=-1), n - jnp.argmax(anything[..., ::-1], axis=-1), 0)

    def longest_run(flags):
        """(start, end) of the longest run of True in `flags` (the first of equals; 0, 0 where none): the run
        ending at block j starts after the last False before it."""
        last_false = lax.cummax(jnp.where(flags, -1, index), axis=flags.ndim - 1)
        length = jnp.where(flags, index - last_false, 0)
        end = jnp.where(length.max(axis=-1) > 0, jnp.argmax(length, axis=-1) + 1, 0)
        return end - length.max(axis=-1), end

    full_lo, full_hi = longest_run(full)
    # Inside [lo, hi) every empty run has visible blocks on both sides.
    gap_lo, gap_hi = longest_run(~anything & (index > lo[..., None]) & (index < hi[..., None]))
    return jnp.stack([lo, hi, full_lo, full_hi, gap_lo, gap_hi], axis=-1).astype(jnp.int32)


RANGE_FIELDS = 6  # lo, hi, full_lo, full_hi, gap_lo, gap_hi (`mask_block_ranges`)


class Gap(typing.NamedTuple):
    """Blocks [start, start + length) inside a tile's visited range [lo, hi) that hold nothing visible: the tile's
    loops run over steps lo .. hi - length, step t visiting block `block(t)`, so the blocks are never loaded.
    Length 0: none. Key blocks of a query tile (the forward, the dQ pass: `narrow_to_mask_ranges`), or query blocks
    of a key tile in the dK/dV pass where the mask program ORs in global queries (`clip_gap`; elsewhere the remap
    spills in that pass's loop)."""

    start: typing.Any
    length: typing.Any

    def block(self, step):
        """The block that step `step` visits."""
        return step + jnp.where(step >= self.start, self.length, 0)

    def step(self, block):
        """The step that visits `block`, or for a block inside the gap the step after it (a range's bound)."""
        return jnp.where(block >= self.start + self.length, block - self.length, jnp.minimum(block, self.start))


def block_of(gap: Gap | None, step):
    """The block a tile's step visits (`Gap.block`; no gap: the step is the block)."""
    return step if gap is None else gap.block(step)


def step_of(gap: Gap | None, block):
    """The step that visits `block` (`Gap.step`; no gap: the block is the step)."""
    return block if gap is None else gap.step(block)


def narrow_to_mask_ranges(lo, hi, same, ranges, *, batch, head, tile, num_kv_blocks: int):
    """A tile's key blocks [lo, hi) and unmasked run `same` (None or (first, end); from
    `query_tile_schedule`) narrowed to its entry of a mask program's `mask_block_ranges` (a gmem ref
    [Bd, Hd, num_tiles, RANGE_FIELDS], read as scalars), keeping `query_tile_schedule`'s rule that a tile visits at
    least one block (fully masked if it sees nothing). Returns (lo, hi, same, gap): the entry's `Gap` clipped to
    the narrowed range, where a gap that reaches an edge of it narrows the range instead."""
    b, h = stack_index(ranges, batch, head)
    lo = jnp.minimum(jnp.maximum(lo, ranges[b, h, tile, 0]), num_kv_blocks - 1)
    hi = jnp.maximum(jnp.minimum(hi, ranges[b, h, tile, 1]), lo + 1)
    full = (ranges[b, h, tile, 2], ranges[b, h, tile, 3])
    same = full if same is None else (jnp.maximum(same[0], full[0]), jnp.minimum(same[1], full[1]))
    lo, hi, gap = clip_gap(lo, hi, ranges[b, h, tile, 4], ranges[b, h, tile, 5])
    return lo, hi, same, gap


def clip_gap(lo, hi, gap_lo, gap_hi):
    """(lo, hi, `Gap`): a tile's visited blocks [lo, hi) and the ranges' gap [gap_lo, gap_hi) clipped to them; a gap
    that reaches an edge of [lo, hi) (a band or segments ended the range inside it) narrows the range instead, and
    one that covers it all is dropped (the range stays: nothing in it is visible, and its blocks are masked)."""
    gap_lo = jnp.clip(gap_lo, lo, hi)
    gap_hi = jnp.clip(gap_hi, gap_lo, hi)
    leading, trailing = gap_lo == lo, gap_hi == hi
    lo, hi = jnp.where(leading & ~trailing, gap_hi, lo), jnp.where(trailing & ~leading, gap_lo, hi)
    return lo, hi, Gap(gap_lo, jnp.where(leading | trailing, 0, gap_hi - gap_lo))


# Under block ranges a tile that visits more than this many times the mean number of blocks launches first
# (`long_tiles_first`): global keys' tile sees every query while a window's sees ~1k.
LONG_TILE_FACTOR = 4.0


def long_items(cost):
    """Which of the items `cost` (a NumPy or JAX array of visited blocks or their cost) are long: over
    LONG_TILE_FACTOR times the mean of all of them."""
    return cost > LONG_TILE_FACTOR * cost.mean()


def long_tiles_first(ranges, *, batch: int, heads: int, num_tiles: int, reverse_tiles: bool = False):
    """int32 [batch * heads * num_tiles]: the CTA launch order of a grid (batch, heads, tiles) (row-major linear
    ids of the items), from its tiles' block ranges (`mask_block_ranges`, [Bd, Hd, num_tiles, ...]; with
    `reverse_tiles` grid tile i is range tile num_tiles - 1 - i): the tiles that visit over LONG_TILE_FACTOR times
    the mean number of blocks first, longest first, the others in grid order. A grid launches its last axis
    fastest, so a head's long tile would otherwise start only after every tile of the heads before it, and run on
    alone after all others; uniform and causal-shaped sparsity keep their order (and their L2 reuse)."""
    steps = jnp.broadcast_to(ranges[..., 1] - ranges[..., 0], (batch, heads, num_tiles))
    steps = (steps[..., ::-1] if reverse_tiles else steps).reshape(-1)
    long = long_items(steps.astype(jnp.float32))
    return jnp.argsort(jnp.where(long, -steps, 1), stable=True).astype(jnp.int32)


def launched_item(launch_ref, grid: tuple[int, int, int], names: tuple[str, str, str]):
    """This CTA's (batch, head, tile) item of a (batch, heads, tiles) grid named `names`: its own grid position, or
    with a launch order (`long_tiles_first`, None: none) the item at its linear position."""
    position = tuple(lax.axis_index(name) for name in names)
    if launch_ref is None:
        return position
    _, heads, tiles = grid
    item = launch_ref[(position[0] * heads + position[1]) * tiles + position[2]]
    return lax.div(item, heads * tiles), lax.rem(lax.div(item, tiles), heads), lax.rem(item, tiles)


def coarsen_block_classes(anything, everything, rows: int, cols: int):
    """Block classes ([..., num_row_blocks, num_col_blocks]) of blocks `rows` x `cols` times as large."""
    *lead, n, m = anything.shape
    split = (*lead, n // rows, rows, m // cols, cols)
    return anything.reshape(split).any(axis=(-3, -1)), everything.reshape(split).all(axis=(-3, -1))


def dense_mask_classes(mask, *, block_q: int, block_kv: int, q_pad: int, kv_pad: int):
    """A dense mask's block classes at tiles of block_q x block_kv (as `mods.block_classes`'): bool [Bd, Hd,
    q_pad // block_q, kv_pad // block_kv] pairs (some / every position visible), reduced in XLA from the bool mask
    [Bd, Hd, q_len, kv_len]. Positions past q_len or kv_len count for neither: the kernels hide padded keys with
    the band's ragged-block mask, and padded queries are sliced off (or have P = 0)."""
    q_len, kv_len = mask.shape[2:]

    def reduce(padding: bool, op):
        x = jnp.pad(mask, ((0, 0), (0, 0), (0, q_pad - q_len), (0, kv_pad - kv_len)), constant_values=padding)
        return op(x.reshape(*mask.shape[:2], q_pad // block_q, block_q, kv_pad // block_kv, block_kv), axis=(3, 5))

    return reduce(False, jnp.any), reduce(True, jnp.all)


def sparse_classes(mask, block_mask, *, q_len: int, kv_len: int, block_q: int, block_kv: int, q_pad: int,
                   kv_pad: int):  # fmt: skip
    """The block classes (`dense_mask_classes`) of a dense bool mask [Bd, Hd, q_len, kv_len] and a `BlockMask`
    together (either None; None if both are): the block mask's from the host (`block_sparse.tile_classes`,
    constants), the dense mask's computed in XLA."""
    parts = []
    if mask is not None:
        parts.append(dense_mask_classes(mask, block_q=block_q, block_kv=block_kv, q_pad=q_pad, kv_pad=kv_pad))
    if block_mask is not None:
        parts.append(
            block_sparse.tile_classes(
                block_mask, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv, q_pad=q_pad, kv_pad=kv_pad
            )
        )
    return and_classes(*parts)


def and_classes(*classes):
    """Block classes (each None or (anything, everything), broadcasting over [Bd, Hd]) of masks applied together:
    a block may show something only if every mask's may (conservative), it shows everything if every mask's does."""
    present = [c for c in classes if c is not None]
    if not present:
        return None
    anything, everything = present[0]
    for a, e in present[1:]:
        anything, everything = jnp.logical_and(anything, a), jnp.logical_and(everything, e)
    return anything, everything


def intersect_ranges(a, b):
    """Two masks' `mask_block_ranges` (int32 [Bd, Hd, num_tiles, RANGE_FIELDS], broadcasting over [Bd, Hd]; either
    None) as those of both masks applied: the hulls' intersection, the full runs' (a run wholly visible to both)
    and the longer of the two gaps (a block one mask hides, both do). An empty intersection keeps
    `narrow_to_mask_ranges`' rule: the tile visits one block, which a mask hides."""
    if a is None or b is None:
        return b if a is None else a
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    lo, hi = jnp.maximum(a[..., 0], b[..., 0]), jnp.minimum(a[..., 1], b[..., 1])
    full_lo, full_hi = jnp.maximum(a[..., 2], b[..., 2]), jnp.minimum(a[..., 3], b[..., 3])
    longer = (a[..., 5] - a[..., 4] >= b[..., 5] - b[..., 4])[..., None]
    gap = jnp.where(longer, a[..., 4:], b[..., 4:])
    return jnp.concatenate([jnp.stack([lo, hi, full_lo, jnp.maximum(full_hi, full_lo)], axis=-1), gap], axis=-1)


def outside_hull_hidden(visible, positions, hull, block: int):
    """`visible` (a bool tile or None: all) with the positions (an int32 tile of the visited block's keys, or
    queries in the dK/dV pass) outside the ranges' hull [lo, hi) of `block`-sized blocks hidden. A block mask
    served by its ranges alone (`DenseMods.hide_outside_hull`) has no token mask: the one block a tile whose ranges
    are empty (or disjoint from its band or segments) still visits must be hidden this way."""
    inside = jnp.logical_and(positions >= hull[0] * block, positions < hull[1] * block)
    return inside if visible is None else jnp.logical_and(visible, inside)


def program_mask(mask, rows, cols, *, batch, head, q_idx, kv_idx, q_axis: int, max_position: int,
                 tile_shape=None):  # fmt: skip
    """A mask program (`mods.Staged`) on one tile: bool, True = visible. rows / cols: its (ints, floats) staged
    vectors of the tile's queries / keys (`mod_values`); q_idx, kv_idx: int32 vectors of their positions; the
    queries run along the tile's axis `q_axis`; every position is below `max_position`. Each operation runs on
    vectors until they meet (`Staged.joint`'s vector form)."""
    return mask.joint(None, batch, head, q_idx, kv_idx, *rows, *cols, q_axis=q_axis, max_position=max_position,
                      tile_shape=tile_shape)  # fmt: skip


def _split_logits(score, s, rows, cols, *, scale: float, batch, head, q_idx, kv_idx, q_axis: int, max_position: int,
                  key_before_query: bool, origin):  # fmt: skip
    """(x, c, row2) for `program_logits` and `program_score`: the program's result on scale * s is c * x + row,
    and row2 = log2(e) * row, its per-query term in base-2 units (None where it has none)."""
    x, c, row = score.joint(s, batch, head, q_idx, kv_idx, *rows, *cols, q_axis=q_axis, scale=scale,
                            max_position=max_position, split=True, row_terms=True,
                            key_before_query=key_before_query, tile_shape=s.shape,
                            origin=origin)  # fmt: skip
    return x, c, None if row is None else row * np.float32(blocks.LOG2E)


def program_logits(score, s, rows, cols, *, scale: float, batch, head, q_idx, kv_idx, q_axis: int,
                   max_position: int, key_before_query: bool, origin=None, tile_shape=None):  # fmt: skip
    """A score program (`mods.Staged`) on one tile of raw logits `s` (float32; the program sees scale * s), for
    a forward: (x, c, row2) with the program's result in base-2 units c * x + row2, c a Python float > 0 and
    row2 None or a float32 vector of the tile's queries (`Staged.joint`'s row term), so that a kernel takes a
    row maximum of x times c plus row2 and folds c and row2 into exp2's multiply-add. key_before_query: every
    key the kernel keeps visible is at or before its query (its band's right edge is <= 0). origin: None or
    the tile's first key position, which a program that reads the positions only as their difference counts
    their float32 values from (a per-key term slope * kv_idx then stays small at long context).
    rows, cols and positions as in `program_mask`."""
    x, c, row2 = _split_logits(score, s, rows, cols, scale=scale, batch=batch, head=head, q_idx=q_idx,
                               kv_idx=kv_idx, q_axis=q_axis, max_position=max_position,
                               key_before_query=key_before_query, origin=origin)  # fmt: skip
    if c < 0:
        return x * np.float32(c * blocks.LOG2E), 1.0, row2
    return x, c * blocks.LOG2E, row2


def offsets_apply(score) -> bool:
    """Whether a score program's score-free part can wait in S's accumulator (`program_offsets`): its result is
    linear in the score with a positive slope (biases, ALiBi; `Staged.score_slope`)."""
    slope = score.score_slope
    return slope is not None and slope > 0


def program_offsets(score, rows, cols, *, scale: float, batch, head, q_idx, kv_idx, q_axis: int, max_position: int,
                    key_before_query: bool, tile_shape, origin=None):  # fmt: skip
    """A score program with `offsets_apply` on one tile's vectors, before its logits exist: (offset, row2) such
    that the program's result on scale * s in base-2 units is c * (s + offset) + row2, c = `Staged.score_slope`
    * scale * log2(e). offset: None or a float32 tile in the raw logits' units, which a kernel writes into S's
    accumulator before the wgmma that adds Q K^T to it, so that the program costs the softmax nothing once S is
    ready; row2: None or a float32 vector of the tile's queries. Arguments as `program_logits`'s."""
    offset, row = score.offsets(batch, head, q_idx, kv_idx, *rows, *cols, q_axis=q_axis, tile_shape=tile_shape,
                                scale=scale, max_position=max_position, key_before_query=key_before_query,
                                origin=origin)  # fmt: skip
    return offset, None if row is None else row * np.float32(blocks.LOG2E)


def program_score(score, s, rows, cols, *, scale: float, batch, head, q_idx, kv_idx, q_axis: int,
                  max_position: int, key_before_query: bool, origin=None, grad_side=None,
                  tile_shape=None):  # fmt: skip
    """A score program (`mods.Staged`) on one tile of raw logits `s` (float32), for a backward: (logits2,
    pullback, row2). logits2 + row2: the program's result on x = scale * s in base-2 units, so P = exp2(logits2
    - (lse2 - row2)); row2 None or a vector of the tile's queries (`program_logits`, as is `origin`; only where
    d score / d x is a constant and this pass differentiates no value of its own side, `grad_side`).
    pullback(d_score) = (d x, [d value]): d x = d_score * d score / d x elementwise, and with `grad_side` ("row"
    or "col") the gradient of each of that side's float staged values, a vector like the value (summed over the
    tile's other axis). Where d score / d x is a constant (`Staged.score_derivative`: biases, ALiBi) the program
    runs on s with its constants folded, d x is d_score times that constant (d_score itself at 1) and only the
    values' gradients come from a vjp; otherwise from a vjp in x. rows, cols and positions as in
    `program_mask`."""
    (ri, rf), (ci, cf) = rows, cols
    primals = list({"row": rf, "col": cf}.get(grad_side, []))

    def evaluate(x, floats, *, x_scale: float, split: bool):
        row_floats, col_floats = (floats, cf) if grad_side == "row" else (rf, floats if grad_side else cf)
        return score.joint(x, batch, head, q_idx, kv_idx, ri, row_floats, ci, col_floats, q_axis=q_axis,
                           tile_shape=s.shape, scale=x_scale, max_position=max_position, split=split)  # fmt: skip

    slope = score.score_derivative
    if slope is None and not primals:  # the derivative by forward mode: no chain of ops on d_score
        factor = []

        def folded_logits(s):  # the result is factor * folded_logits(s)
            x, c = evaluate(s, [], x_scale=scale, split=True)
            factor.append(c)
            return x

        jax.eval_shape(folded_logits, s)
        c = factor[0]
        # d score / d x = c / scale * d folded_logits / d s: a constant tangent, folded into the derivative's ops
        x, derivative = jax.jvp(folded_logits, (s,), (jnp.full(s.shape, c / scale, jnp.float32),))
        return x * np.float32(c * blocks.LOG2E), lambda d_score: (d_score * derivative, []), None
    if slope is None:
        out, vjp = jax.vjp(lambda x, floats: evaluate(x, floats, x_scale=1.0, split=False), s * scale, primals)
        return out * blocks.LOG2E, lambda d_score: _pull(vjp, d_score), None
    if not primals:
        x, c, row2 = _split_logits(score, s, rows, cols, scale=scale, batch=batch, head=head, q_idx=q_idx,
                                   kv_idx=kv_idx, q_axis=q_axis, max_position=max_position,
                                   key_before_query=key_before_query, origin=origin)  # fmt: skip
        return x * np.float32(c * blocks.LOG2E), lambda d_score: (_times(d_score, slope), []), row2
    coef = []

    def folded(floats):  # the result is coef * folded(floats)
        x, c = evaluate(s, floats, x_scale=scale, split=True)
        coef.append(c)
        return x

    x, vjp = jax.vjp(folded, primals)
    (c,) = coef

    def pullback(d_score):
        (d_floats,) = _pull(vjp, d_score)
        return _times(d_score, slope), [d * np.float32(c) for d in d_floats]

    return x * np.float32(c * blocks.LOG2E), pullback, None


def _times(x, c: float):
    return x if c == 1.0 else x * np.float32(c)


def _pull(vjp, cotangent):
    """`vjp(cotangent)` with its transposed equations bound one by one (`_bind_without_add_any`)."""
    residuals, vjp_tree = jax.tree.flatten(vjp)
    transposed, shapes = jax.make_jaxpr(lambda res, d: jax.tree.unflatten(vjp_tree, res)(d), return_shape=True)(
        residuals, cotangent
    )
    flat = _bind_without_add_any(transposed.jaxpr, transposed.consts, [*residuals, cotangent])
    return jax.tree.unflatten(jax.tree.structure(shapes), flat)


def _bind_without_add_any(jaxpr, consts, args):
    """A jaxpr's outputs, its equations bound one by one (jit calls inlined), `add_any` (how a transposed
    jaxpr sums cotangents; Mosaic GPU has no lowering rule for it) as `lax.add`."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(var):
        return var.val if isinstance(var, jex.Literal) else env[var]

    for eqn in jaxpr.eqns:
        inputs = [read(var) for var in eqn.invars]
        if eqn.primitive.name == "add_any":
            outputs = [lax.add(*inputs)]
        elif eqn.primitive.name in ("pjit", "jit"):
            body = eqn.params["jaxpr"]
            outputs = _bind_without_add_any(body.jaxpr, body.consts, inputs)
        else:
            outputs = eqn.primitive.bind(*inputs, **eqn.params)
            outputs = outputs if eqn.primitive.multiple_results else [outputs]
        env.update(zip(eqn.outvars, outputs))
    return [read(var) for var in jaxpr.outvars]
