"""The attention implementations the harness puts side by side: ours and the peers.

Each entry turns a benchmark point into a function `(q, k, v) -> out` over [batch, seq, heads, head_dim]
arrays, or raises `Unsupported` with the reason it cannot run that point. Which version of JAX moved
which name is handled here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_flash as pf
from pallas_flash.device import on_hopper_gpu, on_nvidia_gpu


class Unsupported(Exception):
    """The implementation cannot run this point (wrong device, dtype, shape or feature)."""


@dataclasses.dataclass(frozen=True)
class Impl:
    """An implementation under test.

    `build(point)` returns the attention function. `scale_of(point)` is the softmax
    scale the function really applies (JAX's Mosaic GPU example has none of its own: it computes
    softmax(q k^T), so it is checked against the reference at scale 1). `dtype_of(point)` is the dtype
    it runs in; JAX's Mosaic GPU example accepts fp16 only and runs bf16 points in fp16, as ANCHORS.md
    measured it. `slow_on_cpu`: runs in Pallas interpret mode without a GPU.
    """

    name: str
    kind: str  # "ours" or "peer"
    build: Callable
    scale_of: Callable = lambda point: point.scale
    dtype_of: Callable = lambda point: point.dtype
    slow_on_cpu: bool = False


@functools.cache
def block_mask_of(point, q_len=None) -> pf.BlockMask:
    """The block mask of a block-sparse point (`point.pattern` at about `point.density`): 128 x 128 blocks
    (seq / 8 at smoke sizes). "local" is a symmetric window of key blocks, "strided" every 1/density-th block
    (Sparse Transformer's pattern). With `q_len`, only the rows of the first q_len queries (the check slice)."""
    block = min(128, max(16, point.seq_q // 8))
    num_kv_blocks = -(-point.seq_k // block)
    shape = dict(q_len=point.seq_q, kv_len=point.seq_k, block_q=block, block_kv=block)
    if point.pattern == "full":
        mask = pf.BlockMask.full(**shape)
    elif point.pattern == "local":  # the window whose density is nearest the target
        masks = [pf.BlockMask.local(window_blocks=w, **shape) for w in range(num_kv_blocks)]
        mask = min(masks, key=lambda m: abs(m.density() - point.density))
    elif point.pattern == "strided":
        mask = pf.BlockMask.strided(stride=round(1 / point.density), **shape)
    else:
        raise ValueError(f"unknown block-sparse pattern {point.pattern!r}")
    if q_len is None:
        return mask
    return pf.BlockMask(mask.mask[:, :, : -(-q_len // block)], block, block)


def _ours(name):
    def build(point):  # off the GPU, pallas_flash itself runs the kernels in interpret mode
        block_mask = block_mask_of(point) if point.pattern else None
        return lambda q, k, v: pf.flash_attention(
            q, k, v, scale=point.scale, is_causal=point.causal, block_mask=block_mask, implementation=name
        )

    return Impl(f"pf:{name}", "ours", build, slow_on_cpu=name in ("pallas", "mosaic"))


def _jax_nn(implementation):
    def build(point):
        if implementation == "cudnn" and not on_nvidia_gpu():
            raise Unsupported("cuDNN needs an NVIDIA GPU")
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=point.scale, is_causal=point.causal, implementation=implementation
        )

    return build


def _triton_ref(point):
    from jax.experimental.pallas.ops.gpu import attention

    kwargs = {}
    if min(point.seq_q, point.seq_k) < 128:  # its default blocks are 128 long; only tiny (smoke) points shrink them
        kwargs["block_sizes"] = attention.BlockSizes(
            block_q=min(128, point.seq_q),
            block_k=min(128, point.seq_k),
            block_q_dkv=32,
            block_kv_dkv=32,
            block_q_dq=32,
            block_kv_dq=32,
        )
    if point.heads != point.kv_heads:
        raise Unsupported("mha needs as many key heads as query heads")
    if not on_nvidia_gpu():
        kwargs["interpret"] = True
    return lambda q, k, v: attention.mha(q, k, v, None, sm_scale=point.scale, causal=point.causal, **kwargs)


def _mgpu_ref(point):
    if not on_hopper_gpu():
        raise Unsupported("the Mosaic GPU example needs a Hopper GPU")
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    if point.head_dim % 64:
        raise Unsupported("the Mosaic GPU example needs head_dim % 64 == 0")
    # The block sizes of the example's own benchmark (block_q 64, block_kv 128) and 64-blocks backward.
    block_kv = 128 if point.seq_k % 128 == 0 else 64
    if point.seq_q % 64 or point.seq_k % block_kv:
        raise Unsupported("the Mosaic GPU example needs seq % 64 == 0")
    config = attention_mgpu.TuningConfig(
        block_q=64,
        block_kv=block_kv,
        max_concurrent_steps=2,
        causal=point.causal,
        block_q_dkv=64,
        block_kv_dkv=64,
        block_q_dq=64,
        block_kv_dq=64,
    )
    return lambda q, k, v: attention_mgpu.attention(q, k, v, config)


def _tokamax(implementation):
    def build(point):
        tokamax = importlib.import_module("tokamax")
        return lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, scale=point.scale, is_causal=point.causal, implementation=implementation
        )

    return build


def _fp16_only(point):
    return jnp.float16 if point.dtype in (jnp.bfloat16, jnp.float16) else point.dtype


def all_impls() -> list[Impl]:
    """cuDNN first (the bar every ratio refers to), then ours (every value of `pallas_flash.IMPLEMENTATIONS`,
    so a new implementation is picked up without touching the harness), then the other peers."""
    impls = [Impl("cudnn", "peer", _jax_nn("cudnn"))]
    impls += [_ours(name) for name in pf.IMPLEMENTATIONS]
    impls += [
        Impl("xla", "peer", _jax_nn("xla")),
        Impl("pallas_triton_ref", "peer", _triton_ref, slow_on_cpu=True),
        Impl("pallas_mgpu_ref", "peer", _mgpu_ref, scale_of=lambda point: 1.0, dtype_of=_fp16_only),
    ]
    if tokamax_available():
        impls += [Impl(f"tokamax_{name}", "peer", _tokamax(name)) for name in ("mosaic", "triton")]
    return impls


def tokamax_available() -> bool:
    try:
        importlib.import_module("tokamax")
    except ImportError:
        return False
    return True


def baseline_name() -> str:
    """The implementation every ratio refers to: cuDNN on an NVIDIA GPU, else our dense XLA path (the smoke runs
    on CPU, where the ratios mean nothing but exercise the same code; `jax.nn`'s "xla" rejects fp16 there)."""
    return "cudnn" if on_nvidia_gpu() else "pf:xla"
