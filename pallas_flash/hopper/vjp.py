"""The Hopper implementation ("mosaic") as one differentiable function, and the rule that says whether it
can serve a call: the Mosaic GPU forward (`fwd`) and a backward on the same residuals (q, k, v, o, lse): the
Mosaic GPU backward (`bwd`, head_dim <= 128), or the portable backward kernels for larger head_dim or where
`HopperBwdConfig.portable` asks for them. Both forwards return the same natural-log LSE, so the portable
backward cannot tell which forward ran.
"""

from __future__ import annotations

import functools
import logging

import jax

from pallas_flash import device, masks
from pallas_flash.config import KernelConfig
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper.common import SUPPORTED_DTYPES, padded_head_dim
from pallas_flash.hopper.config import H100_SHARED_MEMORY, HopperBwdConfig, HopperConfig
from pallas_flash.portable import vjp as portable

_logger = logging.getLogger("pallas_flash")


def _window(band: masks.Band):
    """The band as the kernels' (is_causal, local_window_size) arguments (`masks.Band.of` inverts it)."""
    return False, None if band.is_full else (band.left, band.right)


def _hopper_config(config: KernelConfig, head_dim: int, kv_len: int, band: masks.Band) -> HopperConfig:
    return config.hopper or hopper_fwd.default_config(padded_head_dim(head_dim), kv_len, band)


def unsupported_reason(query, key, *, band: masks.Band, unserved=(), config: KernelConfig) -> str | None:
    """None if the Hopper kernel serves this call on this machine, else why not (for the dispatcher).
    `unserved`: names of the call's features the Hopper kernel does not have."""
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
    head_dim = query.shape[-1]
    if head_dim > hopper_fwd.MAX_HEAD_DIM:
        return f"the Mosaic GPU kernel takes head_dim <= {hopper_fwd.MAX_HEAD_DIM}, got {head_dim}"
    hopper_config = _hopper_config(config, head_dim, key.shape[1], band)
    needed = hopper_config.smem_bytes(padded_head_dim(head_dim))
    if needed > H100_SHARED_MEMORY:
        return f"{hopper_config} needs {needed} bytes of shared memory at head_dim {head_dim}"
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, q_ids, kv_ids, scale, band, config, deterministic):
    return _attention_fwd(q, k, v, q_ids, kv_ids, scale, band, config, deterministic)[0]


def _attention_fwd(q, k, v, q_ids, kv_ids, scale, band, config, deterministic):
    del deterministic  # the forward is deterministic either way
    is_causal, window = _window(band)
    out, lse = hopper_fwd.hopper_forward(
        q,
        k,
        v,
        scale=scale,
        is_causal=is_causal,
        local_window_size=window,
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        config=_hopper_config(config, q.shape[-1], k.shape[1], band),
    )
    return (out, lse), (q, k, v, q_ids, kv_ids, out, lse)


def _backward_config(
    config: KernelConfig, head_dim: int, kv_len: int, band: masks.Band, deterministic: bool
) -> HopperBwdConfig | None:
    """The Hopper backward's tiles for this call, or None where the portable backward runs instead."""
    if padded_head_dim(head_dim) > hopper_bwd.MAX_HEAD_DIM:
        _logger.debug(
            "pallas_flash: the Hopper backward takes head_dim <= %d; head_dim %d runs the portable backward",
            hopper_bwd.MAX_HEAD_DIM,
            head_dim,
        )
        return None
    if config.hopper_bwd is not None:
        return None if config.hopper_bwd.portable else config.hopper_bwd
    return hopper_bwd.default_config(padded_head_dim(head_dim), kv_len, band, deterministic)


def _attention_bwd(scale, band, config, deterministic, residuals, cotangents):
    q, k, v, q_ids, kv_ids, out, lse = residuals
    bwd_config = _backward_config(config, q.shape[-1], k.shape[1], band, deterministic)
    if bwd_config is not None:
        d_out, d_lse = cotangents
        is_causal, window = _window(band)
        dq, dk, dv = hopper_bwd.hopper_backward(
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
        )
        return dq, dk, dv, masks.integer_cotangent(q_ids), masks.integer_cotangent(kv_ids)
    dq, dk, dv, d_q_ids, d_kv_ids, _ = portable.backward(
        q,
        k,
        v,
        out,
        lse,
        cotangents,
        scale=scale,
        band=band,
        config=config,
        interpret=False,
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
    )
    return dq, dk, dv, d_q_ids, d_kv_ids


_attention.defvjp(_attention_fwd, _attention_bwd)


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
):
    """Shapes and results as `reference.attention_reference` (bf16/fp16 on sm90; a band (causal, local
    window) and segment ids (which carry per-example lengths too, see `api._segments`)); differentiable in
    query, key and value (and through the returned LSE). deterministic=False lets the backward add dQ
    in a free order where that is faster (`HopperBwdConfig.default`), unless config.hopper_bwd is set."""
    return _attention(query, key, value, q_segment_ids, kv_segment_ids, scale, band, config, deterministic)
