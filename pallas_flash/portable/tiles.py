"""Tile-level helpers shared by the portable forward and backward kernels: the matmul, the tile mask, the
blocks a program visits (a band's range from `blocks`, or a visit table), the score modifiers, and the
score_mod / mask_mod programs on tiles."""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash import blocks, masks
from pallas_flash import mods as programs
from pallas_flash._compat import SQUEEZED
from pallas_flash.block_sparse import VISITS_HEADER


def dot(a, b, *, trans_b: bool = False):
    """a @ b (or a @ b^T) on a tile with float32 accumulation; float32 operands use IEEE precision (not tf32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (((1,), (1 if trans_b else 0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def tile_mask(
    q_start,
    k_start,
    block_q: int,
    block_kv: int,
    *,
    band: masks.Band,
    kv_len: int,
    q_segment=None,
    kv_segment=None,
    keys_major: bool = False,
):
    """Visibility of the tile whose first query/key positions are q_start/k_start: [block_q, block_kv],
    or [block_kv, block_q] with `keys_major` (the transposed tiles of the dK/dV kernel). `q_segment`
    [block_q] and `kv_segment` [block_kv] are the tile's segment ids, if any."""
    shape, q_axis = ((block_kv, block_q), 1) if keys_major else ((block_q, block_kv), 0)
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    segments = {}
    if q_segment is not None:
        q_seg, kv_seg = (
            (q_segment[None, :], kv_segment[:, None]) if keys_major else (q_segment[:, None], kv_segment[None, :])
        )
        segments = dict(q_segment=q_seg, kv_segment=kv_seg)
    return masks.visible(q_pos, k_pos, band=band, kv_len=kv_len, **segments)


def visit_band(visit, carry, block_range):
    """`visit(block, carry, masked=...)` over a band's blocks, `block_range` = (lo, unmasked_lo, unmasked_hi,
    hi) from `kv_block_range` / `q_block_range`: only the blocks on the band's edges pay for the mask."""
    lo, unmasked_lo, unmasked_hi, hi = block_range
    carry = lax.fori_loop(lo, unmasked_lo, functools.partial(visit, masked=True), carry)
    carry = lax.fori_loop(unmasked_lo, unmasked_hi, functools.partial(visit, masked=False), carry)
    return lax.fori_loop(unmasked_hi, hi, functools.partial(visit, masked=True), carry)


def visit_blocks(read, visit, carry):
    """`visit(block, carry, masked=...)` over the blocks of one row of a visit table
    (`block_sparse.visit_tables`), whose entry i is `read(i)`: the fully visible blocks without the token
    mask, then the partly visible ones with it. Blocks not in the row are never loaded. The trip counts are
    data (int32 scalars read from the table), so the loops are dynamic: no Python control flow on them."""
    n_full, n_visits = read(0), read(1)

    def body(masked):
        return lambda i, c: visit(read(VISITS_HEADER + i), c, masked=masked)

    carry = lax.fori_loop(0, n_full, body(False), carry)
    return lax.fori_loop(n_full, n_visits, body(True), carry)


def visits_spec(shape, row_of, *, group=None):
    """BlockSpec of a visit table [batch or 1, heads or 1, rows, width] for a grid (row, batch, head): the
    kernel sees the row `row_of(program 0 id)` of its batch and head as a [width] ref. With `group`, the
    grid's head is a kv head and the kernel sees the rows of its `group` query heads, [group or 1, width]
    (dK/dV). A table shared by every example or head is read at index 0 there."""
    per_batch, per_head = shape[0] > 1, shape[1] > 1

    def index(r, b, h):
        return (b if per_batch else 0, h if per_head else 0, row_of(r), 0)

    heads = SQUEEZED if group is None else (group if per_head else 1)
    return pl.BlockSpec((SQUEEZED, heads, SQUEEZED, shape[3]), index)


def launch_order(program, num_q_blocks: int, reverse: bool):
    """Query block handled by a program. With a causal band, query blocks near the end visit the most
    key blocks: launching them first keeps the longest programs from trailing behind in the last wave."""
    return num_q_blocks - 1 - program if reverse else program


# ---- Score modifiers on a tile (see masks.py for their definition) ------------------------------------------


class ModRefs(typing.NamedTuple):
    """The kernels' refs to the score modifiers' operands, None where absent (see `mod_operands`);
    score_stacks / mask_stacks: the refs of a program's (rows_int, rows_float, cols_int, cols_float)."""

    bias: typing.Any = None
    mask: typing.Any = None
    slopes: typing.Any = None
    seed: typing.Any = None
    score_stacks: tuple = (None,) * 4
    mask_stacks: tuple = (None,) * 4


# The order of `mods.Staged.stacks`'s four stacks.
STACKS = (("row", "int"), ("row", "float"), ("col", "int"), ("col", "float"))


class ProgramStacks(typing.NamedTuple):
    """The score_mod's and the mask_mod's staged values for every position (`mods.Staged.stacks`, unpadded):
    each (rows_int, rows_float, cols_int, cols_float), None for a stack the program does not stage."""

    score: tuple = (None,) * 4
    mask: tuple = (None,) * 4


@functools.lru_cache(maxsize=64)
def staged(program):
    """A score_mod / mask_mod `mods.Program` split for tiles (`mods.stage`), or None without one. The API
    sends the portable kernels only programs that stage."""
    if program is None:
        return None
    result, reason = programs.stage(program)
    if result is None:
        raise ValueError(f"the portable kernels cannot run this {program.kind}_mod: {reason}")
    return result


def _stacks_present(program) -> tuple:
    """Which of a program's four stacks exist (a stack is None when the program stages nothing there)."""
    s = staged(program)
    return tuple(s is not None and bool(s.group(side, kind)) for side, kind in STACKS)


def num_float_grads(mods: masks.ScoreMods, side: str) -> int:
    """How many float values of a side ("row" or "col") the score_mod's backward returns gradients for: all
    of them where a closed-over float array reaches its result differentiably, else none."""
    s = staged(mods.score_mod)
    return len(s.group(side, "float")) if s is not None and s.needs_grad else 0


def mod_operands(
    mods: masks.ScoreMods,
    mod_arrays: masks.ModArrays,
    q_pad: int,
    kv_pad: int,
    *,
    keys_major: bool = False,
    stacks: ProgramStacks = ProgramStacks(),
):
    """The modifiers' arrays as one operand group appended to a pallas_call's operands, and their specs.

    Every operand is passed whole (its block is the full array; a kernel indexes the tile it needs), so the
    group is the same for every grid. bias: float [Bb, Hb, Tqb, Tkb] with each dim 1 or full, lengths padded
    with 0 to q_pad / kv_pad; mask: the same as int32 (1 = attend; padding 0), as Triton loads int32 more
    reliably than bool; with `keys_major` both are transposed to [.., Tkb, Tqb] for the transposed tiles of
    the dK/dV kernel. slopes: float32 [batch, heads]; seed: uint32 [2]. Then the programs' `stacks`
    (score_mod's, then mask_mod's; each [Bd, Hd, values, len]) padded with 0 to q_pad (rows) / kv_pad (cols).
    """

    def pad(x, dims, value):
        widths = [(0, 0), (0, 0), (0, q_pad - x.shape[2] if dims[2] else 0), (0, kv_pad - x.shape[3] if dims[3] else 0)]
        x = jnp.pad(x, widths, constant_values=value)
        return jnp.swapaxes(x, 2, 3) if keys_major else x

    operands = []
    if mods.bias_dims is not None:
        operands.append(pad(mod_arrays.bias, mods.bias_dims, 0))
    if mods.mask_dims is not None:
        operands.append(pad(mod_arrays.mask.astype(jnp.int32), mods.mask_dims, 0))
    if mods.alibi:
        operands.append(mod_arrays.alibi_slopes)
    if mods.dropout_rate > 0.0:
        operands.append(mod_arrays.dropout_seed)
    for stack_group in stacks:
        for (side, _), x in zip(STACKS, stack_group):
            if x is not None:
                length = q_pad if side == "row" else kv_pad
                operands.append(jnp.pad(x, [(0, 0)] * 3 + [(0, length - x.shape[3])]))
    return operands, [whole_block_spec(x) for x in operands]


def head_specs(rows: int, index_map, *head_dims: int) -> tuple:
    """BlockSpecs of `rows` rows of one head of [batch, len, heads, head_dim] arrays, one per head_dim (query/key's
    and value's may differ)."""
    return tuple(pl.BlockSpec((SQUEEZED, rows, SQUEEZED, d), index_map) for d in head_dims)


def whole_block_spec(x):
    """A BlockSpec whose block is all of x, for any grid."""
    return pl.BlockSpec(x.shape, lambda *program_ids: (0,) * x.ndim)


def split_refs(refs, num_inputs: int, has_segments: bool, mods: masks.ScoreMods):
    """A kernel's refs -> (inputs, (q_segment, kv_segment) or (None, None), ModRefs, outputs): the fixed
    inputs come first, then the segment-id group, then the modifier group, then the outputs. (A block-sparse
    visit table precedes them all: kernels take it off before calling this.)"""
    inputs, rest = refs[:num_inputs], refs[num_inputs:]
    segments = (None, None)
    if has_segments:
        segments, rest = rest[:2], rest[2:]
    present = (mods.bias_dims is not None, mods.mask_dims is not None, mods.alibi, mods.dropout_rate > 0.0)
    present += _stacks_present(mods.score_mod) + _stacks_present(mods.mask_mod)
    found = []
    for flag in present:
        found.append(rest[0] if flag else None)
        rest = rest[1:] if flag else rest
    return inputs, segments, ModRefs(*found[:4], tuple(found[4:8]), tuple(found[8:])), rest


def _positions(start, block):
    return start + lax.iota(jnp.int32, block)


def _mod_tile(ref, dims, batch, head, q_start, k_start, block_q, block_kv, keys_major):
    """The [block_q | 1, block_kv | 1] tile of a broadcastable [B, H, Tq, Tk] operand ([.., Tk, Tq] and
    transposed with `keys_major`); batch/head indices are multiplied by 0 where the operand has size 1 (no
    scalar select, which the Triton lowering lacks)."""
    q_slice = pl.ds(q_start, block_q) if dims[2] else pl.ds(0, 1)
    k_slice = pl.ds(k_start, block_kv) if dims[3] else pl.ds(0, 1)
    b, h = batch * int(dims[0]), head * int(dims[1])
    return ref[b, h, k_slice, q_slice] if keys_major else ref[b, h, q_slice, k_slice]


def modified_logits(
    x,
    mods: masks.ScoreMods,
    refs: ModRefs,
    *,
    batch,
    head,
    q_start,
    k_start,
    block_q: int,
    block_kv: int,
    keys_major: bool = False,
    pullback: bool = False,
):
    """Scaled logits x (natural units) of a tile -> (logits in log2 units, -inf where the mask hides the key;
    d logits / d x for a soft cap, else None; with `pullback` and a score_mod, its vjp (`_score_mod`), else
    None). Tiles are [block_q, block_kv], or [block_kv, block_q] with `keys_major`."""
    q_pos, k_pos = _positions(q_start, block_q), _positions(k_start, block_kv)
    q_pos, k_pos = (q_pos[None, :], k_pos[:, None]) if keys_major else (q_pos[:, None], k_pos[None, :])
    grad_factor = None
    if mods.soft_cap is not None:
        x = masks.soft_cap(x, mods.soft_cap)
        grad_factor = masks.soft_cap_grad(x, mods.soft_cap)
    position = dict(
        batch=batch,
        head=head,
        q_start=q_start,
        k_start=k_start,
        block_q=block_q,
        block_kv=block_kv,
        keys_major=keys_major,
    )
    tile = functools.partial(_mod_tile, **position)
    bias = tile(refs.bias, mods.bias_dims) if mods.bias_dims is not None else None
    slope = refs.slopes[batch, head] if mods.alibi else None
    s = masks.add_biases(x, q_pos=q_pos, k_pos=k_pos, bias=bias, slope=slope)
    score_pullback = None
    if mods.score_mod is not None:
        s, score_pullback = _score_mod(s, mods.score_mod, refs.score_stacks, pullback=pullback, **position)
    s = s * blocks.LOG2E
    if mods.mask_dims is not None:
        s = jnp.where(tile(refs.mask, mods.mask_dims) != 0, s, -jnp.inf)
    return s, grad_factor, score_pullback


def _program_inputs(program, stack_refs, *, batch, head, q_start, k_start, block_q, block_kv, keys_major=False):
    """A program's `Staged` and the arguments of its `joint` after the score: batch, head, the tile's query
    and key positions, and its staged values as four lists of tiles (each row value read for the tile's
    queries, each column value for its keys, from the program's stacks; laid out as in `modified_logits`)."""
    s = staged(program)
    shape, q_axis = ((block_kv, block_q), 1) if keys_major else ((block_q, block_kv), 0)
    q_idx = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    kv_idx = k_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    values = []
    for (side, kind), ref in zip(STACKS, stack_refs):
        by_batch, by_head = s.dims(side)
        b, h = batch * int(by_batch), head * int(by_head)  # no scalar select (see `_mod_tile`)
        start, block, axis = (q_start, block_q, q_axis) if side == "row" else (k_start, block_kv, 1 - q_axis)
        vectors = [ref[b, h, i, pl.ds(start, block)] for i in range(len(s.group(side, kind)))]
        values.append([jnp.broadcast_to(jnp.expand_dims(v, 1 - axis), shape) for v in vectors])
    return s, (batch, head, q_idx, kv_idx, *values)


def _score_mod(x, program, stack_refs, *, pullback: bool, **position):
    """The score_mod on a tile of logits x (natural units, after soft cap, bias and ALiBi) -> (its result; with
    `pullback`, its vjp: d loss / d result -> (d loss / d x, [d loss / d each rows_float value],
    [... each cols_float value]), as tiles, the lists empty unless a closed-over float array reaches the
    result (`Staged.needs_grad`); else None). The program is elementwise, so the vjp is too."""
    s, (batch, head, q_idx, kv_idx, rows_int, rows_float, cols_int, cols_float) = _program_inputs(
        program, stack_refs, **position
    )

    def score(x, rows_float, cols_float):
        return s.joint(x, batch, head, q_idx, kv_idx, rows_int, rows_float, cols_int, cols_float)

    if not pullback:
        return score(x, rows_float, cols_float), None
    if s.needs_grad:
        return jax.vjp(score, x, rows_float, cols_float)
    result, vjp = jax.vjp(lambda x: score(x, rows_float, cols_float), x)
    return result, lambda d: (vjp(d)[0], [], [])


def visibility(mask, mods: masks.ScoreMods, refs: ModRefs, **position):
    """A tile's `tile_mask` ANDed with the mask_mod's visibility there (bool, laid out as in
    `modified_logits`)."""
    if mods.mask_mod is None:
        return mask
    s, args = _program_inputs(mods.mask_mod, refs.mask_stacks, **position)
    seen = s.joint(None, *args)
    return seen if mask is None else jnp.logical_and(mask, seen)


def dropout_multiplier(
    mods: masks.ScoreMods,
    refs: ModRefs,
    *,
    batch,
    head,
    q_start,
    k_start,
    block_q: int,
    block_kv: int,
    keys_major: bool = False,
):
    """keep / (1 - rate) on a tile (laid out as in `modified_logits`), or None without dropout. The hash
    runs once per query row, then once per element (`masks.dropout_row_hash`, `masks.dropout_keep`)."""
    if mods.dropout_rate == 0.0:
        return None
    if mods.broadcast_dropout:
        batch, head = 0, 0
    q_pos, k_pos = _positions(q_start, block_q), _positions(k_start, block_kv)
    q_pos, k_pos = (q_pos[None, :], k_pos[:, None]) if keys_major else (q_pos[:, None], k_pos[None, :])
    row_hash = masks.dropout_row_hash(refs.seed[0], refs.seed[1], batch, head, q_pos)
    keep = masks.dropout_keep(row_hash, k_pos, mods.dropout_rate)
    return jnp.where(keep, 1.0 / (1.0 - mods.dropout_rate), 0.0)
