"""The Hopper implementation ("mosaic") as one differentiable function, and the rule that says whether it can serve a
call: the Mosaic GPU forward (`fwd`) and a backward on the same residuals (q, k, v, o, lse): the Mosaic GPU backward
(`bwd`, at `bwd.backward_head_dims`), or the portable backward kernels where no Hopper tiles hold a call's dense
tiles or `HopperBwdConfig.portable` asks for them. Value may have a head_dim of its own (DeepSeek's MLA) where both
Mosaic GPU kernels serve it (the portable backward beneath this forward is not exercised at unequal head dims).
Both forwards return the same natural-log LSE, so the portable backward cannot tell which forward ran.

A score_mod / mask_mod (`masks.ScoreMods`) runs staged (`mods.stage`): its per-query and per-key values are
computed in XLA from the arrays it closes over, and the custom_vjp differentiates the score program's float
values (the kernels return their cotangents), so XLA's autodiff carries the gradient on to those arrays. Where
the portable backward runs, it takes the programs and their arrays themselves and returns the arrays'
cotangents directly.

A dense mask and a `BlockMask` narrow the blocks each kernel tile visits to those they leave something visible in
(their block classes, as a mask program's). A block mask whose kept blocks form at most two runs per kernel tile
(one beside a mask program or dense mask), covering its tiles wholly, is served by those ranges and their gap alone
(`block_sparse.exact_by_ranges`: a sliding window with global blocks); any other is expanded into the dense mask,
whose tiles then hide its dropped blocks inside a tile's run (`_serve_block_mask`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from pallas_flash import block_sparse, device, masks
from pallas_flash import mods as programs
from pallas_flash.block_sparse import BlockMask
from pallas_flash.config import KernelConfig
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper.common import SUPPORTED_DTYPES, forward_head_dim
from pallas_flash.hopper.config import H100_SHARED_MEMORY, NUM_CONSUMERS, HopperBwdConfig, HopperConfig
from pallas_flash.portable import vjp as portable

_logger = logging.getLogger("pallas_flash")


def _window(band: masks.Band):
    """The band as the kernels' (is_causal, local_window_size) arguments (`masks.Band.of` inverts it)."""
    return False, None if band.is_full else (band.left, band.right)


def _hopper_config(
    config: KernelConfig,
    head_dim: int,
    kv_len: int,
    band: masks.Band,
    tile_bytes: int = 0,
    head_dim_v=None,
    block_mask: BlockMask | None = None,
    sparse: bool = False,
) -> HopperConfig | None:
    """The forward's tiles: config.hopper, else the default, shrunk to hold dense tiles of `tile_bytes` per logit
    and value's `head_dim_v` (None: head_dim) (`hopper_fwd.default_config`; None where none fit), and with a
    `block_mask` served by its ranges to key blocks that divide its own (`_divide`). `sparse` (`_sparse_rows`):
    rows may visit only some key blocks."""
    if config.hopper is not None:
        return config.hopper
    padded_v = forward_head_dim(head_dim_v or head_dim)
    chosen = hopper_fwd.default_config(forward_head_dim(head_dim), kv_len, band, tile_bytes, padded_v, sparse)
    if chosen is None or block_mask is None:
        return chosen
    return dataclasses.replace(chosen, block_kv=_divide(chosen.block_kv, block_mask.block_kv))


def _sparse_rows(mods: masks.ScoreMods, block_mask, segment_ids=None) -> bool:
    """`hopper_fwd.sparse_rows` of a call, from its `mods` (a dense mask: `mask_dims`)."""
    return hopper_fwd.sparse_rows(segment_ids, mods.mask_mod, mods.mask_dims, block_mask)


def _divide(block: int, mask_block: int) -> int:
    """A kernel block of at most `block` that divides a block mask's `mask_block` where one of 64 or more does (a
    kernel tile then never straddles kept and dropped blocks), else `block`."""
    smaller = block_sparse.kernel_block(block, mask_block)
    return smaller if smaller >= 64 else block


def _dense(mods: masks.ScoreMods, mod_arrays: masks.ModArrays) -> dict:
    """The kernels' dense arguments of a call (none without them): a bias and a mask (arrays over both queries
    and keys, which `api._hopper_programs` leaves to the kernels) and the soft cap (which precedes the bias, so
    the kernels apply it where the API did not fold it into the score program)."""
    if mods.bias_dims is None and mods.mask_dims is None and mods.soft_cap is None:
        return {}
    return dict(bias=mod_arrays.bias, mask=mod_arrays.mask, logits_soft_cap=mods.soft_cap)


def _tile_bytes(mods: masks.ScoreMods, mod_arrays: masks.ModArrays | None = None) -> int:
    """Bytes per logit of the dense tiles the kernels' rings carry (dispatch, without the arrays, reads the bias's
    dtype from `mods`; 4 bytes where it was not recorded)."""
    bias_dtype = None
    if mods.bias_dims is not None:
        bias_dtype = mod_arrays.bias.dtype if mod_arrays is not None else (mods.bias_dtype or jnp.float32)
    return hopper_fwd.dense_tile_bytes(bias_dtype, mods.mask_dims is not None)


@functools.cache
def _stage(program):
    """`mods.stage`, once per program (a call traces the API, the forward and the backward)."""
    return programs.stage(program)


def _staged(mods: masks.ScoreMods):
    """(score_mod, mask_mod) as `mods.Staged` (None where absent), or a reason why one cannot be staged."""
    staged = []
    for name in ("score_mod", "mask_mod"):
        program = getattr(mods, name)
        if program is None:
            staged.append(None)
            continue
        stage, why = _stage(program)
        if stage is None:
            return f"{name}: {why}"
        staged.append(stage)
    return tuple(staged)


def unsupported_reason(
    query,
    key,
    *,
    band: masks.Band,
    unserved=(),
    config: KernelConfig,
    mods: masks.ScoreMods = masks.ScoreMods(),
    value=None,
    block_mask: BlockMask | None = None,
) -> str | None:
    """None if the Hopper kernel serves this call on this machine, else why not (for the dispatcher).
    `unserved`: names of the call's features the Hopper kernel does not have; `mods`: its score modifiers,
    of which the kernel runs the score_mod and mask_mod where they can be staged; `value`: its shape (None:
    key's); a head_dim of its own needs both Mosaic GPU kernels;
    `block_mask`: its `BlockMask` (None: none), counted as a dense mask where its ranges alone cannot serve it."""
    if not device.on_hopper_gpu():
        return (
            "the Mosaic GPU kernel needs an sm90 (Hopper) GPU (on CPU, JAX's Mosaic GPU interpreter runs its "
            "kernels only as a test path, with plain dots for wgmma: hopper.fwd.hopper_forward and "
            "hopper.bwd.hopper_backward take interpret=)"
        )
    if not any(query.dtype == d for d in SUPPORTED_DTYPES):
        return f"the Mosaic GPU kernel takes bfloat16 or float16, got {query.dtype}"
    if unserved:
        return f"the Mosaic GPU kernel has no {' or '.join(unserved)} yet"
    for name, dims in (("bias", mods.bias_dims), ("mask", mods.mask_dims)):
        if dims is not None and not (dims[2] and dims[3]):
            return f"the Mosaic GPU kernel reads a {name} over one of queries and keys only as a score program"
    staged = _staged(mods)
    if isinstance(staged, str):
        return staged
    head_dim = query.shape[-1]
    head_dim_v = head_dim if value is None else value.shape[-1]
    dims = (
        f"head_dim {head_dim}"
        if head_dim_v == head_dim
        else f"head_dims {head_dim} (query, key) and {head_dim_v} (value)"
    )
    if max(head_dim, head_dim_v) > hopper_fwd.MAX_HEAD_DIM:
        return f"the Mosaic GPU kernel takes head_dim <= {hopper_fwd.MAX_HEAD_DIM}, got {dims}"
    if block_mask is not None and _ranges_reason(block_mask, query, key, head_dim_v, band=band, config=config,
                                                 mods=mods) is not None:  # fmt: skip
        mods, block_mask = _with_dense_mask(mods, block_mask.shape[:2]), None
    tile_bytes = _tile_bytes(mods)
    dense = f" with the dense bias/mask tiles ({tile_bytes} bytes per logit)" if tile_bytes else ""
    sparse = _sparse_rows(mods, block_mask)  # segment ids change no tile size or shared memory
    hopper_config = _hopper_config(config, head_dim, key.shape[1], band, tile_bytes, head_dim_v, block_mask, sparse)
    if hopper_config is None:
        return f"no forward tiles fit shared memory at {dims}{dense}"
    needed = hopper_config.smem_bytes(forward_head_dim(head_dim), 2, tile_bytes, forward_head_dim(head_dim_v))
    needed += hopper_fwd.mod_smem_bytes(*staged, hopper_config)
    if needed > H100_SHARED_MEMORY:
        return f"{hopper_config} needs {needed} bytes of shared memory at {dims}{dense}"
    if head_dim_v != head_dim:  # served by both Mosaic GPU kernels only (see the module docstring)
        if _backward_config(config, head_dim, key.shape[1], band, True, mods, tile_bytes, head_dim_v,
                            block_mask=block_mask) is None:  # fmt: skip
            return f"the Mosaic GPU backward has no tiles for {dims}{dense}"
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13, 14))
def _attention(q, k, v, q_ids, kv_ids, score_stacks, mask_stacks, mask_ranges, mod_arrays, scale, band, config,
               deterministic, mods, block_mask):  # fmt: skip
    args = (q, k, v, q_ids, kv_ids, score_stacks, mask_stacks, mask_ranges, mod_arrays)
    return _attention_fwd(*args, scale, band, config, deterministic, mods, block_mask)[0]


def _attention_fwd(q, k, v, q_ids, kv_ids, score_stacks, mask_stacks, mask_ranges, mod_arrays, scale, band, config,
                   deterministic, mods, block_mask):  # fmt: skip
    del deterministic  # the forward is deterministic either way
    is_causal, window = _window(band)
    score_mod, mask_mod = _staged(mods)
    out, lse = hopper_fwd.hopper_forward(
        q,
        k,
        v,
        scale=scale,
        is_causal=is_causal,
        local_window_size=window,
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        config=_hopper_config(
            config,
            q.shape[-1],
            k.shape[1],
            band,
            _tile_bytes(mods, mod_arrays),
            v.shape[-1],
            block_mask,
            _sparse_rows(mods, block_mask, q_ids),
        ),
        score_mod=score_mod,
        score_stacks=score_stacks,
        mask_mod=mask_mod,
        mask_stacks=mask_stacks,
        mask_ranges=mask_ranges,
        **_dropout(mods, mod_arrays),
        **_dense(mods, mod_arrays),
        **({} if block_mask is None else dict(block_mask=block_mask)),
    )
    return (out, lse), (q, k, v, q_ids, kv_ids, score_stacks, mask_stacks, mask_ranges, mod_arrays, out, lse)


def _dropout(mods: masks.ScoreMods, mod_arrays: masks.ModArrays) -> dict:
    """The kernels' dropout arguments of a call (none without dropout)."""
    if mods.dropout_rate == 0.0:
        return {}
    return dict(
        dropout_rate=mods.dropout_rate, dropout_seed=mod_arrays.dropout_seed, broadcast_dropout=mods.broadcast_dropout
    )


def _backward_config(
    config: KernelConfig,
    head_dim: int,
    kv_len: int,
    band: masks.Band,
    deterministic: bool,
    mods: masks.ScoreMods = masks.ScoreMods(),
    tile_bytes: int = 0,
    head_dim_v: int | None = None,
    block_mask: BlockMask | None = None,
    bias_grad: bool = True,
) -> HopperBwdConfig | None:
    """The Hopper backward's tiles for this call (with a score or mask program or a `block_mask` served by its
    ranges, a variant that takes them, the latter's blocks dividing the mask's where they can, `_divide`; with
    dense bias/mask tiles of `tile_bytes` per logit or value's `head_dim_v` (None: head_dim), the two passes shrunk
    to hold them, and the dS staging of a bias's gradient unless `bias_grad` is False), or None where the portable
    backward runs instead."""
    padded, padded_v = hopper_bwd.backward_head_dims(head_dim, head_dim_v)
    dbias = mods.bias_dims is not None and bias_grad
    if config.hopper_bwd is not None:
        if HopperBwdConfig.needs_split_columns(padded, padded_v) and not config.hopper_bwd.split_columns:
            _logger.debug(
                "pallas_flash: %s has no split_columns, which head_dims %d and %d need; the portable backward runs",
                config.hopper_bwd,
                head_dim,
                head_dim_v or head_dim,
            )
            return None
        if config.hopper_bwd.portable or not (tile_bytes or padded_v != padded):
            return None if config.hopper_bwd.portable else config.hopper_bwd
        chosen = config.hopper_bwd.fit(padded, 2, tile_bytes, dbias, padded_v)
    else:
        # a soft cap the kernels apply themselves (before a dense bias) needs the two passes, as programs do
        programs = mods.score_mod is not None or mods.mask_mod is not None or mods.soft_cap is not None
        fit = dict(tile_bytes=tile_bytes, dbias=dbias, head_dim_v=padded_v)
        staged = _staged(mods)
        score = hopper_bwd.score_kind(None if isinstance(staged, str) else staged[0], mods.soft_cap)
        chosen = hopper_bwd.default_config(
            padded, kv_len, band, deterministic, programs=programs or block_mask is not None, score=score, **fit
        )
        if chosen is not None and block_mask is not None:
            chosen = dataclasses.replace(
                chosen,
                block_kv_dq=_divide(chosen.block_kv_dq, block_mask.block_kv),
                block_q_dkv=_divide(chosen.block_q_dkv, block_mask.block_q),
            )
    if chosen is None:
        _logger.debug(
            "pallas_flash: no Hopper backward tiles hold the dense bias/mask tiles (%d bytes per logit) at head_dim "
            "%d; the portable backward runs",
            tile_bytes,
            head_dim,
        )
    elif chosen != config.hopper_bwd and config.hopper_bwd is not None:
        _logger.debug("pallas_flash: %s shrunk to %s to hold the dense bias/mask tiles", config.hopper_bwd, chosen)
    return chosen


def _zero_stacks(stacks):
    return tuple(None if x is None else masks.zero_cotangent(x) for x in stacks)


def _attention_fwd_rule(*args):
    """The custom_vjp's forward with symbolic zeros: the primal inputs arrive as `CustomVJPPrimal`s, whose
    `perturbed` says whether the bias, and the score program's float values (its closed-over float arrays), need
    a gradient at all; the residuals carry each as () (they do) or None."""
    diff, static = args[:9], args[9:]
    bias = diff[8].bias
    bias_grad = bias is not None and bias.perturbed
    score_grad = any(x is not None and x.perturbed for x in diff[5][1::2])  # the float stacks
    values = jax.tree.map(lambda p: p.value, diff, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))
    result, residuals = _attention_fwd(*values, *static)
    return result, (*residuals, () if bias_grad else None, () if score_grad else None)


def _attention_bwd(scale, band, config, deterministic, mods, block_mask, residuals, cotangents):
    q, k, v, q_ids, kv_ids, score_stacks, mask_stacks, mask_ranges, mod_arrays, out, lse, bias_grad, score_grad = (
        residuals
    )
    bias_grad = bias_grad is not None
    d_out, d_lse = cotangents  # symbolic zeros where an output is unused (the lse, mostly): d_lse None skips it
    d_out = jnp.zeros(out.shape, out.dtype) if isinstance(d_out, SymbolicZero) else d_out
    d_lse = None if isinstance(d_lse, SymbolicZero) else d_lse
    tile_bytes = _tile_bytes(mods, mod_arrays)
    bwd_config = _backward_config(config, q.shape[-1], k.shape[1], band, deterministic, mods, tile_bytes, v.shape[-1],
                                  block_mask=block_mask, bias_grad=bias_grad)  # fmt: skip
    d_ranges = masks.integer_cotangent(mask_ranges)
    if bwd_config is not None:
        is_causal, window = _window(band)
        score_mod, mask_mod = _staged(mods)
        if score_mod is not None and score_grad is None:  # no gradient of the program's values is wanted
            score_mod = score_mod.without_grads()
        dq, dk, dv, d_rows, d_cols, *dbias = hopper_bwd.hopper_backward(
            q,
            k,
            v,
            out,
            lse,
            d_out,
            d_lse,
            scale=scale,
            is_causal=is_causal,
            local_window_size=window,
            q_segment_ids=q_ids,
            kv_segment_ids=kv_ids,
            config=bwd_config,
            score_mod=score_mod,
            score_stacks=score_stacks,
            mask_mod=mask_mod,
            mask_stacks=mask_stacks,
            **_dropout(mods, mod_arrays),
            **_dense(mods, mod_arrays),
            **({} if block_mask is None else dict(block_mask=block_mask)),
            **({} if mods.bias_dims is None else dict(bias_grad=bias_grad)),
        )
        # The score program's arrays get their gradient through the float stacks (XLA's autodiff of
        # `Staged.stacks`); the integer ones and the mask program's have none.
        d_score = list(_zero_stacks(score_stacks))
        for i, d in ((1, d_rows), (3, d_cols)):
            if d is not None:
                d_score[i] = d
        return (
            dq,
            dk,
            dv,
            masks.integer_cotangent(q_ids),
            masks.integer_cotangent(kv_ids),
            tuple(d_score),
            _zero_stacks(mask_stacks),
            d_ranges,
            mod_arrays.cotangents(*dbias),  # dbias in the bias's own shape and dtype (None: a zero)
        )
    dq, dk, dv, d_q_ids, d_kv_ids, d_mods = portable.backward(
        q,
        k,
        v,
        out,
        lse,
        (d_out, jnp.zeros(lse.shape, lse.dtype) if d_lse is None else d_lse),
        scale=scale,
        band=band,
        config=config,
        interpret=False,
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        block_mask=block_mask,
        mods=mods,
        mod_arrays=mod_arrays,
    )
    # The portable backward differentiates the programs' arrays themselves: the stacks get zeros.
    return dq, dk, dv, d_q_ids, d_kv_ids, _zero_stacks(score_stacks), _zero_stacks(mask_stacks), d_ranges, d_mods


_attention.defvjp(_attention_fwd_rule, _attention_bwd, symbolic_zeros=True)


def _program_inputs(query, key, mods, mod_arrays, *, config, band, with_ranges: bool, head_dim_v=None,
                    block_mask=None):  # fmt: skip
    """(score_stacks, mask_stacks, mask_ranges) of a call's programs, computed in XLA: each program's staged values
    (`mods.Staged.stacks`; the score's are differentiable in its closed-over arrays) and, `with_ranges`, the
    mask's block ranges at the forward's tiles (value's `head_dim_v` in them; only the forward reads them; else
    None)."""
    staged = _staged(mods)
    if isinstance(staged, str):
        raise ValueError(f"the Mosaic GPU kernel cannot run this call's {staged}")
    score_mod, mask_mod = staged
    batch, q_len, heads, head_dim = query.shape
    kv_len = key.shape[1]
    score_stacks = mask_stacks = (None,) * 4
    mask_ranges = None
    if score_mod is not None:
        score_stacks = score_mod.stacks(mod_arrays.score_consts, batch, heads, q_len, kv_len)
    if mask_mod is not None:
        # Neither the mask's values nor its block ranges have a gradient (a bool result).
        consts = tuple(jax.lax.stop_gradient(c) for c in mod_arrays.mask_consts)
        mask_stacks = mask_mod.stacks(consts, batch, heads, q_len, kv_len)
        if with_ranges:
            mask_ranges = hopper_fwd.mask_ranges(
                mask_mod,
                consts,
                batch=batch,
                heads=heads,
                q_len=q_len,
                kv_len=kv_len,
                config=_hopper_config(
                    config,
                    head_dim,
                    kv_len,
                    band,
                    _tile_bytes(mods, mod_arrays),
                    head_dim_v,
                    block_mask,
                    _sparse_rows(mods, block_mask),
                ),
            )
    return score_stacks, mask_stacks, mask_ranges


def flash_attention_hopper(
    query,
    key,
    value,
    *,
    scale: float,
    band: masks.Band,
    config: KernelConfig,
    q_segment_ids=None,
    kv_segment_ids=None,
    deterministic: bool = True,
    mods: masks.ScoreMods = masks.ScoreMods(),
    mod_arrays: masks.ModArrays = masks.ModArrays(),
    block_mask: BlockMask | None = None,
):
    """Shapes and results as `reference.attention_reference` (bf16/fp16 on sm90; a band (causal, local
    window) and segment ids (which carry per-example lengths too, see `api._segments`)); differentiable in
    query, key and value (and through the returned LSE). deterministic=False lets the backward add dQ
    in a free order where that is faster (`HopperBwdConfig.default`), unless config.hopper_bwd is set.
    `mods`: of the score modifiers, the kernels run a score_mod and a mask_mod (`unsupported_reason` says
    which ones they can stage), with their arrays in `mod_arrays` (score_consts, mask_consts; the score_mod's
    float arrays get gradients), and dropout (dropout_rate, broadcast_dropout, with mod_arrays.dropout_seed:
    the keep mask of every implementation, `masks.dropout_keep_mask`). `block_mask`: a `BlockMask` (None: none),
    served by the kernels' block ranges or as a dense mask (`_serve_block_mask`)."""
    block_mask, mods, mod_arrays = _serve_block_mask(
        block_mask, query, key, value, band=band, config=config, mods=mods, mod_arrays=mod_arrays,
        deterministic=deterministic
    )  # fmt: skip
    score_stacks, mask_stacks, mask_ranges = _program_inputs(
        query, key, mods, mod_arrays, config=config, band=band, with_ranges=True, head_dim_v=value.shape[-1],
        block_mask=block_mask
    )  # fmt: skip
    return _attention(
        query,
        key,
        value,
        q_segment_ids,
        kv_segment_ids,
        score_stacks,
        mask_stacks,
        mask_ranges,
        mod_arrays,
        scale,
        band,
        config,
        deterministic,
        mods,
        block_mask,
    )


def backward(
    query,
    key,
    value,
    out,
    lse,
    d_out,
    d_lse,
    *,
    scale: float,
    band: masks.Band,
    config: KernelConfig,
    q_segment_ids=None,
    kv_segment_ids=None,
    deterministic: bool = True,
    mods: masks.ScoreMods = masks.ScoreMods(),
    mod_arrays: masks.ModArrays = masks.ModArrays(),
    block_mask: BlockMask | None = None,
):
    """`flash_attention_hopper`'s backward on given residuals (out [batch, q_len, heads, head_dim], lse [batch,
    heads, q_len]) and cotangents: (dq, dk, dv). Arguments as `flash_attention_hopper`'s."""
    block_mask, mods, mod_arrays = _serve_block_mask(
        block_mask, query, key, value, band=band, config=config, mods=mods, mod_arrays=mod_arrays,
        deterministic=deterministic
    )  # fmt: skip
    score_stacks, mask_stacks, _ = _program_inputs(
        query, key, mods, mod_arrays, config=config, band=band, with_ranges=False
    )
    # The mask's block ranges (None here) steer only the forward; the backward returns their integer cotangent.
    # Only dq, dk and dv are returned: no bias gradient and none of the score program's values (the two Nones).
    residuals = (query, key, value, q_segment_ids, kv_segment_ids, score_stacks, mask_stacks, None, mod_arrays, out,
                 lse, None, None)  # fmt: skip
    return _attention_bwd(scale, band, config, deterministic, mods, block_mask, residuals, (d_out, d_lse))[:3]


def _ranges_reason(block_mask: BlockMask, query, key, head_dim_v: int, *, band: masks.Band, config: KernelConfig,
                   mods: masks.ScoreMods, mod_arrays=None, deterministic: bool = True) -> str | None:  # fmt: skip
    """None if the kernels' block ranges alone serve `block_mask` exactly at the tiles this call runs (the forward's
    and, where the Mosaic GPU backward runs, both its passes'), else why not (`block_sparse.exact_by_ranges`)."""
    head_dim, kv_len = query.shape[-1], key.shape[1]
    tile_bytes = _tile_bytes(mods, mod_arrays)
    sparse = _sparse_rows(mods, block_mask)
    forward = _hopper_config(config, head_dim, kv_len, band, tile_bytes, head_dim_v, block_mask, sparse)
    if forward is None:
        return "no forward tiles fit"
    query_tiles, key_tiles = [(NUM_CONSUMERS * forward.block_q, forward.block_kv)], []
    bwd = _backward_config(config, head_dim, kv_len, band, deterministic, mods, tile_bytes, head_dim_v, block_mask)
    if bwd is not None:
        dq_tiles, dkdv_tiles, _ = hopper_bwd.pass_tiles(bwd)
        query_tiles.append(dq_tiles)
        key_tiles.append(dkdv_tiles)
    return block_sparse.exact_by_ranges(
        block_mask, q_len=query.shape[1], kv_len=kv_len, kv_heads=key.shape[2], query_tiles=query_tiles,
        key_tiles=key_tiles, beside_other_masks=mods.mask_mod is not None or mods.mask_dims is not None
    )  # fmt: skip


def _with_dense_mask(mods: masks.ScoreMods, lead) -> masks.ScoreMods:
    """`mods` with a dense mask over queries and keys (ANDed into any it has), `lead` the (batch, heads) sizes
    (1: broadcast) of the mask added."""
    dims = tuple(d > 1 for d in lead) + (True, True)
    if mods.mask_dims is not None:
        dims = tuple(a or b for a, b in zip(dims, mods.mask_dims))
    return dataclasses.replace(mods, mask_dims=dims)


def _serve_block_mask(block_mask, query, key, value, *, band, config, mods, mod_arrays, deterministic):
    """(block_mask, mods, mod_arrays) as the kernels take a call's `BlockMask` (None: none): kept where their
    block ranges alone serve it exactly (`_ranges_reason`), else expanded on the device into a token mask ANDed
    into the dense mask (None then): exact for any pattern (strided, global + local), the dense mask's block
    ranges still skip its dropped blocks, at the cost of its int8 tiles in the rings."""
    if block_mask is None:
        return None, mods, mod_arrays
    reason = _ranges_reason(block_mask, query, key, value.shape[-1], band=band, config=config, mods=mods,
                            mod_arrays=mod_arrays, deterministic=deterministic)  # fmt: skip
    if reason is None:
        return block_mask, mods, mod_arrays
    _logger.debug("pallas_flash: the block mask runs as a dense mask in the Mosaic GPU kernels: %s", reason)
    tokens = jnp.asarray(block_mask.mask)
    tokens = jnp.repeat(jnp.repeat(tokens, block_mask.block_q, axis=2), block_mask.block_kv, axis=3)
    tokens = tokens[:, :, : query.shape[1], : key.shape[1]]
    if mods.mask_dims is not None:
        tokens = jnp.logical_and(mod_arrays.mask, tokens)
    return None, _with_dense_mask(mods, block_mask.shape[:2]), mod_arrays._replace(mask=tokens)
