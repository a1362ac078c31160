"""FlashAttention forward for Hopper (sm90), written with Pallas's Mosaic GPU backend.

The FA3 recipe, one CTA per (batch, head, tile of `2 * block_q` queries), or with `HopperConfig.persistent`
one CTA per SM that runs a share of those tiles one after another (`grid_tiles`):
  * three warpgroups: a producer that streams K/V blocks into a `num_stages`-deep shared-memory ring with
    TMA (each slot guarded by a "loaded" barrier that the TMA completes and a "consumed" barrier that both
    consumers arrive on), and two consumers, each owning `block_q` query rows;
  * S = Q K^T and O += P V on the tensor cores (wgmma); Q and K/V come from swizzled shared memory, P from
    registers;
  * ping-pong: a two-arrival "schedule" barrier alternates the consumers, so one warpgroup's softmax runs
    while the other's matmuls occupy the tensor cores;
  * online softmax in base 2 with the scale folded in: with c = scale * log2(e), p = exp2(s * c - m) is one
    FMA and one ex2 per logit, and m is kept in units of c * s;
  * band skipping (causal, or a local window (left, right)): a CTA visits only the key blocks its rows can
    see (`blocks.kv_block_range`, shared with the portable kernels); blocks every row of a warpgroup sees in
    full skip the mask;
  * the grid runs the query tiles of one (batch, head) back to back, so concurrent CTAs share K/V in L2; with
    a causal band the longest tiles (last rows) launch first. Persistent CTAs keep the K/V ring, the barriers'
    phases and the ping-pong running from one tile to the next, and load the next tile's Q during this
    one's epilogue: short rows stop paying a CTA's fixed cost (launch, first loads, epilogue) per tile.

Segment ids (packed sequences; per-example lengths arrive folded into them, see `api._segments`): int32 ids
of the CTA's query rows are loaded once per consumer, the ids of each key block ride the K ring (loaded by
the producer beside K, read before K's slot is released). A CTA visits only the key blocks its tile's ids
can meet, and skips the id mask on blocks wholly inside the tile's one segment (`segment_block_ranges`,
computed in XLA; the kernel reads its tile's entry as scalars); other blocks are masked by id equality. A row
that sees no key (segments, or a window past the keys) keeps m = -inf: masked steps shift exp2 by 0 there,
and the epilogue writes zeros and lse = -inf.

score_mod / mask_mod (`mods.Staged` programs): their per-query values (int32, floats bitcast, `pack_mod_stacks`)
are loaded once per consumer tile, their per-key values ride the K ring like the key ids; `Staged.joint` runs
on each tile of logits in registers. The score program sees the logit in natural units (scale * s) on every
visited block, and exp2 then takes its result times log2(e); the mask program runs on masked blocks only. Its
block ranges (`mask_ranges`, computed in XLA per query tile) narrow the visited key blocks and give the run of
wholly visible blocks that skip the mask.

A dense bias and mask (`DenseMods`: arrays over both queries and keys, padded in XLA, the mask as int8): the
producer streams each (query tile, key block) tile of them by TMA into swizzled shared memory beside K (riders of
the K ring, each with its own "ready" barrier, released with K); a consumer reads its rows into the WGMMA register
layout on every visited block, after S and before K's slot is freed: logits = soft_cap(scale * s) + bias in
natural units (the score program, if any, then sees them at scale 1), and a 0 in the mask hides the key. The
ring holds them at a cost in stages or key block size (`HopperConfig.fit`).

Dropout (`KernelDropout`): a consumer hashes its rows once per tile and each step's keep bits from those and the
key positions (`masks.dropout_keep_mask`'s bits); P V takes the kept probabilities, the row sum l all of them (the
LSE is of the softmax before dropout), and the kept ones' 1 / (1 - rate) joins the epilogue's 1 / l.

Ragged lengths are padded in the wrapper (queries to `2 * block_q`, keys to `block_kv`); the padded keys are
masked in the last key block, the padded query rows sliced off. head_dim is padded to a multiple of 32
(`forward_head_dim`): multiples of 64 run on 128-byte swizzled tiles, the others (96, 160) on 64-byte ones, whose
wgmma contraction groups are 32 columns. GQA is an index map: query head h reads kv head
h // (num_heads // num_kv_heads). Value may have a head_dim of its own (DeepSeek's MLA: 192 for query and key,
128 for value): Q and K tiles at query's, V tiles, the accumulator and the output at value's (then the output
tile has its own shared memory, never Q's).

Residuals: the kernel returns (out, lse); lse [batch, heads, q_len] float32 in natural log, like the core.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import block_sparse, blocks, masks, mods
from pallas_flash.block_sparse import BlockMask
from pallas_flash.blocks import LOG2E
from pallas_flash.hopper.common import (
    KERNEL_STATIC_ARGNAMES,
    RANGE_FIELDS,
    DenseMods,
    biased_logits,
    block_of,
    dense_operands,
    dense_riders,
    dense_ring,
    dense_tiles,
    dot_t,
    drain_ring,
    forward_head_dim,
    head_dim_transforms,
    intersect_ranges,
    long_items,
    mask_block_ranges,
    masked_edge_loops,
    mod_values,
    narrow_to_mask_ranges,
    offsets_apply,
    outside_hull_hidden,
    pack_mod_stacks,
    pad_axis,
    program_logits,
    program_mask,
    program_offsets,
    query_tile_schedule,
    register_ops,
    round_up,
    segment_block_ranges,
    sparse_classes,
    stack_index,
    step_of,
    stream_kv_blocks,
    tile_visible,
    unmasked_blocks,
    wgmma_operand,
)
from pallas_flash.hopper.config import H100_SHARED_MEMORY, NUM_CONSUMERS, HopperConfig

# A persistent forward's CTAs take the (batch, head) pairs in chunks whose keys and values together fit in
# this much of the H100's 50 MB L2, so that the CTAs running at once re-read them from L2, not HBM.
L2_SHARE_BYTES = 16 * 2**20
MAX_HEAD_DIM = 256
# setmaxnreg budgets (multiples of 8, sum over warpgroups <= 64K / 128 threads): consumers hold the
# accumulator, the producer only issues TMAs.
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40


class ModValues(typing.NamedTuple):
    """The score and the mask program's staged values on one side (rows of a tile, or columns of a key block),
    each (ints, floats) as `Staged.joint` takes them: lists of vectors."""

    score: tuple = ((), ())
    mask: tuple = ((), ())


NO_VALUES = ModValues()


@dataclasses.dataclass(frozen=True)
class KernelMods:
    """The score and the mask program a forward evaluates (`mods.Staged`, or None), and where their values
    sit in the packed row and column stacks (`pack_mod_stacks`): offsets of (score int, score float, mask
    int, mask float)."""

    score: mods.Staged | None = None
    mask: mods.Staged | None = None
    row_offsets: tuple = (0, 0, 0, 0)
    col_offsets: tuple = (0, 0, 0, 0)

    @property
    def active(self) -> bool:
        return self.score is not None or self.mask is not None

    def values(self, side: str, read, *, masked: bool) -> ModValues:
        """`ModValues` of one side, `read(index)` giving an entry of its packed stack; the mask program's
        only for a masked step (unmasked steps skip its evaluation)."""
        offsets = self.row_offsets if side == "row" else self.col_offsets
        score = NO_VALUES.score if self.score is None else mod_values(self.score, side, offsets[:2], read)
        mask = NO_VALUES.mask
        if self.mask is not None and masked:
            mask = mod_values(self.mask, side, offsets[2:], read)
        return ModValues(score, mask)


@dataclasses.dataclass(frozen=True)
class KernelDropout:
    """Dropout on a kernel's probabilities, with `masks.dropout_keep_mask`'s bits: each kept with probability
    1 - rate, the kept ones scaled by `scale` = 1 / (1 - rate), which the kernels fold into a per-row or per-key
    factor where they can (the forward's normalisation, dV's store). broadcast: one mask for every (batch,
    head). The hash of (seed, batch, head, query) runs once per query of a tile (`row_hash`, whose first two
    rounds are scalars), then one round per element (`keep`), so every tiling draws the same bits.

    The kernels take the seed as a table, int32 [batch, 3]: per example (seed0, seed1, the batch index the hash
    reads) (`kernel_dropout`), so that a kernel whose vmapped examples are folded into its batch (the one-pass
    backward, `bwd._fold_vmap`) still hashes each example's own batch index, with its own seed."""

    rate: float
    broadcast: bool = False

    @property
    def scale(self) -> float:
        return 1.0 / (1.0 - self.rate)

    def row_hash(self, seed_ref, batch, head, q_pos):
        """uint32 hashes of the queries `q_pos` (a vector of a tile's query positions) of (batch, query head);
        seed_ref: the seed table (`kernel_dropout`), read as scalars."""
        head = 0 if self.broadcast else head  # the table's batch column is 0 then too
        return masks.dropout_row_hash(seed_ref[batch, 0], seed_ref[batch, 1], seed_ref[batch, 2], head, q_pos)

    def keep(self, row_hash, kv_pos, *, q_axis: int):
        """bool tile (the shape of `kv_pos`, the key positions): which probabilities survive; `row_hash` (of
        the tile's queries) is broadcast along its query axis `q_axis`."""
        return masks.dropout_keep(lax.broadcast_in_dim(row_hash, kv_pos.shape, [q_axis]), kv_pos, self.rate)


def positions(start, size: int, layout, *, interpreting: bool):
    """int32 [size] positions start, start + 1, ... in a register `layout` (none in the interpreter, which has
    no CPU rule for `plgpu.broadcasted_iota`)."""
    if interpreting:
        return start + lax.broadcasted_iota(jnp.int32, (size,), 0)
    return start + plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=layout)


def kernel_dropout(rate: float, broadcast: bool, seed, batch: int):
    """(`KernelDropout`, its seed table int32 [batch, 3]) of a call, or (None, None) without dropout. seed:
    uint32 [2] (`masks.dropout_seed`)."""
    if not rate:
        return None, None
    if seed is None:
        raise ValueError(f"dropout_rate={rate} needs dropout_seed (uint32 [2], `masks.dropout_seed`)")
    seed = jnp.broadcast_to(lax.bitcast_convert_type(jnp.asarray(seed, jnp.uint32), jnp.int32), (batch, 2))
    index = jnp.zeros((batch, 1), jnp.int32) if broadcast else jnp.arange(batch, dtype=jnp.int32)[:, None]
    return KernelDropout(rate, broadcast), jnp.concatenate([seed, index], axis=1)


class TileRows(typing.NamedTuple):
    """What a consumer knows of its query rows for the whole tile: (batch, head) indices, first row, segment
    ids (or None), the programs' row values, with dropout the rows' hashes (`KernelDropout.row_hash`), and with
    `DenseMods.hide_outside_hull` the hull (lo, hi) of the tile's block ranges."""

    batch: typing.Any
    head: typing.Any
    q_start: typing.Any
    q_seg: typing.Any
    values: ModValues
    dropout_hash: typing.Any = None
    hull: typing.Any = None


def _mod_scratch(rows, cols, config: HopperConfig):
    """Shared memory and barriers for the programs' values: () without any, else one (row values per consumer,
    their barriers, column values ring, its barriers), None where a side has none. Rows: [consumers, n,
    block_q]; columns ride the K ring: [num_stages, n, block_kv]; both packed int32."""
    if rows is None and cols is None:
        return ()
    return (
        (
            None if rows is None else plgpu.SMEM((NUM_CONSUMERS, rows.shape[2], config.block_q), jnp.int32),
            None if rows is None else plgpu.Barrier(num_barriers=NUM_CONSUMERS),
            None if cols is None else plgpu.SMEM((config.num_stages, cols.shape[2], config.block_kv), jnp.int32),
            None if cols is None else plgpu.Barrier(num_barriers=config.num_stages),
        ),
    )


def mod_smem_bytes(score_mod: mods.Staged | None, mask_mod: mods.Staged | None, config: HopperConfig) -> int:
    """Shared memory the programs' values take (`_mod_scratch`), beyond `HopperConfig.smem_bytes`: int32 row
    values per consumer, column values per ring slot, and a barrier (8 bytes) each."""
    staged = [p for p in (score_mod, mask_mod) if p is not None]
    rows, cols = (sum(len(p.group(side, kind)) for p in staged for kind in ("int", "float")) for side in ("row", "col"))
    row_bytes = (4 * rows * config.block_q + 8) * NUM_CONSUMERS if rows else 0
    col_bytes = (4 * cols * config.block_kv + 8) * config.num_stages if cols else 0
    return row_bytes + col_bytes


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    q_ids_ref,
    kv_ids_ref,
    kv_ranges_ref,
    rows_ref,
    cols_ref,
    mask_ranges_ref,
    bias_ref,
    mask_ref,
    out_ref,
    lse_ref,
    scoped,
    *,
    scale: float,
    band: masks.Band,
    kv_len: int,
    tiles_of_cta,
    config: HopperConfig,
    group: int,
    programs: KernelMods,
    interpreting: bool,
    dropout: KernelDropout | None = None,
    seed_ref=None,
    dense: DenseMods = DenseMods(),
    deal_ref=None,
):
    """3 warpgroups ("wg"): 0 and 1 consume, 2 produces. Each CTA runs the query tiles `tiles_of_cta` gives it
    (one per CTA, or, persistent, a strided share of all of them, or the share deal_ref deals it:
    `long_rows_deal`); the K/V ring's slots, the barriers' phases and the consumers' ping-pong continue from one
    tile to the next.

    `interpreting`: JAX's Mosaic GPU interpreter (CPU) has no `pl.run_state`, no CPU rule for register
    layouts (`layout_cast`, `plgpu.broadcasted_iota`), and no wgmma on a transposed shared-memory ref or a
    register operand: there Q K^T and P V are plain dots on the same shared-memory tiles, layouts are left
    out, and the producer drains the ring at the end (`drain_ring`). Same barriers, copies, ranges and masks
    otherwise (tests/test_attention.py runs it with race detection).

    q_ref [batch, q_pad, heads, d], k_ref/v_ref [batch, kv_pad, kv_heads, d], q_ids_ref/kv_ids_ref None or
    int32 [batch, q_pad] / [batch, kv_pad] (padding ids never match), kv_ranges_ref None or with them the
    key blocks each query tile's ids may meet (`segment_block_ranges`), rows_ref/cols_ref None or the
    packed int32 values [Bd, Hd, n, q_pad] / [Bd, Hd, n, kv_pad] of `programs` (`pack_mod_stacks`),
    mask_ranges_ref None or the `mask_block_ranges` per query tile of the mask program, the dense mask and the
    block mask (`intersect_ranges`), bias_ref/mask_ref None or
    `dense`'s arrays [Bd, Hd, q_pad, kv_pad] (`dense_operands`; their tiles ride the K ring), out_ref like
    q_ref, lse_ref [batch, heads, q_pad] (natural log). `dropout`: None, or dropout on P before P V, with
    seed_ref its seed table (`kernel_dropout`)."""
    (
        (q_smem2, o_smem2, k_smem, v_smem, lse_smem2),
        q_ready,
        (k_ready, v_ready),
        (k_free, v_free),
        turn,
        segments,
        ring,
        *mod_scratch,
    ) = scoped
    has_segments = q_ids_ref is not None
    score_mod, mask_mod = programs.score, programs.mask
    block_q, block_kv, num_stages = config.block_q, config.block_kv, config.num_stages
    num_kv_blocks = k_ref.shape[1] // block_kv
    num_q_tiles = q_ref.shape[1] // (NUM_CONSUMERS * block_q)
    dtype = q_ref.dtype
    num_tiles, tile_of = tiles_of_cta
    num_tiles = num_tiles(deal_ref)
    separate_out = o_smem2 is not None
    max_position = max(q_ref.shape[1], k_ref.shape[1])  # positions the programs see are below it

    def schedule(i):
        """(batch, head, first row, key blocks [lo, hi), unmasked run (same segment, wholly visible to the
        mask program) or None, the `Gap` its steps skip or None) of this CTA's i-th tile."""
        batch, head, tile = tile_of(i, deal_ref)
        tile_start, kv_lo, kv_hi, same = query_tile_schedule(
            num_q_tiles,
            block_q=block_q,
            block_kv=block_kv,
            num_kv_blocks=num_kv_blocks,
            kv_len=kv_len,
            band=band,
            segment_ranges=kv_ranges_ref,
            tile=tile,
            batch=batch,
        )
        gap = None
        if mask_ranges_ref is not None:
            kv_lo, kv_hi, same, gap = narrow_to_mask_ranges(
                kv_lo,
                kv_hi,
                same,
                mask_ranges_ref,
                batch=batch,
                head=head,
                tile=lax.div(tile_start, NUM_CONSUMERS * block_q),
                num_kv_blocks=num_kv_blocks,
            )
        return batch, head, tile_start, kv_lo, kv_hi, same, gap

    def hull(batch, head, tile_start):
        """The hull (lo, hi) of the tile's block ranges, with `dense.hide_outside_hull` (else None)."""
        if not dense.hide_outside_hull:
            return None
        b, h = stack_index(mask_ranges_ref, batch, head)
        tile = lax.div(tile_start, NUM_CONSUMERS * block_q)
        return mask_ranges_ref[b, h, tile, 0], mask_ranges_ref[b, h, tile, 1]

    # A row may see no key at all (segments, a window's left edge past the keys, a mask program or a dense mask,
    # or a score program's or a bias's -inf): keep its m = -inf safe.
    rows_may_be_empty = (
        has_segments or band.left is not None or programs.active or dense.active or dense.hide_outside_hull
    )
    # Blocks before the first unmasked one may need the mask: a band's left edge, segments, block ranges (a mask
    # program's, a dense or a block mask's).
    leading = band.left is not None or has_segments or mask_ranges_ref is not None
    wg = lax.axis_index("wg")

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        q_smem, lse_smem = q_smem2.at[wg], lse_smem2.at[wg]
        o_smem = o_smem2.at[wg] if separate_out else q_smem

        def load_q(i, tile=None):
            """Tile i's Q (or, given, the Q of `tile` = (batch, head, first row))."""
            batch, head, tile_start = schedule(i)[:3] if tile is None else tile
            rows = pl.ds(tile_start + wg * block_q, block_q)
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem, q_ready.at[wg])

        # A persistent CTA loads a tile's per-row operands while the previous tile runs: its next Q as soon as
        # the last S = Q K^T has read Q (where the output has a tile of its own), its query ids and the
        # programs' row values once their shared-memory copies are in registers.
        prefetching = not (isinstance(num_tiles, int) and num_tiles == 1)
        # Without the overlap, the next Q loads right after a tile's last S: a branch in every step, whose
        # registers a 256-key S beside per-element operands cannot spare (a document program at head_dim 64
        # spilled 40% more and ran 9-17% slower); there it loads once the tile's loop is done.
        per_element = programs.active or has_segments or dense.active or dropout is not None
        q_in_step = separate_out and prefetching and not config.overlap and (block_kv <= 128 or not per_element)

        def q_read(i, last, next_tile=None):
            """This tile's Q has been read for the last time where `last` (a traced bool): load the next one
            (`next_tile`: its (batch, head, first row), worked out before the loop that calls this)."""
            if separate_out and prefetching:
                pl.when(jnp.logical_and(last, i + 1 < num_tiles))(lambda: load_q(i + 1, next_tile))

        def load_row_operands(i):
            """Start tile i's copies of this consumer's query ids and the programs' row values (`tile_rows`)."""
            batch, head, tile_start, *_ = schedule(i)
            q_start = tile_start + wg * block_q
            if has_segments:
                q_ids_smem, _, q_ids_ready, _ = segments
                plgpu.copy_gmem_to_smem(
                    q_ids_ref.at[batch, pl.ds(q_start, block_q)], q_ids_smem.at[wg], q_ids_ready.at[wg]
                )
            if rows_ref is not None:
                b, h = stack_index(rows_ref, batch, head)
                source = rows_ref.at[b, h, :, pl.ds(q_start, block_q)]
                plgpu.copy_gmem_to_smem(source, rows_smem.at[wg], rows_ready.at[wg])

        def next_row_operands(i):
            """Tile i's row operands are in registers: once every thread of the warpgroup has read them, the
            next tile's copies may overwrite their slots."""
            if (has_segments or rows_ref is not None) and prefetching:

                def load_next():
                    plgpu.commit_smem()  # our reads before the copies' writes
                    load_row_operands(i + 1)

                pl.when(i + 1 < num_tiles)(load_next)

        def layout(x, layout):
            return x if interpreting else plgpu.layout_cast(x, layout)

        iota, _, load = register_ops(interpreting)

        row = plgpu.Layout.WGMMA.reduce(1)
        column = plgpu.Layout.WGMMA.reduce(0)

        rows_smem, rows_ready, cols_smem, cols_ready = mod_scratch[0] if mod_scratch else (None,) * 4

        def block_ids(slot, *, masked):
            """With segment ids: wait for the key ids in ring slot `slot` (every step waits: one wait per phase)
            and, in a masked step, read them (before K's slot is released)."""
            if not has_segments:
                return None
            _, kv_ids_smem, _, kv_ids_ready = segments
            plgpu.barrier_wait(kv_ids_ready.at[slot])
            return load(kv_ids_smem.at[slot], column) if masked else None

        def block_values(slot, *, masked):
            """(key segment ids or None, the programs' column values `ModValues`) of the block in ring slot
            `slot`, read before K's slot is released; the mask program's only in a masked step."""
            kv_seg = block_ids(slot, masked=masked)
            if cols_ref is None:
                return kv_seg, NO_VALUES
            plgpu.barrier_wait(cols_ready.at[slot])  # every step waits: one wait per phase

            def read(r):
                return load(cols_smem.at[slot, r], column)

            return kv_seg, programs.values("col", read, masked=masked)

        def tile_rows(batch, head, q_start, q_seg, tile_hull):
            """This consumer's `TileRows`: the programs' row values are loaded once per tile (their copy was
            started by `load_row_operands`)."""
            values = NO_VALUES
            if rows_ref is not None:
                plgpu.barrier_wait(rows_ready.at[wg])
                values = programs.values("row", lambda r: load(rows_smem.at[wg, r], row), masked=True)
            if dropout is None:
                return TileRows(batch, head, q_start, q_seg, values, hull=tile_hull)
            q_pos = positions(q_start, block_q, row, interpreting=interpreting)
            row_hash = dropout.row_hash(seed_ref, batch, head, q_pos)
            return TileRows(batch, head, q_start, q_seg, values, row_hash, tile_hull)

        def dropped(p, rows, kv_step):
            """P V's operand: p with the dropped probabilities zeroed (the kept ones' scale waits for the
            epilogue's normalisation), in the input dtype."""
            if dropout is not None:
                keep = dropout.keep(rows.dropout_hash, kv_step * block_kv + iota(p.shape, 1), q_axis=0)
                p = jnp.where(keep, p, 0.0)
            return p.astype(dtype)

        def program_args(rows, kv_step):
            """The programs' arguments on block kv_step: positions as vectors of the tile's queries and keys."""
            return dict(
                batch=rows.batch,
                head=rows.head,
                q_idx=lambda: positions(rows.q_start, block_q, row, interpreting=interpreting),
                kv_idx=lambda: positions(kv_step * block_kv, block_kv, column, interpreting=interpreting),
                q_axis=0,
                tile_shape=(block_q, block_kv),
                max_position=max_position,
            )

        # A score program linear in the score (a bias, ALiBi) writes its score-free part into S's accumulator
        # before the wgmma: the softmax, which runs while the other consumer's wgmmas do, has nothing to add.
        offsetting = score_mod is not None and not dense.forms_logits and offsets_apply(score_mod)

        def score_offsets(rows, cols, kv_step):
            """(offset, row2) of block kv_step with `offsetting` (`program_offsets`: S's accumulator starts at
            offset, row2 is the per-query term in base 2), else (None, None)."""
            if not offsetting:
                return None, None
            return program_offsets(
                score_mod, rows.values.score, cols[1].score, scale=scale, key_before_query=band.keys_before_queries,
                origin=kv_step * block_kv, **program_args(rows, kv_step)
            )  # fmt: skip

        def probabilities(s, m, *, masked, rows, cols, kv_step, tiles=(None, None), row2=None):
            """Block kv_step's logits s [block_q, block_kv] (masked where `masked`) and the running row maximum
            m (base-2 units) -> (p, alpha, m_new): the block's unnormalised probabilities, the factor that
            rescales what was accumulated before, and the new maximum. `rows`: the tile's `TileRows`; `cols`:
            the block's key segment ids and program values (`block_values`); `tiles`: its dense bias and
            visibility tiles (`dense_tiles`), applied on every step; with `offsetting`, s holds the score
            program's offset and row2 is its per-query term (`score_offsets`)."""
            kv_seg, col_values = cols
            bias, dense_visible = tiles
            c = scale * LOG2E  # logits in base-2 units: exp(scale * s) = exp2(c * s)
            logit_scale = scale
            if dense.forms_logits:  # the soft cap and the bias act on scale * s: natural units from here on
                s, _ = biased_logits(s, bias, scale=scale, soft_cap=dense.soft_cap)
                c, logit_scale = LOG2E, 1.0
            if masked:
                q_pos, kv_pos = rows.q_start + iota(s.shape, 0), kv_step * block_kv + iota(s.shape, 1)
            if offsetting:  # the program's result is c * s + row2 (`program_offsets`), s offset already
                c = score_mod.score_slope * scale * LOG2E
            elif score_mod is not None:  # the program sees scale * s; exp2 takes its result times log2(e)
                s, c, row2 = program_logits(
                    score_mod, s, rows.values.score, col_values.score, scale=logit_scale,
                    key_before_query=band.keys_before_queries, origin=kv_step * block_kv,
                    **program_args(rows, kv_step)
                )  # fmt: skip
            if masked:
                visible = tile_visible(
                    q_pos,
                    kv_pos,
                    band=band,
                    kv_len=kv_len if kv_len % block_kv else None,
                    q_seg=rows.q_seg,
                    kv_seg=kv_seg,
                    shape=s.shape,
                    q_axis=0,
                )
                if mask_mod is not None:
                    seen = program_mask(mask_mod, rows.values.mask, col_values.mask, **program_args(rows, kv_step))
                    visible = seen if visible is None else jnp.logical_and(visible, seen)
                if rows.hull is not None:
                    visible = outside_hull_hidden(visible, kv_pos, rows.hull, block_kv)
                if visible is not None:  # None: traced for a loop that runs no iterations
                    s = jnp.where(visible, s, -jnp.inf)
            if dense_visible is not None:
                s = jnp.where(dense_visible, s, -jnp.inf)
            # c > 0, so max(c * s + row2) = c * max(s) + row2.
            block_max = s.max(axis=1) * c
            m_new = jnp.maximum(m, block_max if row2 is None else block_max + row2)
            # A row that has seen no key yet has m_new = -inf: shift by 0 so exp2 gives 0, not NaN. (An
            # unmasked block always has a visible key, so only masked steps need this, unless a score program
            # or a dense bias or mask may hide every key of a row.)
            may_be_empty = masked or score_mod is not None or dense.active
            shift = blocks.safe_exp_shift(m_new) if may_be_empty and rows_may_be_empty else m_new
            alpha = jnp.exp2(m - shift)
            logit_shift = shift if row2 is None else shift - row2
            return jnp.exp2(s * c - lax.broadcast_in_dim(logit_shift, s.shape, [0])), alpha, m_new

        def block_tiles(slot, *, masked):
            """This consumer's dense tiles of the block in ring slot `slot` (`dense_tiles`), read before K's slot
            is released; the mask's only in a masked step (unmasked ones lie in its ranges' wholly visible run)."""
            return dense_tiles(ring, slot, wg=wg, rows=block_q, load=load, read_mask=masked)

        def issue_qk(s_ref, slot, offset):
            """Issue S = offset + Q K[slot]^T into the accumulator s_ref (offset None: 0)."""
            if offset is not None:
                s_ref[...] = offset
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))

        def qk(slot, after_issue, offset=None):
            """S = offset + Q K[slot]^T in float32 (offset None: 0); `after_issue()` runs once its wgmma is
            issued (before the wait)."""

            def scores(s_ref):
                issue_qk(s_ref, slot, offset)
                after_issue()
                return s_ref[...]

            if interpreting:
                s = dot_t(wgmma_operand(q_smem), wgmma_operand(k_smem.at[slot]))
                after_issue()
                return s if offset is None else s + offset
            return pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.float32))

        def pv(acc, p16, slot, after_issue):
            """acc + P V[slot]; `after_issue()` runs once its wgmma is issued (before the wait)."""

            def update(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                after_issue()

            if interpreting:
                acc = acc + jnp.dot(p16, wgmma_operand(v_smem.at[slot]), preferred_element_type=jnp.float32)
                after_issue()
                return acc
            return pl.run_state(update)(plgpu.ACC.init(acc))

        def overlapped_blocks(acc, m, l, *, tile, rows, kv_lo, kv_hi, unmasked, slot_of, gap):
            """`config.overlap`, FlashAttention-3's intra-warpgroup pipelining on top of the ping-pong: step j
            issues S_j = Q K_j^T and then O += P_{j-1} V_{j-1}, waits for S_j alone (wgmma groups complete in
            order: at most one, the P V, left in flight) and computes P_j's softmax while that P V runs.
            The consumers take turns issuing their wgmmas (a "your turn" barrier each: wait for ours, issue,
            arrive on the other's), so one's softmax also runs under the other's wgmmas. Registers: O, S_j
            and P_{j-1} live at once. Steps [kv_lo, kv_hi) visit the blocks `gap` leaves (`Gap.block`). Block
            kv_lo (no P V before it) is peeled off, masked outside the unmasked run; the steps after it keep the
            masked / unmasked split; every step, the peeled one and the last P V each take one turn, the same count
            for both consumers."""

            def my_turn():  # the tensor cores are ours: issue this step's wgmmas
                plgpu.barrier_wait(turn.at[wg])

            def pass_turn():  # issued: the other consumer may issue its own
                plgpu.barrier_arrive(turn.at[1 - wg])

            slot = slot_of(kv_lo)
            cols = block_values(slot, masked=True)
            offset, row2 = score_offsets(rows, cols, kv_lo)
            my_turn()
            s = qk(slot, after_issue=pass_turn, offset=offset)  # K_{kv_lo} was waited for at the tile's start

            def first_block(masked: bool):
                def softmax():
                    tiles = block_tiles(slot, masked=masked)
                    plgpu.barrier_arrive(k_free.at[slot])
                    block = dict(rows=rows, cols=cols, kv_step=kv_lo, tiles=tiles, row2=row2)
                    return probabilities(s, m, masked=masked, **block)

                return softmax

            # The first block pays for the mask only outside the unmasked run (most of a short row's tiles
            # start inside it: a document's, a block mask's).
            inside = jnp.logical_and(unmasked[0] <= kv_lo, kv_lo < unmasked[1])
            p, alpha, m = lax.cond(inside, first_block(False), first_block(True))
            l = l * alpha + p.sum(axis=1)  # O is still zero: nothing to rescale

            def step(t, carry, *, masked: bool):
                acc, m, l, p_prev = carry
                slot, prev = slot_of(t), slot_of(t - 1)
                kv_step = block_of(gap, t)
                cols = block_values(slot, masked=masked)
                offset, row2 = score_offsets(rows, cols, kv_step)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[prev])
                my_turn()
                block = dict(masked=masked, rows=rows, cols=cols, kv_step=kv_step, row2=row2)
                if interpreting:  # the same steps, one product at a time
                    s = qk(slot, after_issue=pass_turn, offset=offset)
                    tiles = block_tiles(slot, masked=masked)
                    plgpu.barrier_arrive(k_free.at[slot])
                    p, alpha, m = probabilities(s, m, tiles=tiles, **block)
                    acc = pv(acc, p_prev, prev, after_issue=lambda: None)
                else:

                    def both(s_ref, o_ref):
                        o_ref[...] = acc
                        issue_qk(s_ref, slot, offset)
                        plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])
                        pass_turn()
                        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_j done, P V may run on
                        tiles = block_tiles(slot, masked=masked)
                        plgpu.barrier_arrive(k_free.at[slot])
                        return (o_ref[...], *probabilities(s, m, tiles=tiles, **block))

                    acc, p, alpha, m = pl.run_scoped(
                        both, plgpu.ACC((block_q, block_kv), jnp.float32), plgpu.ACC(acc.shape, jnp.float32)
                    )
                l = l * alpha + p.sum(axis=1)
                plgpu.barrier_arrive(v_free.at[prev])
                # O holds blocks < kv_step in the old scale: rescale it to the new maximum.
                return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), m, l, dropped(p, rows, kv_step)

            carry = (acc, m, l, dropped(p, rows, kv_lo))
            unmasked_lo, unmasked_hi = (jnp.maximum(edge, kv_lo + 1) for edge in unmasked)
            acc, m, l, p_last = masked_edge_loops(
                step, carry, kv_lo + 1 if leading else None, unmasked_lo, unmasked_hi, kv_hi
            )
            q_read(tile, True)  # every S is done; the last P V is not
            last = slot_of(kv_hi - 1)
            plgpu.barrier_wait(v_ready.at[last])
            my_turn()
            acc = pv(acc, p_last, last, after_issue=pass_turn)
            plgpu.barrier_arrive(v_free.at[last])
            return acc, m, l

        def run_tile(i, ring_steps):
            """Tile i; `ring_steps`: K/V blocks this consumer took from the ring before it (slot = count %
            num_stages). Returns the count after it."""
            batch, head, tile_start, kv_lo, kv_hi, same, gap = schedule(i)
            q_start = tile_start + wg * block_q
            if not separate_out:  # the output reuses Q's tile: the last tile's store must have read it
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                load_q(i)
            m = layout(jnp.full((block_q,), -jnp.inf, jnp.float32), row)
            l = layout(jnp.zeros((block_q,), jnp.float32), row)
            acc = layout(jnp.zeros((block_q, v_smem.shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
            if not prefetching:
                load_row_operands(i)
            q_seg = None
            if has_segments:
                q_ids_smem, _, q_ids_ready, _ = segments
                plgpu.barrier_wait(q_ids_ready.at[wg])
                q_seg = load(q_ids_smem.at[wg], row)
            rows = tile_rows(batch, head, q_start, q_seg, hull(batch, head, tile_start))
            next_row_operands(i)

            def slot_of(t):  # the ring slot of step t
                return lax.rem(ring_steps + t - kv_lo, num_stages)

            plgpu.barrier_wait(q_ready.at[wg])
            plgpu.barrier_wait(k_ready.at[slot_of(kv_lo)])  # kv_hi > kv_lo always (query_tile_schedule)
            # The next tile's (batch, head, first row), worked out once here rather than in every step.
            next_tile = schedule(jnp.minimum(i + 1, num_tiles - 1))[:3] if q_in_step else None

            def step(t, carry, *, masked: bool):
                acc, m, l = carry
                slot, kv_step = slot_of(t), block_of(gap, t)
                cols = block_values(slot, masked=masked)
                offset, row2 = score_offsets(rows, cols, kv_step)
                # Our QK^T is queued: the other consumer may issue its PV.
                s = qk(slot, after_issue=lambda: plgpu.barrier_arrive(turn), offset=offset)
                if q_in_step:
                    q_read(i, t == steps_hi - 1, next_tile)
                tiles = block_tiles(slot, masked=masked)
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(turn)
                p, alpha, m_new = probabilities(
                    s, m, masked=masked, rows=rows, cols=cols, kv_step=kv_step, tiles=tiles, row2=row2
                )
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = dropped(p, rows, kv_step)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                plgpu.barrier_arrive(turn)  # softmax done
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)  # the tensor cores are ours

                def wait_next_k():  # overlap the next K block's wait with this PV
                    pl.when(t + 1 < steps_hi)(lambda: plgpu.barrier_wait(k_ready.at[slot_of(t + 1)]))

                acc = pv(acc, p16, slot, after_issue=wait_next_k)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            # Only the blocks on the band's edges, the ragged last block and (with segment ids) blocks that
            # are not wholly in the tile's one segment pay for the mask.
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
            # From here on, ranges count steps (`Gap.step`): the gap's blocks are never visited.
            unmasked_lo, unmasked_hi, steps_hi = (step_of(gap, b) for b in (unmasked_lo, unmasked_hi, kv_hi))
            if config.overlap:
                acc, m, l = overlapped_blocks(
                    acc,
                    m,
                    l,
                    tile=i,
                    rows=rows,
                    kv_lo=kv_lo,
                    kv_hi=steps_hi,
                    unmasked=(unmasked_lo, unmasked_hi),
                    slot_of=slot_of,
                    gap=gap,
                )
            else:  # without a left band edge, segment ids or a mask program, unmasked_lo == kv_lo: no leading edge
                acc, m, l = masked_edge_loops(
                    step, (acc, m, l), kv_lo if leading else None, unmasked_lo, unmasked_hi, steps_hi
                )

            if not config.overlap and not q_in_step:
                q_read(i, True)
            if separate_out:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read o_smem
            inv_l = (1.0 if dropout is None else dropout.scale) / l  # the kept probabilities' 1 / (1 - rate)
            log_l = m + jnp.log2(l)
            if rows_may_be_empty:  # rows that saw no key: zeros and lse = -inf, never NaN
                inv_l = jnp.where(l == 0.0, 0.0, inv_l)
                log_l = jnp.where(l == 0.0, -jnp.inf, log_l)
            o_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
            lse_smem[...] = log_l * blocks.LN2
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[batch, pl.ds(q_start, block_q), head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_start, block_q)])
            return ring_steps + steps_hi - kv_lo

        if separate_out:
            load_q(0)
        if prefetching:
            load_row_operands(0)
        # Consumer 1 parks at the schedule barrier until consumer 0 has issued its first QK^T; from then on
        # the two alternate, across tiles too.
        if config.overlap:  # consumer 0 goes first; its last "your turn" is waited for at the end
            pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn.at[0]))
        else:
            pl.when(wg == 1)(take_turn)
        for_each_tile(num_tiles, run_tile, 0)
        if config.overlap:
            pl.when(wg == 0)(lambda: plgpu.barrier_wait(turn.at[0]))
        else:
            pl.when(wg == 0)(take_turn)  # balance consumer 1's opening turn
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        ids = None if not has_segments else (kv_ids_ref, segments[1], segments[3])

        def stream_tile(i, ring_steps):
            batch, head, tile_start, kv_lo, kv_hi, _, gap = schedule(i)
            steps_hi = step_of(gap, kv_hi)
            riders = ()
            if cols_ref is not None:  # the programs' column values of the query head's (batch, head)
                b, h = stack_index(cols_ref, batch, head)
                riders = ((lambda keys: cols_ref.at[b, h, :, keys], mod_scratch[0][2], mod_scratch[0][3]),)
            riders += dense_riders(
                (bias_ref, mask_ref),
                ring,
                batch=batch,
                head=head,
                rows=pl.ds(tile_start, NUM_CONSUMERS * block_q),
            )
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
                done=ring_steps,
                gap=gap,
            )
            return ring_steps + steps_hi - kv_lo

        ring_steps = for_each_tile(num_tiles, stream_tile, 0)
        if interpreting:
            drain_ring((k_free, v_free), num_stages=num_stages, steps=ring_steps)


def for_each_tile(num_tiles, body, carry):
    """carry = body(i, carry) for i in 0 .. num_tiles-1 (a Python 1: one call, no loop)."""
    if isinstance(num_tiles, int) and num_tiles == 1:
        return body(0, carry)
    return lax.fori_loop(0, num_tiles, body, carry)


def persistent_chunk(batch: int, heads: int, kv_bytes_per_head: int) -> int:
    """The (batch, head) pairs a persistent forward takes at once (`persistent_order`'s chunk): as many as fit
    L2_SHARE_BYTES of keys and values."""
    return max(1, min(batch * heads, L2_SHARE_BYTES // max(kv_bytes_per_head, 1)))


def grid_tiles(
    batch: int, heads: int, num_q_tiles: int, *, persistent_ctas: int | None, kv_bytes_per_head: int, dealt=False
):
    """(grid, grid_names, tiles_of_cta) for `num_q_tiles` query tiles of each (batch, head); tiles_of_cta is
    (num_tiles(deal_ref), tile_of(i, deal_ref)), deal_ref the kernel's `long_rows_deal` (None without one).

    One CTA per tile: grid (batch, heads, q_tiles), num_tiles 1, tile_of its grid indices. Persistent: grid
    (ctas,), CTA c runs the tiles `persistent_order` puts at positions 2 (c + k ctas) and 2 (c + k ctas) + 1
    for k = 0, 1, ...: each CTA takes whole (long, short) pairs, so the static split stays balanced under a
    causal band, where the hardware's dynamic assignment of one-tile CTAs used to do it. `dealt`: the pairs
    (units) are taken as `long_rows_deal` says instead."""
    if persistent_ctas is None:

        def own_tile(i, deal_ref=None):
            del i, deal_ref
            return lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_tiles")

        return (batch, heads, num_q_tiles), ("batch", "heads", "q_tiles"), (lambda deal_ref=None: 1, own_tile)

    pairs = batch * heads
    chunk = persistent_chunk(batch, heads, kv_bytes_per_head)
    total = pairs * num_q_tiles
    ctas, num_tiles_of = persistent_split(total, persistent_ctas)

    def tile_of(i, deal_ref=None):
        cta = lax.axis_index("sm")
        if dealt:
            num_long, rounds = deal_ref[0], deal_ref[1]
            index = deal_index(cta, lax.div(i, 2), ctas=ctas, num_long=num_long, rounds=rounds)
            position = 2 * deal_ref[DEAL_HEADER + index] + lax.rem(i, 2)
        else:
            position = 2 * (cta + lax.div(i, 2) * ctas) + lax.rem(i, 2)
        pair, rank = persistent_order(position, pairs=pairs, chunk=chunk, num_q_tiles=num_q_tiles)
        return lax.div(pair, heads), lax.rem(pair, heads), rank

    def num_tiles(deal_ref=None):
        cta = lax.axis_index("sm")
        if not dealt:
            return num_tiles_of(cta)
        num_long, rounds, num_units = (deal_ref[j] for j in range(DEAL_HEADER))
        return deal_tiles(cta, ctas=ctas, num_long=num_long, rounds=rounds, num_units=num_units, odd=total % 2 == 1)

    return (ctas,), ("sm",), (num_tiles, tile_of)


# ---- the long-rows deal: a persistent forward's units where a few tiles see many times the keys of the rest -------

DEAL_HEADER = 3  # num_long, rounds, num_units: the deal's scalars before its unit order
# A tile's fixed cost (Q load, ring fill, epilogue) in block-steps, for the deal's cost model.
TILE_OVERHEAD_STEPS = 2
# The deal's XLA ops take ~0.03-0.05 ms per call on the H100; the long rows' CTAs cost more than that where a row
# spans 128 key blocks (16 heads at 16k: forward kernel 0.327 / 0.423 ms dealt against 0.438 / 0.552 strided), not
# at 64 (8k: 0.198 / 0.251 against 0.195 / 0.246).
DEAL_MIN_KV_BLOCKS = 128


def long_rows(mask_program, block_mask) -> bool:
    """Whether a few query tiles of a call may visit many times the key blocks of the others: global queries, from a
    mask program (`mods.Staged`) that ORs in a term of the query position alone (`ors_query_term`), or a `BlockMask`
    with a row of blocks that keeps over LONG_TILE_FACTOR times the mean (each None where absent). A persistent
    forward then deals its tiles by `long_rows_deal`."""
    if mask_program is not None and mask_program.ors_query_term:
        return True
    if block_mask is None:
        return False
    return bool(long_items(block_mask.mask.sum(axis=-1)).any())


def long_rows_deal(ranges, *, batch: int, heads: int, num_q_tiles: int, band: masks.Band, ctas: int, chunk: int):
    """int32 [DEAL_HEADER + units]: how a persistent forward's CTAs take its units (`persistent_order`'s pairs of
    positions) from the tiles' block ranges ([Bd, Hd, num_q_tiles, RANGE_FIELDS]), computed in XLA: (num_long,
    rounds, units), then the units' order, long units first. A unit is long past LONG_TILE_FACTOR times the mean
    cost (its tiles' visited blocks plus TILE_OVERHEAD_STEPS each). The first num_long CTAs take one long unit
    each while the other CTAs take `rounds` short units each (about a long unit's cost), then every CTA takes the
    rest in turn (`deal_index`); the order keeps the short units' `persistent_order`, so the CTAs running at once
    share keys and values in L2. Without long units, or with more than half as many as CTAs, or too few short
    units for a round: num_long = rounds = 0, the usual strided deal over the order."""
    total = batch * heads * num_q_tiles
    units = -(-total // 2)
    position = jnp.arange(2 * units, dtype=jnp.int32)
    pair, rank = persistent_order(jnp.minimum(position, total - 1), pairs=batch * heads, chunk=chunk,
                                  num_q_tiles=num_q_tiles)  # fmt: skip
    causal = band.right is not None and band.left is None  # `query_tile_schedule` runs its tiles in reverse
    tile = num_q_tiles - 1 - rank if causal else rank
    r = jnp.broadcast_to(ranges, (batch, heads, num_q_tiles, RANGE_FIELDS))[pair // heads, pair % heads, tile]
    steps = r[:, 1] - r[:, 0] - (r[:, 5] - r[:, 4]) + TILE_OVERHEAD_STEPS
    cost = jnp.where(position < total, steps, 0).reshape(units, 2).sum(axis=1).astype(jnp.float32)
    long = long_items(cost)
    if total % 2:  # the last unit holds one tile: kept short, so it ends the order (`deal_tiles`)
        long = long.at[-1].set(False)
    num_long = jnp.sum(long)
    long_cost = jnp.sum(jnp.where(long, cost, 0)) / jnp.maximum(num_long, 1)
    short_cost = jnp.sum(jnp.where(long, 0, cost)) / jnp.maximum(units - num_long, 1)
    others = jnp.maximum(ctas - num_long, 1)
    rounds = jnp.minimum(
        jnp.round(long_cost / jnp.maximum(short_cost, 1)).astype(jnp.int32), (units - num_long) // others
    )
    dealt = (num_long > 0) & (2 * num_long <= ctas) & (rounds > 0)
    slot = jnp.where(long, jnp.cumsum(long) - 1, num_long + jnp.cumsum(~long) - 1)
    order = jnp.zeros((units,), jnp.int32).at[slot].set(jnp.arange(units, dtype=jnp.int32))
    header = jnp.stack([jnp.where(dealt, num_long, 0), jnp.where(dealt, rounds, 0), jnp.asarray(units)])
    return jnp.concatenate([header.astype(jnp.int32), order])


def deal_index(cta, k, *, ctas: int, num_long, rounds):
    """The index into `long_rows_deal`'s order of CTA `cta`'s k-th unit (works on traced and on NumPy ints)."""
    others = ctas - num_long
    shared = num_long + rounds * others + (k - jnp.where(cta < num_long, 1, rounds)) * ctas + cta
    own = jnp.where(k == 0, cta, shared)
    return jnp.where(cta < num_long, own, jnp.where(k < rounds, num_long + k * others + cta - num_long, shared))


def deal_tiles(cta, *, ctas: int, num_long, rounds, num_units, odd: bool):
    """How many tiles CTA `cta` runs under `long_rows_deal` (two per unit; the holder of the order's last unit one
    fewer where the tiles are `odd` in number)."""
    others = ctas - num_long
    start = num_long + rounds * others  # the first index every CTA takes part in
    shared = jnp.maximum(num_units - start - cta + ctas - 1, 0) // ctas
    count = jnp.where(cta < num_long, 1, rounds) + shared
    last = num_units - 1
    holder = jnp.where(last >= start, (last - start) % ctas, num_long + (last - num_long) % jnp.maximum(others, 1))
    return 2 * count - (odd & (cta == holder)).astype(jnp.int32)


def persistent_split(total: int, max_ctas: int):
    """(ctas, num_tiles_of): CTA c of `ctas` owns positions 2 (c + k ctas) + {0, 1} < total."""
    units = -(-total // 2)
    ctas = min(max_ctas, units)

    def num_tiles_of(cta):
        owned = 2 * ((units - cta + ctas - 1) // ctas)
        # An odd total leaves the last unit one tile short.
        return owned - ((total % 2 == 1) & ((units - 1) % ctas == cta)).astype(jnp.int32)

    return ctas, num_tiles_of


def persistent_order(position, *, pairs: int, chunk: int, num_q_tiles: int):
    """The (batch * heads + head, tile rank) at `position` of a persistent forward's order (a bijection of
    0 .. pairs * num_q_tiles - 1; works on traced and on NumPy ints). The (batch, head) pairs go in chunks
    of `chunk`, whose keys and values fit in L2 together, so the CTAs running at once share them. Within a
    chunk, ranks go folded, 0, T-1, 1, T-2, ..., each (j, T-1-j) on two consecutive positions of one pair:
    with a causal band (tile index = T-1-rank, `query_tile_schedule`) the two tiles visit T+1 blocks
    together whatever j is. An odd T's middle rank comes last, one position each."""
    position = jnp.asarray(position, jnp.int32)
    tiles_per_chunk = chunk * num_q_tiles
    first_pair = position // tiles_per_chunk * chunk
    within = position % tiles_per_chunk
    size = jnp.minimum(chunk, pairs - first_pair)  # the last chunk may be short
    folded = size * (num_q_tiles - num_q_tiles % 2)  # positions in (j, T-1-j) units
    unit = within // 2
    j = unit // size
    in_units = within < folded
    pair = first_pair + jnp.where(in_units, unit % size, within - folded)
    rank = jnp.where(in_units, jnp.where(within % 2 == 0, j, num_q_tiles - 1 - j), num_q_tiles // 2)
    return pair, rank


def _forward_padded(
    q,
    k,
    v,
    q_ids,
    kv_ids,
    mod_operands=(None, None, None),
    *,
    scale: float,
    band: masks.Band,
    kv_len: int,
    config: HopperConfig,
    programs: KernelMods = KernelMods(),
    dropout: KernelDropout | None = None,
    dropout_seed=None,
    dense_arrays=(None, None),
    dense: DenseMods = DenseMods(),
    long_rows: bool = False,
    interpret,
):
    """`hopper_forward` on padded operands (value's head_dim may differ from query's); mod_operands: the
    programs' packed row and column values and the mask program's block ranges (`_mod_operands`), each None where
    absent; dropout_seed: `dropout`'s seed table (`kernel_dropout`); dense_arrays: `dense`'s (bias, mask)
    (`dense_operands`), each None where absent. `long_rows` (`long_rows`): persistent CTAs take their tiles by
    `long_rows_deal`."""
    batch, q_pad, heads, head_dim = q.shape
    kv_heads, head_dim_v = k.shape[2], v.shape[3]
    num_q_tiles = q_pad // (NUM_CONSUMERS * config.block_q)
    has_segments = q_ids is not None
    # Swizzled (8, S)-element tiles, the layout wgmma reads: Q and K share one (S = Q K^T's contraction group),
    # V and the output their own.
    transforms = head_dim_transforms(head_dim, q.dtype.itemsize)
    transforms_v = head_dim_transforms(head_dim_v, v.dtype.itemsize)
    tile_bytes = sum(x.dtype.itemsize for x in dense_arrays if x is not None)

    persistent_ctas = None
    if config.persistent:  # one CTA per SM (a few in the interpreter, so that each runs several tiles)
        persistent_ctas = 2 if interpret is not None else getattr(jax.devices()[0], "core_count", 132)
    kv_bytes_per_head = k.shape[1] * (head_dim + head_dim_v) * k.dtype.itemsize * kv_heads // heads
    dealt = persistent_ctas is not None and long_rows and mod_operands[2] is not None
    dealt = dealt and k.shape[1] // config.block_kv >= DEAL_MIN_KV_BLOCKS
    grid, grid_names, tiles_of_cta = grid_tiles(
        batch,
        heads,
        num_q_tiles,
        persistent_ctas=persistent_ctas,
        kv_bytes_per_head=kv_bytes_per_head,
        dealt=dealt,
    )
    deal = None
    if dealt:
        with jax.ensure_compile_time_eval():  # a constant for a block mask's ranges
            deal = long_rows_deal(
                mod_operands[2], batch=batch, heads=heads, num_q_tiles=num_q_tiles, band=band, ctas=grid[0],
                chunk=persistent_chunk(batch, heads, kv_bytes_per_head),
            )  # fmt: skip
    q_tile = plgpu.SMEM((NUM_CONSUMERS, config.block_q, head_dim), q.dtype, transforms=transforms)
    out_tile = plgpu.SMEM((NUM_CONSUMERS, config.block_q, head_dim_v), q.dtype, transforms=transforms_v)

    # Named for profiles and traces (Mosaic GPU calls the kernel `<name>_mosaic_gpu_kernel`).
    def flash_forward_sm90(q_ref, k_ref, v_ref, *refs):
        refs = list(refs)
        segment_refs = [refs.pop(0) for _ in range(3)] if has_segments else [None] * 3
        mod_refs = [None if x is None else refs.pop(0) for x in mod_operands]
        dense_refs = [None if x is None else refs.pop(0) for x in dense_arrays]
        seed_ref = None if dropout is None else refs.pop(0)
        deal_ref = None if deal is None else refs.pop(0)
        out_ref, lse_ref = refs
        smem = (
            q_tile,
            out_tile if config.separate_out(head_dim, q.dtype.itemsize, tile_bytes, head_dim_v) else None,
            plgpu.SMEM((config.num_stages, config.block_kv, head_dim), k.dtype, transforms=transforms),
            plgpu.SMEM((config.num_stages, config.block_kv, head_dim_v), v.dtype, transforms=transforms_v),
            plgpu.SMEM((NUM_CONSUMERS, config.block_q), jnp.float32),
        )
        segments = None
        if has_segments:  # query ids per consumer, key ids ring, their barriers
            segments = (
                plgpu.SMEM((NUM_CONSUMERS, config.block_q), jnp.int32),
                plgpu.SMEM((config.num_stages, config.block_kv), jnp.int32),
                plgpu.Barrier(num_barriers=NUM_CONSUMERS),
                plgpu.Barrier(num_barriers=config.num_stages),
            )
        body = functools.partial(
            _kernel,
            scale=scale,
            band=band,
            kv_len=kv_len,
            tiles_of_cta=tiles_of_cta,
            group=heads // kv_heads,
            config=config,
            programs=programs,
            interpreting=interpret is not None,
            dropout=dropout,
            seed_ref=seed_ref,
            dense=dense,
            deal_ref=deal_ref,
        )
        pl.run_scoped(
            lambda *scoped: body(q_ref, k_ref, v_ref, *segment_refs, *mod_refs, *dense_refs, out_ref, lse_ref, scoped),
            smem,
            plgpu.Barrier(num_barriers=NUM_CONSUMERS),
            (plgpu.Barrier(num_barriers=config.num_stages),) * 2,
            (plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=config.num_stages),) * 2,
            # The ping-pong: one two-arrival rendezvous, or (overlap) a "your turn" barrier per consumer.
            (
                plgpu.Barrier(num_arrivals=1, num_barriers=NUM_CONSUMERS)
                if config.overlap
                else plgpu.Barrier(num_arrivals=NUM_CONSUMERS)
            ),
            segments,
            dense_ring(dense_arrays, config.num_stages, NUM_CONSUMERS * config.block_q, config.block_kv),
            *_mod_scratch(*mod_operands[:2], config),
            collective_axes="wg",
        )

    operands = (q, k, v)
    if has_segments:
        operands += (
            q_ids,
            kv_ids,
            segment_block_ranges(
                q_ids, kv_ids, rows_per_tile=NUM_CONSUMERS * config.block_q, cols_per_block=config.block_kv
            ),
        )
    operands += tuple(x for x in mod_operands if x is not None)
    operands += tuple(x for x in dense_arrays if x is not None)
    if dropout is not None:
        operands += (dropout_seed,)
    if deal is not None:
        operands += (deal,)
    return plgpu.kernel(
        flash_forward_sm90,
        out_type=(
            jax.ShapeDtypeStruct((batch, q_pad, heads, head_dim_v), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, q_pad), jnp.float32),
        ),
        grid=grid,
        grid_names=grid_names,
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({} if interpret is None else dict(interpret=interpret)),
    )(*operands)


def default_config(
    head_dim: int,
    kv_len: int,
    band: masks.Band,
    tile_bytes: int = 0,
    head_dim_v: int | None = None,
    sparse: bool = False,
) -> HopperConfig | None:
    """`HopperConfig.default` for a call with this (padded) head_dim, key length and band (a window counts
    as not causal, and its rows as long as its size, left + right: a query tile of a 1k window in 16k keys visits
    about the blocks of a 1k row, whose CTA's fixed cost the short rows' tiles amortise), at the larger of query's
    and value's (padded) `head_dim_v` (None: head_dim); with dense tiles (`tile_bytes` per logit,
    `dense_tile_bytes`) or a value head_dim of its own shrunk until its ring holds them (`HopperConfig.fit`),
    None where no tiles fit. `sparse`: the rows may visit only some key blocks (`HopperConfig.default`)."""
    window = band.left is not None and band.right is not None
    if window:
        kv_len = min(kv_len, band.left + band.right)
    config = HopperConfig.default(max(head_dim, head_dim_v or head_dim), kv_len, band.is_causal, sparse, window)
    if tile_bytes or (head_dim_v or head_dim) != head_dim:
        return config.fit(head_dim, 2, tile_bytes, head_dim_v)
    return config


def sparse_rows(segment_ids, mask_program, mask, block_mask) -> bool:
    """Whether a call's rows may visit only some key blocks (`default_config`'s `sparse`): it has segment ids, a
    mask program, a dense mask or a block mask (each None where absent)."""
    return any(x is not None for x in (segment_ids, mask_program, mask, block_mask))


def dense_tile_bytes(bias_dtype, mask: bool) -> int:
    """Bytes per logit of the dense tiles a kernel's ring carries: the bias's itemsize (bias_dtype None: no
    bias) plus one for a mask (int8)."""
    return (0 if bias_dtype is None else jnp.dtype(bias_dtype).itemsize) + int(mask)


def mask_ranges(
    mask_mod: mods.Staged, mask_consts, *, batch: int, heads: int, q_len: int, kv_len: int, config: HopperConfig
):
    """The forward's `mask_ranges` for a mask program (with its closed-over arrays `mask_consts`) at `config`'s
    tiles: per (batch, head, query tile of 2 * block_q rows) the key blocks it visits and its run of wholly
    visible blocks (`common.mask_block_ranges`), int32 [Bd, Hd, num_q_tiles, RANGE_FIELDS]; computed in XLA, on the
    device."""
    anything, everything = mods.block_classes(
        mask_mod.program,
        mask_consts,
        batch=batch,
        heads=heads,
        q_len=q_len,
        kv_len=kv_len,
        block_q=NUM_CONSUMERS * config.block_q,
        block_kv=config.block_kv,
    )
    return mask_block_ranges(anything, everything)


def sparse_operands(
    mod_operands, mask, block_mask, config: HopperConfig, *, q_len: int, kv_len: int, q_pad: int, kv_pad: int
):
    """`_mod_operands`' (rows, columns, mask program's ranges) with the ranges narrowed to those of a dense bool
    mask [Bd, Hd, q_len, kv_len] and a `BlockMask` (either None) at the forward's tiles (`intersect_ranges`)."""
    classes = sparse_classes(
        mask,
        block_mask,
        q_len=q_len,
        kv_len=kv_len,
        block_q=NUM_CONSUMERS * config.block_q,
        block_kv=config.block_kv,
        q_pad=q_pad,
        kv_pad=kv_pad,
    )
    if classes is None:
        return mod_operands
    rows, cols, ranges = mod_operands
    with jax.ensure_compile_time_eval():  # a block mask's alone are constants: no XLA ops at run time
        return rows, cols, intersect_ranges(ranges, mask_block_ranges(*classes))


def _mod_operands(score_mod, score_stacks, mask_mod, mask_stacks, ranges, *, q_pad: int, kv_pad: int):
    """((packed row values, packed column values, mask ranges), KernelMods) for the kernel (each None where
    absent), after checking that the stacks and ranges go with the programs."""
    for name, program, stacks in (("score", score_mod, score_stacks), ("mask", mask_mod, mask_stacks)):
        if len(stacks) != 4:
            raise ValueError(f"{name}_stacks must be (rows_int, rows_float, cols_int, cols_float), got {len(stacks)}")
        if program is None and any(x is not None for x in stacks):
            raise ValueError(f"{name}_stacks given without a {name}_mod")
    if (mask_mod is None) != (ranges is None):
        raise ValueError("mask_ranges (`hopper.fwd.mask_ranges`) go with a mask_mod, and only with one")
    rows, row_offsets = pack_mod_stacks((*score_stacks[:2], *mask_stacks[:2]), q_pad)
    cols, col_offsets = pack_mod_stacks((*score_stacks[2:], *mask_stacks[2:]), kv_pad)
    return (rows, cols, ranges), KernelMods(score_mod, mask_mod, row_offsets, col_offsets)


@functools.partial(jax.jit, static_argnames=KERNEL_STATIC_ARGNAMES)
def hopper_forward(
    query,
    key,
    value,
    *,
    scale: float,
    is_causal: bool = False,
    local_window_size=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    config: HopperConfig | None = None,
    score_mod: mods.Staged | None = None,
    score_stacks=(None,) * 4,
    mask_mod: mods.Staged | None = None,
    mask_stacks=(None,) * 4,
    mask_ranges=None,
    dropout_rate: float = 0.0,
    dropout_seed=None,
    broadcast_dropout: bool = False,
    bias=None,
    mask=None,
    logits_soft_cap: float | None = None,
    block_mask: BlockMask | None = None,
    interpret=None,
):
    """Attention forward on Hopper. Shapes and results as `reference.attention_reference`:
    query [batch, q_len, heads, head_dim], key [batch, kv_len, kv_heads, head_dim], value [batch, kv_len,
    kv_heads, head_dim_v] -> (out [batch, q_len, heads, head_dim_v] in query's dtype, lse [batch, heads, q_len]
    float32).

    is_causal, local_window_size (left, right; None for an unbounded side): the band, as `masks.Band.of`.
    q_segment_ids / kv_segment_ids: None, or int [batch, q_len] / [batch, kv_len] (both or neither): a query
    sees only keys with its id. A query that sees no key gets zeros and lse = -inf.
    score_mod / mask_mod: staged programs (`mods.stage`) or None, with their `Staged.stacks` (rows_int,
    rows_float, cols_int, cols_float) at (batch, heads, q_len, kv_len) as score_stacks / mask_stacks; a
    mask_mod also takes its `mask_ranges` (this module's, at the same config): the score_mod applies to the
    scaled logit on every visited block, the mask_mod hides keys on blocks it does not leave wholly visible.
    dropout_rate, dropout_seed (uint32 [2], `masks.dropout_seed`), broadcast_dropout: dropout on the
    probabilities with `masks.dropout_keep_mask` (the lse is of the softmax before it), as the reference's.
    bias / mask: None, or a dense float bias (bf16, f16 or f32) / bool mask [Bd, Hd, q_len, kv_len] (Bd batch or
    1, Hd heads or 1), read tile by tile on every visited block: logits = soft_cap(scale * q.k) + bias, then the
    score_mod; a False mask entry hides the key. logits_soft_cap: None, or c > 0: the soft cap c * tanh(x / c)
    before the bias (with neither, fold it into the score_mod instead, as the API does). Without a config, the
    default's ring shrinks until the dense tiles fit shared memory (`HopperConfig.fit`). A query tile visits only
    the key blocks the mask leaves something visible in, and reads no mask tile in those it leaves wholly visible.
    block_mask: None, or a `BlockMask` that the block ranges serve exactly at these tiles
    (`block_sparse.exact_by_ranges`: two runs of kept blocks per tile, one beside a mask program or dense mask;
    expand any other into `mask`): a tile visits only its kept blocks.
    `interpret`: None compiles for the GPU; an `InterpretGPUParams` (private in JAX 0.10-0.11:
    jax._src.pallas.mosaic_gpu.interpret.params) runs the kernel in the Mosaic GPU interpreter on CPU."""
    band = masks.Band.of(is_causal, local_window_size)
    q_len, kv_len, head_dim, head_dim_v = query.shape[1], key.shape[1], query.shape[3], value.shape[3]
    padded_dim, padded_dim_v = forward_head_dim(head_dim), forward_head_dim(head_dim_v)
    dense = DenseMods(bias is not None, mask is not None, logits_soft_cap, hide_outside_hull=block_mask is not None)
    tile_bytes = dense_tile_bytes(None if bias is None else bias.dtype, mask is not None)
    sparse = sparse_rows(q_segment_ids, mask_mod, mask, block_mask)
    config = config or default_config(padded_dim, kv_len, band, tile_bytes, padded_dim_v, sparse)
    own_tiles = tile_bytes or padded_dim_v != padded_dim  # the defaults fit shared memory without either
    if own_tiles and (
        config is None or config.smem_bytes(padded_dim, 2, tile_bytes, padded_dim_v) > H100_SHARED_MEMORY
    ):
        dense_tiles = f" with dense tiles of {tile_bytes} bytes per logit" if tile_bytes else ""
        raise ValueError(
            f"no forward tiles ({config or 'the default, shrunk'}) fit shared memory{dense_tiles} at head_dims "
            f"{head_dim} (query, key) and {head_dim_v} (value)"
        )
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None and (x.ndim != 4 or x.shape[2:] != (q_len, kv_len)):
            raise ValueError(f"{name} must be [batch or 1, heads or 1, {q_len}, {kv_len}], got {x.shape}")
    if block_mask is not None:
        block_mask.check(query.shape[0], query.shape[2], q_len, kv_len)
        reason = block_sparse.exact_by_ranges(
            block_mask,
            q_len=q_len,
            kv_len=kv_len,
            kv_heads=key.shape[2],
            query_tiles=((NUM_CONSUMERS * config.block_q, config.block_kv),),
            beside_other_masks=mask_mod is not None or mask is not None,
        )
        if reason is not None:
            raise ValueError(f"block_mask is not served by block ranges at {config}: {reason}; pass it as mask=")
    q_pad = round_up(q_len, NUM_CONSUMERS * config.block_q)
    kv_pad = round_up(kv_len, config.block_kv)
    q = pad_axis(pad_axis(query, 1, q_pad), 3, padded_dim)
    k = pad_axis(pad_axis(key, 1, kv_pad), 3, padded_dim)
    v = pad_axis(pad_axis(value, 1, kv_pad), 3, padded_dim_v)
    q_ids, kv_ids = masks.pad_segment_ids(q_segment_ids, kv_segment_ids, q_pad, kv_pad)
    mod_operands, programs = _mod_operands(
        score_mod, score_stacks, mask_mod, mask_stacks, mask_ranges, q_pad=q_pad, kv_pad=kv_pad
    )
    if mask_ranges is not None and mask_ranges.shape[2:] != (q_pad // (NUM_CONSUMERS * config.block_q), RANGE_FIELDS):
        raise ValueError(f"mask_ranges {mask_ranges.shape} are not at this call's tiles ({config})")
    mod_operands = sparse_operands(
        mod_operands, mask, block_mask, config, q_len=q_len, kv_len=kv_len, q_pad=q_pad, kv_pad=kv_pad
    )
    dropout, seed = kernel_dropout(dropout_rate, broadcast_dropout, dropout_seed, query.shape[0])
    out, lse = _forward_padded(
        q,
        k,
        v,
        q_ids,
        kv_ids,
        mod_operands,
        scale=scale,
        band=band,
        kv_len=kv_len,
        config=config,
        programs=programs,
        dropout=dropout,
        dropout_seed=seed,
        dense_arrays=dense_operands(bias, mask, q_pad, kv_pad),
        dense=dense,
        long_rows=long_rows(mask_mod, block_mask),
        interpret=interpret,
    )
    return out[:, :q_len, :, :head_dim_v], lse[:, :, :q_len]
