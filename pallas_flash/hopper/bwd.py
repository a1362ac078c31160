"""FlashAttention backward for Hopper (sm90), written with Pallas's Mosaic GPU backend: the entry point that
pads, preprocesses and picks the kernels (`bwd_dkdv`, `bwd_dq`, `bwd_ordered`).

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

Masks as in the forward (`fwd`): a causal or windowed band (top-left aligned: causal query i sees key
j <= i) bounds the blocks each CTA visits (`blocks.q_block_range` for a dK/dV tile, `blocks.kv_block_range`
for a dQ tile), and only blocks on the band's edges are masked; segment ids (lengths folded in) narrow the
visited blocks further (`segment_block_ranges`), ride the Q ring (dK/dV) or the K ring (dQ), and mask the
blocks that are not wholly inside the tile's one segment.
Score and mask programs (`mods.Staged`, two passes only): each step recomputes the modified score from the
scaled logits (x = scale * S; P = exp2(score(x) * log2(e) - lse2)) and takes dS back through the program
(its vjp on the tile: dS_raw = P (dP - delta) * d score / d x); the staged per-query values ride the Q ring
(dK/dV) or stay resident (dQ), the per-key values the other way round; the gradient of the score program's
float per-query values is summed over keys in the dQ pass, of its per-key values over queries in the dK/dV
pass. The mask program is evaluated in masked steps only; its block classes (evaluated once in XLA from its
stacks) narrow each tile's visited blocks and unmasked run further.
A dense bias and mask (two passes only): their tiles ride the K ring of the dQ pass and, key-major (transposed in
XLA), the Q ring of the dK/dV pass; both recompute P from soft_cap(scale * S) + bias with the mask applied on
every visited block. The dQ pass writes dS (the gradient of the biased logit) of every tile to a float32
[batch, heads, q_pad, kv_pad] buffer (zeros in blocks it does not visit), summed over the bias's broadcast dims
in XLA into dbias.
Dropout: every variant regenerates the forward's keep bits (the dK/dV tiles hash their queries along the
columns): dV += (P^T keep) dO, scaled by 1 / (1 - rate) at the store, and dP = Z (dO V^T) with Z = keep / (1 - rate)
before delta is subtracted (so not in the dP accumulator: no delta_in_dp).
Ragged lengths are padded in the wrapper: padded query rows have lse2 = +inf and dO = 0 (no contribution),
padded keys are masked in the dQ pass (their dK/dV rows are sliced off). head_dim is padded to a multiple
of 64 (the wgmma contraction granule of a 128-byte swizzle). Value may have a head_dim of its own: V, dO, dV
and the dP contraction at value's, Q, K, dQ, dK and the S contraction at query's.
Head dims past 128 (192 for query and key with 128 for value runs as above): with `HopperBwdConfig.split_columns`
(head_dim 256) each pass's two consumers share one block of rows and each accumulates half of the head_dim
columns of dK and dV (or dQ), both recomputing the block's S and dP.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_flash import block_sparse, masks, mods
from pallas_flash.block_sparse import BlockMask
from pallas_flash.blocks import LOG2E
from pallas_flash.hopper.bwd_dkdv import dkdv_pass
from pallas_flash.hopper.bwd_dq import dq_pass
from pallas_flash.hopper.bwd_ordered import dq_split
from pallas_flash.hopper.common import (
    HEAD_DIM_TILE,
    KERNEL_STATIC_ARGNAMES,
    DenseMods,
    and_classes,
    coarsen_block_classes,
    dense_operands,
    forward_head_dim,
    mask_block_ranges,
    pack_mod_stacks,
    pad_axis,
    padded_head_dim,
    round_up,
    sparse_classes,
)
from pallas_flash.hopper.config import H100_SHARED_MEMORY, NUM_CONSUMERS, HopperBwdConfig
from pallas_flash.hopper.fwd import KernelMods, dense_tile_bytes, kernel_dropout


def backward_head_dims(head_dim: int, head_dim_v: int | None = None) -> tuple[int, int]:
    """The (query/key, value) head dims the backward computes at for these head dims (value's None: head_dim):
    96 (and 65-96) at 96, on 64-byte swizzled tiles (`common.head_dim_transforms`); the others padded to the
    64-element tile (160 at 192, whose `split_columns` halves are 96 columns under a 64-byte swizzle); where a
    consumer's dK and dV then need `split_columns` (they would not fit its registers) but half a head_dim is not
    whole 32-column tiles, both padded on until it is: zero columns change no gradient."""
    at = lambda d: 96 if forward_head_dim(d) == 96 else padded_head_dim(d)
    dims = at(head_dim), at(head_dim_v or head_dim)
    if HopperBwdConfig.needs_split_columns(*dims) and not HopperBwdConfig.can_split_columns(*dims):
        dims = tuple(round_up(d, NUM_CONSUMERS * HEAD_DIM_TILE // 2) for d in dims)
    return dims


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
            arrays = [
                x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, batched in zip(arrays, in_batched)
            ]
            outs = folded(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in arrays))
            outs = jax.tree.map(lambda y: y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:]), outs)
            return outs, jax.tree.map(lambda _: True, outs)

        return folded(*(args[i] for i in present))

    return call


def _one_pass_with_seed(q, k, v, d_out, lse2, delta, q_ids, kv_ids, dropout_seed, **kwargs):
    """The one pass (`dkdv_pass`) with dropout's seed table as a positional argument, for `_fold_vmap`."""
    return dkdv_pass(q, k, v, d_out, lse2, delta, q_ids, kv_ids, dropout_seed=dropout_seed, **kwargs)


def check_config(
    config: HopperBwdConfig,
    head_dim: int,
    itemsize: int = 2,
    tile_bytes: int = 0,
    dbias: bool = False,
    head_dim_v: int | None = None,
) -> None:
    """Raises ValueError if the tiles do not fit an H100's shared memory at this (padded) head_dim and value's
    `head_dim_v` (None: head_dim) (with dense tiles of `tile_bytes` per logit and, `dbias`, the dQ kernel's dS
    staging), if the one-pass kernel cannot split dQ between its consumers (`dq_split`), or if the head dims
    need split_columns (`HopperBwdConfig.needs_split_columns`) and the config has none, or it cannot halve them."""
    if HopperBwdConfig.needs_split_columns(head_dim, head_dim_v) and not config.split_columns:
        raise ValueError(
            f"{config}: at head_dims {head_dim} (query, key) and {head_dim_v or head_dim} (value) a consumer's dK "
            "and dV do not fit its registers: use split_columns=True (`HopperBwdConfig.default`)"
        )
    if config.split_columns and not HopperBwdConfig.can_split_columns(head_dim, head_dim_v):
        raise ValueError(
            f"{config}: split_columns halves the head dims into whole 32-column tiles, but they are {head_dim} "
            f"(query, key) and {head_dim_v or head_dim} (value)"
        )
    if config.dq_atomic and (head_dim % HEAD_DIM_TILE or (head_dim_v or head_dim) % HEAD_DIM_TILE):
        raise ValueError(
            f"{config}: the one-pass dq_atomic backward shares 128-byte swizzled dS tiles with Q and K, so it takes "
            f"head dims that are multiples of {HEAD_DIM_TILE}, got {head_dim} and {head_dim_v or head_dim}; use "
            "dq_atomic=False (the two passes)"
        )
    if config.dq_atomic and dq_split(head_dim, config.block_q_dkv) is None:
        raise ValueError(
            f"{config}: the one-pass dq_atomic backward at head_dim {head_dim} needs block_q_dkv >= 128 "
            f"(each consumer computes dQ for half of a query block), got {config.block_q_dkv}"
        )
    for name, needed in (
        ("dK/dV", config.smem_bytes_dkv(head_dim, itemsize, tile_bytes, head_dim_v)),
        ("dQ", config.smem_bytes_dq(head_dim, itemsize, tile_bytes, dbias, head_dim_v)),
    ):
        if needed > H100_SHARED_MEMORY:
            raise ValueError(
                f"{config} needs {needed} bytes of shared memory in the {name} kernel at head_dim "
                f"{head_dim} (the limit is {H100_SHARED_MEMORY})"
            )


def default_config(
    head_dim: int,
    kv_len: int,
    band: masks.Band,
    deterministic: bool,
    programs: bool = False,
    tile_bytes: int = 0,
    dbias: bool = False,
    head_dim_v: int | None = None,
    score: str | None = None,
) -> HopperBwdConfig | None:
    """`HopperBwdConfig.default` for a call with this (padded) head_dim, value's (padded) `head_dim_v` (None:
    head_dim), key length and band; with a score or mask program (`programs`) the two passes, as the one pass
    takes none (its dQ has no per-query pass to sum a score program's row gradients in, and its ordered adds no
    per-head block ranges). With dense tiles (`tile_bytes` per logit, `fwd.dense_tile_bytes`; `dbias`: with a
    bias's gradient) the two passes too (the dQ pass writes dbias); with them or a value head_dim of its own
    shrunk until they fit (`HopperBwdConfig.fit`): None where none do. Head dims as `backward_head_dims` gives
    them. `score`: the score program's kind (`score_kind`), None without one; at head_dim 128 any takes
    delta_in_dp (ALiBi, 8k non-causal: fwd+bwd 4.9% faster; a bias table level) and a "nonlinear" one (a soft
    cap) the passes without their overlaps, whose extra live tiles spill beside its derivative's (2.5% and 3.1%
    faster apart)."""
    config = HopperBwdConfig.default(
        head_dim, deterministic, kv_len=kv_len, is_causal=band.is_causal, head_dim_v=head_dim_v
    )
    if programs and config.dq_atomic:
        config = dataclasses.replace(config, dq_atomic=False, dq_ordered=False)
    if score is not None and config.dq_overlap:  # the head_dim-128 default
        config = dataclasses.replace(config, delta_in_dp=True)
        if score == "nonlinear":
            no_overlap = dict(dq_overlap=False, dkv_overlap=False, num_stages_dq=2, num_stages_dkv=2)
            config = dataclasses.replace(config, **no_overlap)
    if programs or tile_bytes:  # served the split_columns way: no scratch to fit
        config = dataclasses.replace(config, dq_split_products=False, dkv_split_products=False)
    if tile_bytes or (head_dim_v or head_dim) != head_dim:
        return config.fit(head_dim, 2, tile_bytes, dbias, head_dim_v)
    return config


def score_kind(score_mod, soft_cap: float | None = None) -> str | None:
    """A call's score modification as `default_config` takes it: "nonlinear" with a soft cap (in the program or
    applied by the kernels) or a staged score program whose d score / d logit is not a constant, "linear" where
    it is (`mods.Staged.score_derivative`: biases, ALiBi), None without either."""
    if soft_cap is not None:
        return "nonlinear"
    if score_mod is None:
        return None
    return "linear" if score_mod.score_derivative is not None else "nonlinear"


def pass_tiles(config: HopperBwdConfig):
    """The dQ pass's tiles (CTA rows of queries, key block), the dK/dV pass's (CTA rows of keys, query block) and
    the finest (block_q, block_kv) both are made of."""
    dq = config.row_tiles * config.block_q_dq, config.block_kv_dq
    dkdv = config.row_tiles * config.block_kv_dkv, config.block_q_dkv
    return dq, dkdv, (math.gcd(dq[0], dkdv[1]), math.gcd(dq[1], dkdv[0]))


def _mask_ranges(mask_mod, mask_stacks, config: HopperBwdConfig, *, batch, heads, kv_heads, q_len, kv_len,
                 mask=None, block_mask=None):  # fmt: skip
    """The block ranges (`mask_block_ranges`) of both passes, of the mask program (None: none), a dense bool mask
    [Bd, Hd, q_len, kv_len] and a `BlockMask` (`sparse_classes`; each None where absent) applied together: per
    (batch, head, CTA tile of `row_tiles` * block_q_dq queries) its key blocks for the dQ pass, and per (batch, kv
    head, CTA tile of `row_tiles` * block_kv_dkv keys) its query blocks over the group's heads for the dK/dV pass.
    The masks' block classes are taken once, at the finest tiles both passes' blocks are made of."""
    (dq_rows, dq_cols), (dkdv_rows, dkdv_cols), (block_q, block_kv) = pass_tiles(config)
    q_pad = round_up(q_len, math.lcm(dq_rows, dkdv_cols))
    kv_pad = round_up(kv_len, math.lcm(dq_cols, dkdv_rows))
    program = None
    if mask_mod is not None:
        anything, everything = mask_mod.block_classes(
            mask_stacks, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv
        )
        pad = ((0, 0), (0, 0), (0, q_pad // block_q - anything.shape[2]), (0, kv_pad // block_kv - anything.shape[3]))
        program = jnp.pad(anything, pad), jnp.pad(everything, pad, constant_values=True)
    sizes = dict(q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv, q_pad=q_pad, kv_pad=kv_pad)
    with jax.ensure_compile_time_eval():  # a block mask's alone are constants: no XLA ops at run time
        anything, everything = and_classes(program, sparse_classes(mask, block_mask, **sizes))
        coarse = coarsen_block_classes(anything, everything, dq_rows // block_q, dq_cols // block_kv)
        dq_ranges = mask_block_ranges(*coarse)
        anything, everything = (jnp.swapaxes(x, 2, 3) for x in (anything, everything))  # [.., key, query] blocks
        if anything.shape[1] > 1:  # a dK/dV CTA visits the query blocks of every head of its group
            group = (anything.shape[0], kv_heads, heads // kv_heads, *anything.shape[2:])
            anything, everything = anything.reshape(group).any(axis=2), everything.reshape(group).all(axis=2)
        dkdv_ranges = mask_block_ranges(
            *coarsen_block_classes(anything, everything, dkdv_rows // block_kv, dkdv_cols // block_q)
        )
    return dq_ranges, dkdv_ranges


def _stack_cotangent(d, stack, length: int):
    """A float stack's cotangent ([Bd, Hd, n, length], as `stack`) from a kernel's gradient per (batch, query
    head) and padded position: summed over the batch or heads the stack is broadcast over."""
    d = d[..., :length]
    return jnp.sum(d, axis=tuple(i for i in (0, 1) if stack.shape[i] == 1), keepdims=True).astype(stack.dtype)


def _bias_cotangent(dbias, bias):
    """The bias's cotangent (its shape and dtype) from the dQ pass's float32 dS per (batch, query head) and padded
    position: summed over the batch or heads the bias is broadcast over."""
    dbias = dbias[:, :, : bias.shape[2], : bias.shape[3]]
    broadcast = tuple(i for i in (0, 1) if bias.shape[i] == 1 and dbias.shape[i] > 1)
    return jnp.sum(dbias, axis=broadcast, keepdims=True).astype(bias.dtype)


@functools.partial(jax.jit, static_argnames=(*KERNEL_STATIC_ARGNAMES, "bias_grad"))
def hopper_backward(
    q,
    k,
    v,
    out,
    lse,
    d_out,
    d_lse,
    *,
    scale: float,
    is_causal: bool = False,
    local_window_size=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    config: HopperBwdConfig | None = None,
    score_mod: mods.Staged | None = None,
    score_stacks=(None,) * 4,
    mask_mod: mods.Staged | None = None,
    mask_stacks=(None,) * 4,
    dropout_rate: float = 0.0,
    dropout_seed=None,
    broadcast_dropout: bool = False,
    bias=None,
    mask=None,
    logits_soft_cap: float | None = None,
    block_mask: BlockMask | None = None,
    bias_grad: bool = True,
    interpret=None,
):
    """Gradients of attention on Hopper from the forward's residuals.

    q [batch, q_len, heads, head_dim], k [batch, kv_len, kv_heads, head_dim], v [batch, kv_len, kv_heads,
    head_dim_v] (bf16/fp16), out [batch, q_len, heads, head_dim_v], lse [batch, heads, q_len] float32 natural
    log; cotangents d_out like out and d_lse like lse (or None).
    The band, segment ids and programs as in `hopper_fwd.hopper_forward` (the forward's own): score_mod /
    mask_mod a `mods.Staged` or None, with its (rows_int, rows_float, cols_int, cols_float) from
    `Staged.stacks` (two passes only: the default config takes them where programs are given). Dropout
    (dropout_rate, dropout_seed, broadcast_dropout) as the forward's: the same keep mask, in every variant.
    Returns (dq, dk, dv, d_rows_float, d_cols_float): dq, dk, dv shaped and typed like (q, k, v), dk/dv
    summed over each kv head's group; d_rows_float / d_cols_float the cotangents of score_stacks[1] /
    score_stacks[3] (None where that stack is None; zeros unless `score_mod.needs_grad`).
    bias, mask, logits_soft_cap: the forward's dense bias and mask and soft cap (`hopper_fwd.hopper_forward`;
    two passes only: the default config takes them, shrunk to fit); with a bias a sixth result, dbias: the
    gradient of the bias in its own shape and dtype (dS summed over the dims it broadcasts over; None with
    `bias_grad=False`, which spares the float32 [batch, heads, q, kv] dS buffer and its writes). Each pass
    visits only the blocks the mask leaves something visible in (and reads no mask tile in those it leaves wholly
    visible). block_mask: None, or a `BlockMask` the block ranges serve exactly at both passes' tiles
    (`block_sparse.exact_by_ranges`; expand any other into `mask`), two passes only.
    `interpret`: None compiles for the GPU; an `InterpretGPUParams` runs the two-pass kernels in the Mosaic
    GPU interpreter on CPU (as `hopper_forward`'s; not config.dq_atomic)."""
    band = masks.Band.of(is_causal, local_window_size)
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    if heads % kv_heads:
        raise ValueError(f"key has {kv_heads} heads; query's {heads} heads must be a multiple of it")
    padded_dim, padded_dim_v = backward_head_dims(head_dim, head_dim_v)
    has_programs = score_mod is not None or mask_mod is not None or block_mask is not None
    hull = block_mask is not None
    dense = DenseMods(bias is not None, mask is not None, logits_soft_cap, hide_outside_hull=hull, bias_grad=bias_grad)
    tile_bytes = dense_tile_bytes(None if bias is None else bias.dtype, mask is not None)
    fit = dict(tile_bytes=tile_bytes, dbias=dense.writes_dbias, head_dim_v=padded_dim_v)
    score = score_kind(score_mod, logits_soft_cap)
    config = config or default_config(
        padded_dim, kv_len, band, deterministic=True, programs=has_programs, score=score, **fit
    )
    if config is None:
        raise ValueError(
            f"no backward tiles fit shared memory at head_dims {head_dim} (query, key) and {head_dim_v} (value) "
            f"with dense tiles of {tile_bytes} bytes per logit"
        )
    check_config(config, padded_dim, q.dtype.itemsize, **fit)
    if (has_programs or dense.forms_logits or dense.active) and config.dq_atomic:
        raise ValueError(
            f"{config}: the one-pass dq_atomic backward takes no score_mod, mask_mod, block_mask, soft cap or dense "
            "bias or mask; use dq_atomic=False (`default_config(..., programs=True)`)"
        )
    # The dK/dV pass steps over a gap of query blocks where a key tile's may form two runs.
    query_gap = mask_mod is not None and mask_mod.ors_query_term
    if block_mask is not None:
        block_mask.check(batch, heads, q_len, kv_len)
        dq_tiles, dkdv_tiles, _ = pass_tiles(config)
        sizes = dict(q_len=q_len, kv_len=kv_len, kv_heads=kv_heads)
        reason = block_sparse.exact_by_ranges(
            block_mask, **sizes, query_tiles=(dq_tiles,), key_tiles=(dkdv_tiles,),
            beside_other_masks=mask_mod is not None or mask is not None
        )  # fmt: skip
        if reason is not None:
            raise ValueError(f"block_mask is not served by block ranges at {config}: {reason}; pass it as mask=")
        query_gap = query_gap or block_sparse.most_runs(block_mask, **sizes, major="key", rows=dkdv_tiles[0],
                                                        cols=dkdv_tiles[1]) > 1  # fmt: skip
    for name, program, stacks in (("score", score_mod, score_stacks), ("mask", mask_mod, mask_stacks)):
        if len(stacks) != 4 or (program is None and any(x is not None for x in stacks)):
            raise ValueError(f"{name}_stacks must be (rows_int, rows_float, cols_int, cols_float) of a {name}_mod")
    if config.dq_atomic and interpret is not None:
        raise ValueError(
            "the one-pass dq_atomic backward cannot run in the Mosaic GPU interpreter (JAX 0.10.2 "
            "has no mutable-array kernel argument nor TMA reduce-add there); use dq_atomic=False"
        )

    # dL/dS = P * (dP - delta); a cotangent on the LSE output adds P * d_lse, i.e. delta -= d_lse. (out None: d_lse
    # holds -delta, `attention_backward`'s delta.)
    if out is None:
        delta = -d_lse.astype(jnp.float32)
    else:
        delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
        if d_lse is not None:
            delta = delta - d_lse.astype(jnp.float32)
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * LOG2E)

    q_pad = round_up(q_len, math.lcm(config.block_q_dkv, config.row_tiles * config.block_q_dq))
    kv_pad = round_up(kv_len, math.lcm(config.row_tiles * config.block_kv_dkv, config.block_kv_dq))

    def pad(x, rows, dim=padded_dim):
        return pad_axis(pad_axis(x, 1, rows), 3, dim)

    qp, dop = pad(q, q_pad), pad(d_out.astype(q.dtype), q_pad, padded_dim_v)
    kp, vp = pad(k, kv_pad), pad(v, kv_pad, padded_dim_v)
    # Padded query rows: lse2 = +inf makes their P exactly 0 in both passes.
    lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, q_pad - q_len)), constant_values=jnp.inf)
    delta = pad_axis(delta, 2, q_pad)
    ids = masks.pad_segment_ids(q_segment_ids, kv_segment_ids, q_pad, kv_pad)

    common = dict(scale=scale, band=band, kv_len=kv_len, config=config, interpret=interpret)
    dropout, seed = kernel_dropout(dropout_rate, broadcast_dropout, dropout_seed, batch)
    if dropout is not None:
        common.update(dropout=dropout, dropout_seed=seed)
    if config.dq_atomic:
        one_pass, seeds = dkdv_pass, ()
        if dropout is not None:  # the seed table is per example: positional, so that `_fold_vmap` folds it too
            one_pass, seeds = _one_pass_with_seed, (common.pop("dropout_seed"),)
        dk, dv, dq = _fold_vmap(functools.partial(one_pass, **common))(qp, kp, vp, dop, lse2, delta, *ids, *seeds)
        dq = (dq * scale).astype(q.dtype)
    elif not has_programs and not dense.active and not dense.forms_logits:
        dk, dv = dkdv_pass(qp, kp, vp, dop, lse2, delta, *ids, **common)
        dq = dq_pass(qp, kp, vp, dop, lse2, delta, *ids, **common)
    else:
        common.update(dense=dense)
        rows, row_offsets = pack_mod_stacks((*score_stacks[:2], *mask_stacks[:2]), q_pad)
        cols, col_offsets = pack_mod_stacks((*score_stacks[2:], *mask_stacks[2:]), kv_pad)
        programs = KernelMods(score_mod, mask_mod, row_offsets, col_offsets)
        dq_ranges = dkdv_ranges = None
        if mask_mod is not None or mask is not None or block_mask is not None:
            dq_ranges, dkdv_ranges = _mask_ranges(
                mask_mod, mask_stacks, config, batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
                mask=mask, block_mask=block_mask
            )  # fmt: skip
        grads = score_mod is not None and score_mod.needs_grad
        dk, dv, *d_cols = dkdv_pass(
            qp,
            kp,
            vp,
            dop,
            lse2,
            delta,
            *ids,
            (rows, cols, dkdv_ranges),
            programs=programs,
            dense_arrays=dense_operands(bias, mask, q_pad, kv_pad, transpose=True),
            query_gap=query_gap,
            **common,
        )
        dq = dq_pass(
            qp,
            kp,
            vp,
            dop,
            lse2,
            delta,
            *ids,
            (rows, cols, dq_ranges),
            programs=programs,
            dense_arrays=dense_operands(bias, mask, q_pad, kv_pad),
            **common,
        )
        dq, d_rows, dbias = dq if isinstance(dq, tuple) else (dq, None, None)
        d_rows_float, d_cols_float = (
            None if stack is None else _stack_cotangent(d, stack, length) if grads else jnp.zeros_like(stack)
            for stack, d, length in (
                (score_stacks[1], d_rows, q_len),
                (score_stacks[3], d_cols[0] if d_cols else None, kv_len),
            )
        )
        results = (
            dq[:, :q_len, :, :head_dim],
            dk[:, :kv_len, :, :head_dim],
            dv[:, :kv_len, :, :head_dim_v],
            d_rows_float,
            d_cols_float,
        )
        if bias is None:
            return results
        return (*results, _bias_cotangent(dbias, bias) if bias_grad else None)
    return dq[:, :q_len, :, :head_dim], dk[:, :kv_len, :, :head_dim], dv[:, :kv_len, :, :head_dim_v], None, None
