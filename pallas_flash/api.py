"""The public entry point: argument checking, layout, and dispatch over implementations."""
from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from pallas_flash import reference, xla_chunked
from pallas_flash.config import KernelConfig
from pallas_flash.kernels import portable

logger = logging.getLogger("pallas_flash")

IMPLEMENTATIONS = ("pallas", "xla_chunked", "xla")
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256

_logged: set = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.debug(message)


def _on_nvidia_gpu() -> bool:
    return jax.default_backend() == "gpu" and jax.devices()[0].device_kind.upper().startswith("NVIDIA")


def _check_inputs(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
        if not any(x.dtype == d for d in SUPPORTED_DTYPES):
            raise TypeError(f"{name} has dtype {x.dtype}; allowed: float32, bfloat16, float16")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    batch, q_len, heads, head_dim = query.shape
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[0] != batch:
        raise ValueError(f"key has batch {key.shape[0]}; query has batch {batch}")
    if key.shape[3] != head_dim:
        raise ValueError(f"key has head_dim {key.shape[3]}; query has head_dim {head_dim}")
    if q_len < 1 or key.shape[1] < 1:
        raise ValueError(f"sequence lengths must be >= 1, got q_len={q_len}, kv_len={key.shape[1]}")
    if heads % key.shape[2] != 0:
        raise ValueError(f"key has {key.shape[2]} heads; query's {heads} heads must be a multiple of it")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim is {head_dim}; allowed: {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")


def _choose_implementation(implementation):
    if implementation is None:
        chosen = "pallas" if _on_nvidia_gpu() else "xla_chunked"
        _log_once(f"pallas_flash: implementation=None ran {chosen!r} on backend {jax.default_backend()!r}")
        return chosen
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "pallas" and not _on_nvidia_gpu():
        _log_once("pallas_flash: implementation='pallas' without an NVIDIA GPU runs the kernels in Pallas "
                  "interpret mode (slow; for tests and debugging)")
    return implementation


def flash_attention(query, key, value, *, scale=None, is_causal=False, return_lse=False,
                    implementation=None, config=None):
    """Exact scaled dot-product attention in O(seq) memory.

    Args:
      query: [batch, q_len, heads, head_dim].
      key, value: [batch, kv_len, kv_heads, head_dim], heads % kv_heads == 0 (MHA, GQA, MQA): query head h
        reads kv head h // (heads // kv_heads). q_len and kv_len may differ.
      scale: softmax scale; default 1 / sqrt(head_dim).
      is_causal: query i sees key j iff j <= i, as in `jax.nn.dot_product_attention`.
      return_lse: also return the log-sum-exp of the scaled logits, [batch, heads, q_len] float32.
      implementation: None (best available: "pallas" on an NVIDIA GPU, else "xla_chunked"), or force
        "pallas" (interpret mode without a GPU), "xla_chunked" or "xla" (dense reference).
      config: a `KernelConfig`; default `KernelConfig.default(head_dim)`.
    Returns:
      out [batch, q_len, heads, head_dim] in query's dtype, and lse if `return_lse`. A query that sees no
      key gets zeros and lse = -inf.
    """
    _check_inputs(query, key, value)
    head_dim = query.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite Python float, got {scale!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if config is None:
        config = KernelConfig.default(head_dim)
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a pallas_flash.KernelConfig, got {type(config).__name__}")
    scale = float(scale)

    impl = _choose_implementation(implementation)
    if impl == "pallas":
        out, lse = portable.flash_attention_portable(
            query, key, value, scale=scale, is_causal=is_causal, config=config,
            interpret=not _on_nvidia_gpu())
    elif impl == "xla_chunked":
        out, lse = xla_chunked.attention_chunked(
            query, key, value, scale=scale, is_causal=is_causal, block_kv=config.xla_block_kv)
    else:
        out, lse = reference.attention_reference(query, key, value, scale=scale, is_causal=is_causal)
    return (out, lse) if return_lse else out
