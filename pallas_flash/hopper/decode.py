"""Flash-decoding for Hopper (sm90), written with Pallas's Mosaic GPU backend: attention of Tq = 1..16 new
queries per sequence over a contiguous or paged KV cache, split-KV, as `pallas_flash.decode` defines it.

Decoding reads the whole cache for a handful of queries: it is bound by HBM bandwidth, not by the tensor
cores. The kernel is built to keep HBM busy:
  * GQA packing: the Tq queries of the G = heads / kv_heads query heads that read one kv head form one tile
    of Tq * G rows (row t * G + g), padded to the 64 rows of a wgmma, so each key block is read once for all
    of them. Tiles of more than 64 rows are cut into row tiles of 64 (adjacent CTAs, which read the same
    blocks, mostly from L2).
  * split-KV: the key blocks some query of sequence b can see, [first, last) from its length (and the
    window), are cut into runs of a fixed number of whole blocks (the most any sequence can see over
    `num_splits`), one per CTA; the grid is (tiles = splits * row tiles, batch, kv_heads). With few
    sequences and kv heads the splits fill the SMs (`default_num_splits`); in a ragged batch a short
    sequence's later splits have nothing to read, so no CTA holds many more blocks than another; no CTA
    reads a block past its sequence's length.
  * two warpgroups: a producer streams K and V blocks by TMA into a `num_stages`-deep shared-memory ring
    (each slot guarded by a "ready" barrier the TMA completes and a "free" barrier the consumer arrives on),
    so several blocks are in flight per CTA; a consumer computes S = Q K^T and O += P V with wgmma and the
    online softmax in float32, base 2 with the scale folded in (as the forward kernel, `fwd.py`).
  * paged caches: the producer reads a block's page ids from the block table as scalars before it waits for
    a free slot (the loads' latency passes under the wait) and loads the block with one TMA per page (pages
    smaller than a block) or one TMA from inside a page (pages of a block or more). Page and table indices
    are clamped into range.
  * a contiguous cache is never copied: a block that would run past the cache's end is loaded from
    `max_len - block_kv` (its keys before the block's own start are hidden), so every TMA stays in bounds.
Every block is masked (causal within the Tq queries aligned to the sequence's end, the window, ragged
lengths): the mask's few ALU operations per logit hide under the block's HBM time.

Each CTA writes its split's partial output (normalised over its own keys, float32; with one split, the output
itself in the query's dtype) and natural-log LSE; `pallas_flash.decode` merges the splits in XLA with
`merge_attention_states`. A row that sees no key in a split gets zeros and lse = -inf there.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import blocks
from pallas_flash.blocks import LOG2E
from pallas_flash.hopper.common import (
    SUPPORTED_DTYPES,
    dot_t,
    drain_ring,
    pad_axis,
    register_ops,
    round_up,
    swizzle_transforms,
    wgmma_operand,
)
from pallas_flash.hopper.config import H100_SHARED_MEMORY

ROWS = 64  # query rows of a tile: the M of one wgmma
HEAD_DIMS = (64, 128)
H100_SMS = 132  # the SM count when JAX does not report one (the interpreter)
# default_num_splits: at least this many key blocks per split (a CTA's fixed cost, its Q load, ring fill and
# epilogue, stays small beside its reads), at most MAX_SPLITS splits, and the fewest splits whose last wave
# of CTAs fills the SMs within WAVE_EFFICIENCY of the best split count's.
MIN_BLOCKS_PER_SPLIT = 8
MAX_SPLITS = 64
WAVE_EFFICIENCY = 0.95
_SMEM_SLACK = 3072  # barriers and alignment, as hopper/config.py's


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the Hopper decode kernel.

    Attributes:
      block_kv: keys per K/V block: 64, 128, 192 or 256 (the K of the P V wgmma comes in multiples of 64).
      num_stages: depth of the K/V shared-memory ring (>= 2); num_stages - 1 blocks are in flight while the
        consumer works on one.
    """

    block_kv: int = 64
    num_stages: int = 4

    def __post_init__(self):
        if not isinstance(self.block_kv, int) or not 64 <= self.block_kv <= 256 or self.block_kv % 64:
            raise ValueError(f"DecodeConfig.block_kv must be 64, 128, 192 or 256, got {self.block_kv!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"DecodeConfig.num_stages must be an int >= 2, got {self.num_stages!r}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """The Q tile, the K/V ring, the float32 output and LSE staging, and the barriers."""
        ring = 2 * self.num_stages * self.block_kv * head_dim * itemsize
        return ROWS * head_dim * itemsize + ring + ROWS * (head_dim + 1) * 4 + _SMEM_SLACK

    @classmethod
    def default(cls, head_dim: int) -> DecodeConfig:
        """64-key blocks and a 2-deep ring: the fastest of 2 to 5 slots and 64 to 256 keys per block on the
        H100 at head_dim 128 (B=32 x 8k and 1 x 64k, GQA 32/8) and at 64 (B=32, 8 heads, 1k to 8k keys), by
        2-8%; deeper rings and longer blocks gained nothing at 8k and lost on short caches."""
        return cls(block_kv=64, num_stages=2)


def unsupported_reason(dtype, head_dim: int, page_size: int | None, config: DecodeConfig | None = None):
    """Why the kernel cannot serve a cache of this dtype, head_dim and page size (None: contiguous), or None."""
    if not any(dtype == d for d in SUPPORTED_DTYPES):
        return f"dtype {jnp.dtype(dtype).name}: the kernel's wgmma reads bfloat16 or float16 caches"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}: the kernel serves head_dim {' or '.join(map(str, HEAD_DIMS))}"
    config = config or DecodeConfig.default(head_dim)
    smem = config.smem_bytes(head_dim, jnp.dtype(dtype).itemsize)
    if smem > H100_SHARED_MEMORY:
        return f"{config} needs {smem} bytes of shared memory at head_dim {head_dim}, more than {H100_SHARED_MEMORY}"
    block_kv = config.block_kv
    if page_size is not None and (page_size % 8 or (block_kv % page_size and page_size % block_kv)):
        return (
            f"page_size {page_size}: the kernel loads whole {block_kv}-key blocks by TMA, so a page must be a "
            f"multiple of 8 keys that divides {block_kv} or is a multiple of it (e.g. 16, 64, 256)"
        )
    return None


def default_num_splits(ctas: int, num_blocks: int, *, num_sms: int) -> int:
    """Splits of each sequence's keys when none are asked for: `ctas` CTAs per split (batch * kv_heads * row
    tiles), `num_blocks` the most key blocks a sequence can see. The fewest splits whose waves of CTAs keep
    the SMs busy (waves / ceil(waves) within WAVE_EFFICIENCY of the best count's), each of at least
    MIN_BLOCKS_PER_SPLIT blocks, at most MAX_SPLITS: many sequences get one split, one long sequence one per
    SM or so."""
    most = max(1, min(MAX_SPLITS, num_blocks // MIN_BLOCKS_PER_SPLIT))

    def efficiency(splits):
        waves = ctas * splits / num_sms
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= WAVE_EFFICIENCY * best)


def max_visible_blocks(*, q_len: int, window_left, block_kv: int, capacity: int) -> int:
    """The most key blocks one sequence's q_len queries can see: the cache's blocks, or fewer under a window
    (its left reach plus the queries' span, starting anywhere in a block)."""
    blocks = -(-capacity // block_kv)
    if window_left is None:
        return blocks
    return min(blocks, -(-(window_left + q_len) // block_kv) + 1)


def split_block_range(length, split, *, q_len: int, window_left, block_kv: int, capacity: int, num_splits: int):
    """This split's key blocks [lo, hi) (hi >= lo; may be empty) of a sequence holding `length` keys: the
    blocks some of its q_len queries may see, [first, last), in runs of a fixed number of blocks (the most
    any sequence can see, `max_visible_blocks`, over num_splits), split i taking the i-th run. A fixed run
    rather than each sequence's own span cut evenly: in a ragged batch every CTA then reads at most one
    run, and a short sequence's later splits read nothing, so the SMs' last wave is not held up by the
    longest sequences' splits. The earliest query (position length - q_len) has the window's leftmost key."""
    end = jnp.clip(length, 0, capacity)
    start = 0 if window_left is None else jnp.clip(length - q_len - window_left, 0, end)
    first, last = lax.div(start, block_kv), lax.div(end + block_kv - 1, block_kv)
    most = max_visible_blocks(q_len=q_len, window_left=window_left, block_kv=block_kv, capacity=capacity)
    per_split = -(-most // num_splits)
    lo = jnp.minimum(first + split * per_split, last)
    return lo, jnp.minimum(lo + per_split, last)


def _kernel(
    lengths_ref,
    order_ref,
    table_ref,
    q_ref,
    k_ref,
    v_ref,
    out_ref,
    lse_ref,
    scoped,
    *,
    scale: float,
    window_left,
    soft_cap,
    q_len: int,
    group: int,
    num_splits: int,
    row_tiles: int,
    page_size,
    config: DecodeConfig,
    interpreting: bool,
):
    """2 warpgroups ("wg"): 0 consumes, 1 produces. One CTA per (tile, kv head, sequence): tile = split *
    row_tiles + row tile.

    `interpreting`: JAX's Mosaic GPU interpreter (CPU) has no CPU rule for register layouts and no wgmma on a
    transposed shared-memory ref or a register operand: there Q K^T and P V are plain dots on the same
    shared-memory tiles and layouts are left out; the producer drains the ring at the end (`drain_ring`).

    lengths_ref int32 [batch]; order_ref int32 [batch]: the sequence of each CTA batch index (longest first
    where the grid takes more than one wave of CTAs, so that the last wave holds the shortest); table_ref
    None or int32 [batch, max_pages]; q_ref [batch, kv_heads, rows, d]
    (row t * group + g: query t of head kv_head * group + g); k_ref/v_ref [batch, max_len, kv_heads, d] or
    pages [num_pages, page_size, kv_heads, d]; out_ref float32 [splits, batch, kv_heads, q_len * group, d]
    (the real rows); lse_ref float32 [splits, batch, kv_heads, rows] (natural log)."""
    (q_smem, k_smem, v_smem, o_smem, lse_smem), q_ready, (k_ready, v_ready), (k_free, v_free) = scoped
    block_kv, num_stages = config.block_kv, config.num_stages
    paged = table_ref is not None
    capacity = table_ref.shape[1] * page_size if paged else k_ref.shape[1]
    tile, kv_head, batch = lax.axis_index("tiles"), lax.axis_index("kv_heads"), order_ref[lax.axis_index("batch")]
    split, row_tile = lax.div(tile, row_tiles), lax.rem(tile, row_tiles)
    length = lengths_ref[batch]
    lo, hi = split_block_range(
        length,
        split,
        q_len=q_len,
        window_left=window_left,
        block_kv=block_kv,
        capacity=capacity,
        num_splits=num_splits,
    )
    steps = hi - lo

    def block_start(block):
        """The first key of the rows a block's loads bring: its own first key, except the contiguous cache's
        overhanging last block, which is loaded from max_len - block_kv (in bounds)."""
        if paged:
            return block * block_kv
        return jnp.minimum(block * block_kv, capacity - block_kv)

    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _consumer():
        iota, zeros, _ = register_ops(interpreting)
        row_layout = plgpu.Layout.WGMMA.reduce(1)

        def layout(x, to):
            return x if interpreting else plgpu.layout_cast(x, to)

        plgpu.copy_gmem_to_smem(q_ref.at[batch, kv_head, pl.ds(row_tile * ROWS, ROWS)], q_smem, q_ready)
        shape = (ROWS, block_kv)
        # Row r holds query (r // group) of the Tq, at position length - q_len + r // group; padding rows
        # (r >= q_len * group) are computed and dropped.
        q_pos = length - q_len + lax.div(row_tile * ROWS + iota(shape, 0), group)
        # Logits in base-2 units: exp(x) = exp2(x * LOG2E); without a soft cap the scale folds in too.
        c = LOG2E if soft_cap is not None else scale * LOG2E

        def qk(slot):
            if interpreting:
                return dot_t(wgmma_operand(q_smem), wgmma_operand(k_smem.at[slot]))

            def scores(s_ref):
                plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return s_ref[...]

            return pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))

        def pv(acc, p16, slot):
            if interpreting:
                return acc + jnp.dot(p16, wgmma_operand(v_smem.at[slot]), preferred_element_type=jnp.float32)

            def update(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

            return pl.run_state(update)(plgpu.ACC.init(acc))

        def visible(block):
            k_pos = block_start(block) + iota(shape, 1)
            seen = jnp.logical_and(k_pos <= q_pos, k_pos >= block * block_kv)  # the latter: a slid block
            if window_left is not None:
                seen = jnp.logical_and(seen, k_pos >= q_pos - window_left)
            return seen

        def step(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])
            s = qk(slot)
            plgpu.barrier_arrive(k_free.at[slot])
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s * (scale / soft_cap))
            s = jnp.where(visible(lo + i), s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * c)  # c > 0: max(c * s) = c * max(s)
            shift = blocks.safe_exp_shift(m_new)  # a row that has seen no key yet: exp2 gives 0, not NaN
            alpha = jnp.exp2(m - shift)
            p = jnp.exp2(s * c - lax.broadcast_in_dim(shift, shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_ready.at[slot])
            acc = pv(acc, p.astype(q_smem.dtype), slot)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        m = layout(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
        l = layout(jnp.zeros((ROWS,), jnp.float32), row_layout)
        plgpu.barrier_wait(q_ready)
        acc, m, l = lax.fori_loop(0, steps, step, (zeros((ROWS, q_smem.shape[-1])), m, l))
        empty = l == 0.0  # saw no key in this split: zeros and lse = -inf, never NaN
        inv_l = jnp.where(empty, 0.0, 1.0 / l)
        o_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(o_smem.dtype)
        lse_smem[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(l)) * blocks.LN2)
        plgpu.commit_smem()

        def store(n: int):  # the tile's first n rows: only real rows go to HBM (Tq * G may be far below 64)
            rows = pl.ds(row_tile * ROWS, n)
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, n)], out_ref.at[split, batch, kv_head, rows])

        last_rows = out_ref.shape[3] - (row_tiles - 1) * ROWS  # real rows of the last row tile
        if row_tiles > 1:
            pl.when(row_tile < row_tiles - 1)(lambda: store(ROWS))
        pl.when(row_tile == row_tiles - 1)(lambda: store(last_rows))
        # The LSE keeps the padded rows: a TMA moves multiples of 16 bytes.
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, batch, kv_head, pl.ds(row_tile * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        if paged:
            rows_per_copy = min(page_size, block_kv)
            max_pages, num_pages = table_ref.shape[1], k_ref.shape[0]

            def sources(block):
                """(page, first row) of each of the block's copies, clamped into the table and the cache."""
                out = []
                for j in range(block_kv // rows_per_copy):
                    key = block * block_kv + j * rows_per_copy
                    page = table_ref[batch, jnp.minimum(lax.div(key, page_size), max_pages - 1)]
                    out.append((jnp.clip(page, 0, num_pages - 1), lax.rem(key, page_size)))
                return tuple(out)
        else:
            rows_per_copy = block_kv

            def sources(block):
                return ((batch, block_start(block)),)

        @pl.loop(0, steps)
        def _load(i):
            slot = lax.rem(i, num_stages)
            # Paged: the table loads are issued before the wait for a free slot, so their latency passes
            # under it.
            copies = sources(lo + i)
            for ref, ring, ready, free in ((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)):
                pl.when(i >= num_stages)(lambda: plgpu.barrier_wait(free.at[slot]))
                for j, (first, row) in enumerate(copies):
                    plgpu.copy_gmem_to_smem(
                        ref.at[first, pl.ds(row, rows_per_copy), kv_head],
                        ring.at[slot, pl.ds(j * rows_per_copy, rows_per_copy)],
                        ready.at[slot],
                    )

        if interpreting:
            drain_ring((k_free, v_free), num_stages=num_stages, steps=steps)


def _partials(
    q, key_cache, value_cache, lengths, order, block_table, *, kernel_args, splits, row_tiles, config, interpret
):
    """The kernel on packed queries q [batch, kv_heads, row_tiles * ROWS, d]: (out, lse) per split."""
    batch, kv_heads, rows, head_dim = q.shape
    real_rows = kernel_args["q_len"] * kernel_args["group"]
    dtype = q.dtype
    paged = block_table is not None
    transforms = swizzle_transforms()
    copies = config.block_kv // min(kernel_args["page_size"], config.block_kv) if paged else 1
    # Partials to merge stay float32; a single split's output is the result, written in the query's dtype
    # (no conversion kernel after it).
    out_dtype = dtype if splits == 1 else jnp.float32

    # Named for profiles and traces (Mosaic GPU calls the kernel `<name>_mosaic_gpu_kernel`).
    def flash_decode_sm90(*refs):
        lengths_ref, order_ref, table_ref = refs[0], refs[1], (refs[2] if paged else None)
        q_ref, k_ref, v_ref, out_ref, lse_ref = refs[2 + paged :]
        ring = plgpu.SMEM((config.num_stages, config.block_kv, head_dim), dtype, transforms=transforms)
        body = functools.partial(
            _kernel,
            **kernel_args,
            num_splits=splits,
            row_tiles=row_tiles,
            config=config,
            interpreting=interpret is not None,
        )
        pl.run_scoped(
            lambda *scoped: body(lengths_ref, order_ref, table_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, scoped),
            (
                plgpu.SMEM((ROWS, head_dim), dtype, transforms=transforms),
                ring,
                ring,
                plgpu.SMEM((ROWS, head_dim), out_dtype),
                plgpu.SMEM((ROWS,), jnp.float32),
            ),
            plgpu.Barrier(),
            (plgpu.Barrier(num_arrivals=copies, num_barriers=config.num_stages),) * 2,
            (plgpu.Barrier(num_barriers=config.num_stages),) * 2,
            collective_axes="wg",
        )

    operands = (lengths, order) + ((block_table,) if paged else ()) + (q, key_cache, value_cache)
    return plgpu.kernel(
        flash_decode_sm90,
        out_type=(
            jax.ShapeDtypeStruct((splits, batch, kv_heads, real_rows, head_dim), out_dtype),
            jax.ShapeDtypeStruct((splits, batch, kv_heads, rows), jnp.float32),
        ),
        # Mosaic GPU launches the last grid axis fastest: a sequence's kv heads run side by side, and the
        # sequences go in `order`.
        grid=(splits * row_tiles, batch, kv_heads),
        grid_names=("tiles", "batch", "kv_heads"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({} if interpret is None else dict(interpret=interpret)),
    )(*operands)


@functools.partial(
    jax.jit, static_argnames=("scale", "window_left", "logits_soft_cap", "num_splits", "config", "interpret")
)
def hopper_decode_partials(
    query,
    key_cache,
    value_cache,
    lengths,
    block_table=None,
    *,
    scale: float,
    window_left: int | None = None,
    logits_soft_cap: float | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    interpret=None,
):
    """Split-KV decode attention on Hopper, before the merge: `DecodeImplementation.run`'s contract
    (pallas_flash/decode.py) for bfloat16/float16 at head_dim 64 or 128, with the options as arguments.

    query [batch, Tq, heads, head_dim]; key_cache, value_cache [batch, max_len, kv_heads, head_dim], or pages
    [num_pages, page_size, kv_heads, head_dim] with block_table int32 [batch, max_pages]; lengths int32
    [batch]. num_splits: None (`default_num_splits`) or an upper bound. `interpret`: None compiles for the
    GPU; an `InterpretGPUParams` (`_compat.mosaic_gpu_interpret_params`) runs the kernel in the Mosaic GPU
    interpreter on CPU.

    Returns (out [splits, batch, Tq, heads, head_dim], lse [splits, batch, Tq, heads] float32): each split's
    output normalised over its own keys (float32; in query's dtype where there is one split, which needs no
    merge) and its natural-log LSE (zeros and -inf where it holds none of a query's keys), as
    `merge_attention_states` takes them."""
    batch, q_len, heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    config = config or DecodeConfig.default(head_dim)
    paged = block_table is not None
    page_size = key_cache.shape[1] if paged else None
    reason = unsupported_reason(query.dtype, head_dim, page_size, config)
    if reason is not None:
        raise ValueError(f"hopper_decode_partials cannot serve this call: {reason}")
    if not paged and key_cache.shape[1] < config.block_kv:  # a cache shorter than one block: a cheap pad
        key_cache, value_cache = (pad_axis(x, 1, config.block_kv) for x in (key_cache, value_cache))
    capacity = block_table.shape[1] * page_size if paged else key_cache.shape[1]
    rows = round_up(q_len * group, ROWS)
    row_tiles = rows // ROWS
    most = max_visible_blocks(q_len=q_len, window_left=window_left, block_kv=config.block_kv, capacity=capacity)
    # One CTA per SM: the two warpgroups' registers (a 64 x head_dim float32 accumulator and a 64 x block_kv
    # score tile per consumer thread) take the SM's register file, whatever the shared memory would allow.
    num_sms = H100_SMS if interpret is not None else getattr(jax.devices()[0], "core_count", H100_SMS)
    if num_splits is None:
        num_splits = default_num_splits(batch * kv_heads * row_tiles, most, num_sms=num_sms)
    splits = max(1, min(num_splits, most))
    lengths = lengths.astype(jnp.int32)
    # More CTAs than fit at once: the longest sequences' first (a stable sort), so that the last wave
    # holds short ones, not a long sequence that keeps the GPU waiting after the others are done.
    waves = batch > 1 and splits * row_tiles * kv_heads * batch > num_sms
    order = jnp.argsort(-lengths, stable=True).astype(jnp.int32) if waves else jnp.arange(batch, dtype=jnp.int32)
    # [batch, Tq, kv_heads * group, d] -> [batch, kv_heads, Tq * group (padded), d]: a kv head's tile.
    q = query.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q = pad_axis(q.reshape(batch, kv_heads, q_len * group, head_dim), 2, rows)
    out, lse = _partials(
        q,
        key_cache,
        value_cache,
        lengths,
        order,
        None if block_table is None else block_table.astype(jnp.int32),
        kernel_args=dict(
            scale=scale,
            window_left=window_left,
            soft_cap=logits_soft_cap,
            q_len=q_len,
            group=group,
            page_size=page_size,
        ),
        splits=splits,
        row_tiles=row_tiles,
        config=config,
        interpret=interpret,
    )
    out = out.reshape(splits, batch, kv_heads, q_len, group, head_dim)
    lse = lse[:, :, :, : q_len * group].reshape(splits, batch, kv_heads, q_len, group)
    out = out.transpose(0, 1, 3, 2, 4, 5).reshape(splits, batch, q_len, heads, head_dim)
    return out, lse.transpose(0, 1, 3, 2, 4).reshape(splits, batch, q_len, heads)
