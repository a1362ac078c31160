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
from pallas_flash.config import H100_SHARED_MEMORY, HopperBwdConfig, HopperConfig, KernelConfig
from pallas_flash.kernels import hopper_bwd, hopper_fwd, portable

_logger = logging.getLogger("pallas_flash")


def use_hopper_backward() -> bool:
    """The Hopper backward is the default since its first H100 run (correct on the grid, 0.89-1.15x cuDNN
    fwd+bwd against the portable backward's 0.78-0.95x); PALLAS_FLASH_HOPPER_BWD=0 selects the portable one.
    Read at trace time, so a benchmark can compare both backwards in one process."""
    return os.environ.get("PALLAS_FLASH_HOPPER_BWD", "1") != "0"


def on_hopper_gpu() -> bool:
    return hopper_fwd.on_hopper()


def _hopper_config(config: KernelConfig, head_dim: int, kv_len: int, is_causal: bool) -> HopperConfig:
    return config.hopper or HopperConfig.default(hopper_fwd.padded_head_dim(head_dim), kv_len, is_causal)


def unsupported_reason(query, key, *, band: masks.Band, unserved=(), config: KernelConfig) -> str | None:
    """None if the Hopper kernel serves this call on this machine, else why not (for the dispatcher).
    `unserved`: names of the call's features the Hopper kernel does not have."""
    if not on_hopper_gpu():
        return ("the Mosaic GPU kernel needs an sm90 (Hopper) GPU (JAX 0.10.2's Mosaic GPU interpreter cannot run "
                "it on CPU: its wgmma rejects the transposed K tile)")
    if not any(query.dtype == d for d in hopper_fwd.SUPPORTED_DTYPES):
        return f"the Mosaic GPU kernel takes bfloat16 or float16, got {query.dtype}"
    if unserved:
        return f"the Mosaic GPU kernel has no {' or '.join(unserved)} yet"
    if not (band.is_full or (band.left is None and band.right == 0)):
        return "the Mosaic GPU kernel has no local window yet (causal or full attention only)"
    head_dim = query.shape[-1]
    if head_dim > hopper_fwd.MAX_HEAD_DIM:
        return f"the Mosaic GPU kernel takes head_dim <= {hopper_fwd.MAX_HEAD_DIM}, got {head_dim}"
    hopper_config = _hopper_config(config, head_dim, key.shape[1], band.right == 0)
    needed = hopper_config.smem_bytes(hopper_fwd.padded_head_dim(head_dim))
    if needed > H100_SHARED_MEMORY:
        return f"{hopper_config} needs {needed} bytes of shared memory at head_dim {head_dim}"
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, scale, is_causal, config):
    return _attention_fwd(q, k, v, scale, is_causal, config)[0]


def _attention_fwd(q, k, v, scale, is_causal, config):
    out, lse = hopper_fwd.hopper_forward(q, k, v, scale=scale, is_causal=is_causal,
                                         config=_hopper_config(config, q.shape[-1], k.shape[1], is_causal))
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(scale, is_causal, config, residuals, cotangents):
    q, k, v, out, lse = residuals
    if use_hopper_backward() and hopper_fwd.padded_head_dim(q.shape[-1]) <= hopper_bwd.MAX_HEAD_DIM:
        bwd_config = config.hopper_bwd or HopperBwdConfig.default(hopper_fwd.padded_head_dim(q.shape[-1]))
        d_out, d_lse = cotangents
        return hopper_bwd.hopper_backward(q, k, v, out, lse, d_out, d_lse, scale=scale, is_causal=is_causal,
                                          config=bwd_config)
    if use_hopper_backward():
        _logger.debug("pallas_flash: the Hopper backward takes head_dim <= %d; head_dim %d runs the portable "
                      "backward", hopper_bwd.MAX_HEAD_DIM, q.shape[-1])
    dq, dk, dv, *_ = portable.backward(q, k, v, out, lse, cotangents, scale=scale, band=masks.Band.of(is_causal),
                                       config=config, interpret=False)
    return dq, dk, dv


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_hopper(query, key, value, *, scale: float, is_causal: bool, config: KernelConfig):
    """Shapes and results as `reference.attention_reference` (bf16/fp16, causal or full attention, on sm90);
    differentiable in query, key and value (and through the returned LSE)."""
    return _attention(query, key, value, scale, is_causal, config)

