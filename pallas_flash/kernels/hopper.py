"""The Hopper implementation as one differentiable function: the Mosaic GPU forward (`hopper_fwd`) and a
backward on the same residuals (q, k, v, o, lse): the Mosaic GPU backward (`hopper_bwd`, head_dim <= 128) by
default, the portable backward kernels for larger head_dim or where `PALLAS_FLASH_HOPPER_BWD=0`.

Both forwards return the same natural-log LSE, so the portable backward cannot tell which forward ran.
"""
from __future__ import annotations

import functools
import logging
import os

import jax

from pallas_flash import masks
from pallas_flash.config import H100_SHARED_MEMORY, HopperConfig, KernelConfig
from pallas_flash.kernels import hopper_bwd, hopper_fwd, portable

_logger = logging.getLogger("pallas_flash")


def use_hopper_backward() -> bool:
    """The Hopper backward is the default since its first H100 run (correct on the grid, 0.89-1.15x cuDNN
    fwd+bwd against the portable backward's 0.78-0.95x); PALLAS_FLASH_HOPPER_BWD=0 selects the portable one.
    Read at trace time, so a benchmark can compare both backwards in one process."""
    return os.environ.get("PALLAS_FLASH_HOPPER_BWD", "1") != "0"


def on_hopper_gpu() -> bool:
    return hopper_fwd.on_hopper()


def _window(band: masks.Band):
    """The band as the kernels' (is_causal, local_window_size) arguments (`masks.Band.of` inverts it)."""
    return False, None if band.is_full else (band.left, band.right)


def _hopper_config(config: KernelConfig, head_dim: int, kv_len: int, band: masks.Band) -> HopperConfig:
    return config.hopper or hopper_fwd.default_config(hopper_fwd.padded_head_dim(head_dim), kv_len, band)


def unsupported_reason(query, key, *, band: masks.Band, unserved=(), config: KernelConfig) -> str | None:
    """None if the Hopper kernel serves this call on this machine, else why not (for the dispatcher).
    `unserved`: names of the call's features the Hopper kernel does not have."""
    if not on_hopper_gpu():
        return ("the Mosaic GPU kernel needs an sm90 (Hopper) GPU (on CPU, JAX's Mosaic GPU interpreter runs its "
                "kernels only as a test path, with plain dots for wgmma: hopper_fwd.hopper_forward and "
                "hopper_bwd.hopper_backward take interpret=)")
    if not any(query.dtype == d for d in hopper_fwd.SUPPORTED_DTYPES):
        return f"the Mosaic GPU kernel takes bfloat16 or float16, got {query.dtype}"
    if unserved:
        return f"the Mosaic GPU kernel has no {' or '.join(unserved)} yet"
    head_dim = query.shape[-1]
    if head_dim > hopper_fwd.MAX_HEAD_DIM:
        return f"the Mosaic GPU kernel takes head_dim <= {hopper_fwd.MAX_HEAD_DIM}, got {head_dim}"
    hopper_config = _hopper_config(config, head_dim, key.shape[1], band)
    needed = hopper_config.smem_bytes(hopper_fwd.padded_head_dim(head_dim))
    if needed > H100_SHARED_MEMORY:
        return f"{hopper_config} needs {needed} bytes of shared memory at head_dim {head_dim}"
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, q_ids, kv_ids, scale, band, config, deterministic):
    return _attention_fwd(q, k, v, q_ids, kv_ids, scale, band, config, deterministic)[0]


def _attention_fwd(q, k, v, q_ids, kv_ids, scale, band, config, deterministic):
    del deterministic  # the forward is deterministic either way
    is_causal, window = _window(band)
    out, lse = hopper_fwd.hopper_forward(q, k, v, scale=scale, is_causal=is_causal, local_window_size=window,
                                         q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                         config=_hopper_config(config, q.shape[-1], k.shape[1], band))
    return (out, lse), (q, k, v, q_ids, kv_ids, out, lse)


def _attention_bwd(scale, band, config, deterministic, residuals, cotangents):
    q, k, v, q_ids, kv_ids, out, lse = residuals
    if use_hopper_backward() and hopper_fwd.padded_head_dim(q.shape[-1]) <= hopper_bwd.MAX_HEAD_DIM:
        bwd_config = config.hopper_bwd or hopper_bwd.default_config(hopper_fwd.padded_head_dim(q.shape[-1]),
                                                                    k.shape[1], band, deterministic)
        d_out, d_lse = cotangents
        is_causal, window = _window(band)
        dq, dk, dv = hopper_bwd.hopper_backward(q, k, v, out, lse, d_out, d_lse, scale=scale, is_causal=is_causal,
                                                local_window_size=window, q_segment_ids=q_ids,
                                                kv_segment_ids=kv_ids, config=bwd_config)
        return dq, dk, dv, masks.integer_cotangent(q_ids), masks.integer_cotangent(kv_ids)
    if use_hopper_backward():
        _logger.debug("pallas_flash: the Hopper backward takes head_dim <= %d; head_dim %d runs the portable "
                      "backward", hopper_bwd.MAX_HEAD_DIM, q.shape[-1])
    dq, dk, dv, d_q_ids, d_kv_ids, _ = portable.backward(q, k, v, out, lse, cotangents, scale=scale, band=band,
                                                         config=config, interpret=False, q_segment_ids=q_ids,
                                                         kv_segment_ids=kv_ids)
    return dq, dk, dv, d_q_ids, d_kv_ids


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_hopper(query, key, value, *, scale: float, band: masks.Band, config: KernelConfig,
                           q_segment_ids=None, kv_segment_ids=None, deterministic: bool = True):
    """Shapes and results as `reference.attention_reference` (bf16/fp16 on sm90; a band (causal, local
    window) and segment ids (which carry per-example lengths too, see `api._segments`)); differentiable in
    query, key and value (and through the returned LSE). deterministic=False lets the backward add dQ
    in a free order where that is faster (`HopperBwdConfig.default`), unless config.hopper_bwd is set."""
    return _attention(query, key, value, q_segment_ids, kv_segment_ids, scale, band, config, deterministic)
