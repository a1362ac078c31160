"""Block-sparse attention: which (query block, key block) pairs are computed at all.

A `BlockMask` is static structure, known before the call: a host-side numpy boolean array
[batch or 1, heads or 1, num_q_blocks, num_kv_blocks] and its block sizes. Query i sees key j only if
mask[b, h, i // block_q, j // block_kv]; this is ANDed with the causal band, the window, segment ids and
lengths. The Pallas kernels never load a block marked False, forward or backward; the XLA chunked path
and the reference apply the expanded mask.

The kernels' side lives here too (`visit_tables`): per kernel row (a query block in the forward and dQ
kernels, a key block in the dK/dV kernel) the list of blocks to visit, computed on the host from the block
mask, the band, the padded tail and the kernels' own block sizes, which must divide the mask's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from pallas_flash import masks

MASK_BLOCK_MULTIPLE = 16  # the kernels' smallest tile: their blocks must divide the mask's blocks
# A visit-table row: [number of fully visible blocks, number of blocks, block indices ..., padding].
VISITS_HEADER = 2


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _positive_int(name, value):
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _num_blocks(length: int, block: int) -> int:
    return -(-length // block)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """A block-level attention mask with its block sizes.

    Attributes:
      mask: bool [num_q_blocks, num_kv_blocks], or [batch or 1, heads or 1, num_q_blocks, num_kv_blocks]
        (per example and/or per query head; stored as the 4-d form, read-only). Any array-like of bools.
      block_q, block_kv: tokens per block; multiples of 16 (the kernels' tiles must divide them).
    The last query/key block may be partial: a mask for q_len tokens has ceil(q_len / block_q) rows.
    Hashable (by value), so it can be a static argument of `jax.jit`.
    """

    mask: np.ndarray
    block_q: int = 128
    block_kv: int = 128

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = _positive_int(f"BlockMask.{name}", getattr(self, name))
            if value % MASK_BLOCK_MULTIPLE:
                raise ValueError(f"BlockMask.{name} must be a multiple of {MASK_BLOCK_MULTIPLE}, got {value}")
            object.__setattr__(self, name, value)
        try:
            mask = np.asarray(self.mask)
        except Exception as e:  # a tracer: the structure must be known on the host
            raise TypeError(
                f"BlockMask.mask must be a concrete boolean array (numpy), got {type(self.mask).__name__}"
            ) from e
        if mask.dtype != np.bool_:
            raise TypeError(f"BlockMask.mask must have dtype bool, got {mask.dtype}")
        if mask.ndim == 2:
            mask = mask[None, None]
        if mask.ndim != 4 or 0 in mask.shape:
            raise ValueError(
                "BlockMask.mask must be [num_q_blocks, num_kv_blocks] or [batch or 1, heads or 1, "
                f"num_q_blocks, num_kv_blocks] with no empty axis, got shape {tuple(mask.shape)}"
            )
        mask = np.array(mask, dtype=bool, copy=True)
        mask.flags.writeable = False
        object.__setattr__(self, "mask", mask)

    def __eq__(self, other):
        return (
            isinstance(other, BlockMask)
            and (self.block_q, self.block_kv) == (other.block_q, other.block_kv)
            and self.mask.shape == other.mask.shape
            and bool(np.array_equal(self.mask, other.mask))
        )

    def __hash__(self):
        return hash((self.block_q, self.block_kv, self.mask.shape, self.mask.tobytes()))

    @property
    def shape(self) -> tuple:
        """(batch or 1, heads or 1, num_q_blocks, num_kv_blocks)."""
        return self.mask.shape

    def density(self) -> float:
        """Fraction of blocks marked True (blocks counted whole, also a partial last block)."""
        return float(self.mask.mean())

    def expand(self, q_len: int, kv_len: int) -> np.ndarray:
        """The token-level mask, bool [batch or 1, heads or 1, q_len, kv_len] (for the reference: N^2)."""
        self.check_lengths(q_len, kv_len)
        rows = np.arange(q_len) // self.block_q
        cols = np.arange(kv_len) // self.block_kv
        return self.mask[:, :, rows][:, :, :, cols]

    def check_lengths(self, q_len: int, kv_len: int) -> None:
        want = (_num_blocks(q_len, self.block_q), _num_blocks(kv_len, self.block_kv))
        if self.mask.shape[2:] != want:
            raise ValueError(
                f"block_mask has {self.mask.shape[2]} x {self.mask.shape[3]} blocks of "
                f"{self.block_q} x {self.block_kv}; q_len={q_len}, kv_len={kv_len} need "
                f"{want[0]} x {want[1]}"
            )

    def check(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """ValueError unless the mask fits queries [batch, q_len, heads, ...] and keys of kv_len."""
        self.check_lengths(q_len, kv_len)
        if self.mask.shape[0] not in (1, batch) or self.mask.shape[1] not in (1, heads):
            raise ValueError(
                f"block_mask has batch {self.mask.shape[0]} and heads {self.mask.shape[1]}; "
                f"they must be 1 or the query's batch {batch} and heads {heads}"
            )

    # ------------------------------------------------------------------------------------------ builders

    @classmethod
    def full(cls, q_len: int, kv_len: int, *, block_q: int = 128, block_kv: int = 128) -> BlockMask:
        """Every block: the dense baseline of a block-sparse call."""
        return cls._build(q_len, kv_len, block_q, block_kv, lambda first, last, j: np.ones_like(j, bool))

    @classmethod
    def causal(cls, q_len: int, kv_len: int, *, block_q: int = 128, block_kv: int = 128) -> BlockMask:
        """The blocks that hold a key j <= query i (top-left alignment, as `is_causal`). At block level the
        diagonal blocks are whole: pass `is_causal=True` too for the token-level causal mask."""
        return cls._build(q_len, kv_len, block_q, block_kv, lambda first, last, j: j <= last)

    @classmethod
    def local(
        cls, q_len: int, kv_len: int, window_blocks, *, causal: bool = False, block_q: int = 128, block_kv: int = 128
    ) -> BlockMask:
        """A sliding window of key blocks: those overlapping a query block's own positions plus `left` key
        blocks before and `right` after. `window_blocks`: int w (left = right = w) or (left, right);
        `causal` sets right = 0."""
        left, right = _window(window_blocks)
        right = 0 if causal else right
        return cls._build(
            q_len, kv_len, block_q, block_kv, lambda first, last, j: (j >= first - left) & (j <= last + right)
        )

    @classmethod
    def strided(
        cls, q_len: int, kv_len: int, stride: int, *, causal: bool = False, block_q: int = 128, block_kv: int = 128
    ) -> BlockMask:
        """Sparse Transformer's strided pattern at block level: key blocks j with (d - j) % stride == 0,
        where d is the key block on the query block's diagonal, so every query block sees its own
        diagonal block and every stride-th block from it (density about 1 / stride)."""
        stride = _positive_int("stride", stride)
        keep = lambda first, last, j: ((first - j) % stride == 0) | ((j >= first) & (j <= last))
        mask = cls._build(q_len, kv_len, block_q, block_kv, keep)
        return mask._and_causal(q_len, kv_len) if causal else mask

    @classmethod
    def global_local(
        cls,
        q_len: int,
        kv_len: int,
        num_global: int,
        window,
        *,
        causal: bool = False,
        block_q: int = 128,
        block_kv: int = 128,
    ) -> BlockMask:
        """BigBird/Longformer-style: a local window of `window` key blocks (int or (left, right), as in
        `local`), plus `num_global` global blocks: every query block sees the first `num_global` key
        blocks, and the first `num_global` query blocks see every key block."""
        if not _is_int(num_global) or num_global < 0:
            raise ValueError(f"num_global must be an int >= 0, got {num_global!r}")
        local = cls.local(q_len, kv_len, window, block_q=block_q, block_kv=block_kv).mask.copy()
        local[:, :, :, :num_global] = True
        local[:, :, :num_global, :] = True
        mask = cls(local, block_q, block_kv)
        return mask._and_causal(q_len, kv_len) if causal else mask

    @classmethod
    def _build(cls, q_len, kv_len, block_q, block_kv, keep) -> BlockMask:
        """`keep(first, last, j)` -> bool [num_q_blocks, num_kv_blocks], with first/last the key blocks that
        hold query block i's first and last positions (the block diagonal when block_q != block_kv)."""
        q_len, kv_len = _positive_int("q_len", q_len), _positive_int("kv_len", kv_len)
        block_q, block_kv = _positive_int("block_q", block_q), _positive_int("block_kv", block_kv)
        rows = np.arange(_num_blocks(q_len, block_q))[:, None]
        first = rows * block_q // block_kv
        last = (np.minimum((rows + 1) * block_q, q_len) - 1) // block_kv
        j = np.arange(_num_blocks(kv_len, block_kv))[None, :]
        return cls(np.broadcast_to(keep(first, last, j), (rows.size, j.size)), block_q, block_kv)

    def _and_causal(self, q_len, kv_len) -> BlockMask:
        causal = BlockMask.causal(q_len, kv_len, block_q=self.block_q, block_kv=self.block_kv)
        return BlockMask(self.mask & causal.mask, self.block_q, self.block_kv)


def _window(window_blocks):
    if _is_int(window_blocks):
        window_blocks = (window_blocks, window_blocks)
    ok = (
        isinstance(window_blocks, tuple)
        and len(window_blocks) == 2
        and all(_is_int(w) and w >= 0 for w in window_blocks)
    )
    if not ok:
        raise ValueError(
            f"window must be an int >= 0 or a tuple (left, right) of ints >= 0 (in blocks), got {window_blocks!r}"
        )
    return int(window_blocks[0]), int(window_blocks[1])


# ------------------------------------------------------------------------- the XLA paths' token-level mask


def token_mask(block_mask: BlockMask, q_pos, k_pos, kv_heads: int):
    """Token-level visibility of keys `k_pos` [k] to queries `q_pos` [q] (int arrays; positions past the
    mask's last block read its last block, callers mask them as padding): bool [batch or 1, kv_heads or 1,
    group or 1, q, k], the layout of the XLA paths' logits. Costs O(q * k): the chunked path calls it per
    key chunk."""
    mask = jnp.asarray(block_mask.mask)
    rows = jnp.minimum(q_pos // block_mask.block_q, mask.shape[2] - 1)
    cols = jnp.minimum(k_pos // block_mask.block_kv, mask.shape[3] - 1)
    return grouped(jnp.take(jnp.take(mask, cols, axis=3), rows, axis=2), kv_heads)


def grouped(tokens, kv_heads: int):
    """[b, heads or 1, q, k] -> [b, kv_heads or 1, group or 1, q, k] (query head h = kv head h // group)."""
    if tokens.shape[1] == 1:
        return tokens[:, :, None]
    return tokens.reshape(tokens.shape[0], kv_heads, tokens.shape[1] // kv_heads, *tokens.shape[2:])


def combine(mask, block_tokens):
    """AND of a `masks.visible` result (None: all visible) and a `token_mask`."""
    return block_tokens if mask is None else jnp.logical_and(mask, block_tokens)


# ------------------------------------------------------------------------------------ the kernels' tables


def kernel_block(block: int, mask_block: int) -> int:
    """The largest power of two <= `block` that divides `mask_block`: a kernel tile then never straddles
    two mask blocks, so the block mask is uniform over it."""
    return min(block, mask_block & -mask_block)


def visible_tiles(block_mask: BlockMask, *, block_q: int, block_kv: int, q_pad: int, kv_pad: int) -> np.ndarray:
    """The block mask at the resolution of kernel tiles of block_q x block_kv over padded lengths: bool
    [batch or 1, heads or 1, q_pad // block_q, kv_pad // block_kv]. The kernel blocks must divide the mask's,
    so each tile lies in one mask block."""
    if block_mask.block_q % block_q or block_mask.block_kv % block_kv:
        raise ValueError(
            f"kernel blocks {block_q} x {block_kv} must divide the block mask's "
            f"{block_mask.block_q} x {block_mask.block_kv}"
        )
    rows = np.arange(q_pad // block_q) * block_q // block_mask.block_q
    cols = np.arange(kv_pad // block_kv) * block_kv // block_mask.block_kv
    return block_mask.mask[:, :, rows][:, :, :, cols]


@functools.lru_cache(maxsize=64)
def visit_tables(
    block_mask: BlockMask,
    *,
    block_q: int,
    block_kv: int,
    q_pad: int,
    kv_pad: int,
    kv_len: int,
    band: masks.Band,
    always_mask: bool,
):
    """The blocks each kernel row visits, for kernel tiles of block_q x block_kv over padded lengths.

    Returns (by_query, by_key), int32 numpy arrays [batch or 1, heads or 1, rows, width]: by_query has a row
    per query block (the forward and dQ kernels), by_key one per key block (the dK/dV kernel). A row is
    [n_full, n_visits, block indices...]: the first n_full blocks are visible to every pair of the tile
    (no token mask needed), the next n_visits - n_full only partly (band edges, the padded key tail, or
    every tile when `always_mask`, i.e. segment ids); blocks not listed are never loaded. `width` is a
    power of two (Triton block shapes) holding the longest row.
    """
    rows, cols = np.arange(q_pad // block_q), np.arange(kv_pad // block_kv)
    allowed = visible_tiles(block_mask, block_q=block_q, block_kv=block_kv, q_pad=q_pad, kv_pad=kv_pad)
    q_first, q_last = rows[:, None] * block_q, rows[:, None] * block_q + block_q - 1
    k_first, k_last = cols[None, :] * block_kv, cols[None, :] * block_kv + block_kv - 1
    # Some pair of the tile visible / every pair visible, under the band and the padded tail.
    some = k_first < kv_len
    every = np.broadcast_to(k_last < kv_len, some.shape) & (not always_mask)
    if band.right is not None:
        some, every = some & (k_first <= q_last + band.right), every & (k_last <= q_first + band.right)
    if band.left is not None:
        some, every = some & (k_last >= q_first - band.left), every & (k_first >= q_last - band.left)
    # 2: visit without the token mask, 1: visit with it, 0: skip.
    kind = allowed * (some.astype(np.int32) + (some & every))
    return _table(kind), _table(np.swapaxes(kind, 2, 3))


def _table(kind):
    """[b, h, rows, cols] of 0/1/2 -> [b, h, rows, width] rows of [n_full, n_visits, indices...]."""
    order = np.argsort(-kind, axis=-1, kind="stable")  # fully visible first, ascending within each kind
    n_full, n_visits = (kind == 2).sum(-1), (kind > 0).sum(-1)
    longest = int(n_visits.max())
    width = 1 << (VISITS_HEADER + longest - 1).bit_length()
    table = np.zeros(kind.shape[:3] + (width,), np.int32)
    table[..., 0], table[..., 1] = n_full, n_visits
    table[..., VISITS_HEADER : VISITS_HEADER + longest] = order[..., :longest]
    return table


# ------------------------------------------------------------------------------ the Hopper kernels' ranges


def tile_classes(
    block_mask: BlockMask, *, q_len: int, kv_len: int, block_q: int, block_kv: int, q_pad: int, kv_pad: int
):
    """The block mask at kernel tiles of block_q x block_kv over padded lengths, as block classes (those of
    `mods.block_classes`): numpy bool (anything, everything) [batch or 1, heads or 1, q_pad // block_q,
    kv_pad // block_kv]: whether the tile covers some / only positions in kept blocks. Any tile size: a tile may
    straddle mask blocks. Positions past q_len or kv_len count for neither (a tile wholly past them: nothing,
    and so never "every")."""
    kept = np.zeros(block_mask.shape[:2] + (block_mask.shape[2] + 1, block_mask.shape[3] + 1), np.int64)
    kept[:, :, 1:, 1:] = block_mask.mask.cumsum(2).cumsum(3)  # kept blocks in [0, i) x [0, j)

    def spans(pad: int, block: int, length: int, mask_block: int):
        """Per tile, the mask blocks [lo, hi) its real positions fall in (empty past the length)."""
        first = np.arange(pad // block) * block
        real = first < length
        lo = np.where(real, first // mask_block, 0)
        hi = np.where(real, (np.minimum(first + block, length) - 1) // mask_block + 1, 0)
        return lo, hi

    r_lo, r_hi = spans(q_pad, block_q, q_len, block_mask.block_q)
    c_lo, c_hi = spans(kv_pad, block_kv, kv_len, block_mask.block_kv)
    r_lo, r_hi, c_lo, c_hi = r_lo[:, None], r_hi[:, None], c_lo[None, :], c_hi[None, :]
    count = kept[:, :, r_hi, c_hi] - kept[:, :, r_lo, c_hi] - kept[:, :, r_hi, c_lo] + kept[:, :, r_lo, c_lo]
    return count > 0, count == (r_hi - r_lo) * (c_hi - c_lo)


# Block ranges carry one gap (`hopper.common.Gap`): a tile's kept blocks may form two runs, where the block mask's
# gap is the only one the ranges must keep. A mask program or dense mask beside it may own the longer gap, so then
# each tile's kept blocks must form one run.
MAX_RUNS = 2


def exact_by_ranges(
    block_mask: BlockMask,
    *,
    q_len: int,
    kv_len: int,
    kv_heads: int,
    query_tiles=(),
    key_tiles=(),
    beside_other_masks: bool = False,
) -> str | None:
    """None if kernels that visit a contiguous range of blocks per tile, stepping over one gap inside it (the Hopper
    kernels' block ranges), serve the block mask exactly at these tiles without any token-level mask, else why not:
    each tile's kept blocks must form at most MAX_RUNS runs (1 `beside_other_masks`, a mask program or dense mask
    whose gap the ranges may keep instead) and cover the tiles of those runs wholly. query_tiles: (rows, cols) of
    query-major tiles (rows queries by cols keys: the forward's and the dQ pass's); key_tiles: (rows, cols) of
    key-major ones (rows keys by cols queries over every query head of a kv head's group: the dK/dV pass's)."""
    max_runs = 1 if beside_other_masks else MAX_RUNS
    for major, tiles in (("query", query_tiles), ("key", key_tiles)):
        for rows, cols in tiles:
            straddles, runs = _tile_runs(block_mask, q_len=q_len, kv_len=kv_len, kv_heads=kv_heads, major=major,
                                         rows=rows, cols=cols)  # fmt: skip
            if straddles:
                return f"a {rows} x {cols} {major}-major tile straddles kept and dropped mask blocks"
            if runs > max_runs:
                return (
                    f"a {major} tile's kept blocks of {rows} x {cols} tiles form {runs} runs, over the {max_runs} "
                    "block ranges serve"
                )
    return None


def most_runs(block_mask: BlockMask, *, q_len: int, kv_len: int, kv_heads: int, major: str, rows: int, cols: int):
    """The most runs of kept blocks in any tile of rows x cols, `major` "query" or "key" (as `exact_by_ranges`'
    tiles): above 1, the kernel must step over the gap between them."""
    return _tile_runs(block_mask, q_len=q_len, kv_len=kv_len, kv_heads=kv_heads, major=major, rows=rows, cols=cols)[1]


def _tile_runs(block_mask: BlockMask, *, q_len: int, kv_len: int, kv_heads: int, major: str, rows: int, cols: int):
    """(whether a tile straddles kept and dropped mask blocks, the most runs of kept tiles along any tile row)."""
    block_q, block_kv = (rows, cols) if major == "query" else (cols, rows)
    q_pad, kv_pad = -(-q_len // block_q) * block_q, -(-kv_len // block_kv) * block_kv
    anything, everything = tile_classes(
        block_mask, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv, q_pad=q_pad, kv_pad=kv_pad
    )
    if major == "key":  # [.., key tile, query tile], over the heads of each kv head's group
        anything, everything = np.swapaxes(anything, 2, 3), np.swapaxes(everything, 2, 3)
        if anything.shape[1] > 1:
            group = (anything.shape[0], kv_heads, -1, *anything.shape[2:])
            anything, everything = anything.reshape(group).any(2), everything.reshape(group).all(2)
    starts = (anything[..., 1:] & ~anything[..., :-1]).sum(-1) + anything[..., 0]
    return bool((anything & ~everything).any()), int(starts.max(initial=0))
