"""The Hopper kernels lowered for CUDA on this machine (Mosaic GPU's lowering runs without a GPU; nothing
runs): every variant of the forward and the backward, ragged, GQA, padded head_dim, bands and segment ids,
under the kernel names a profile shows."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from pallas_flash import masks
from pallas_flash.config import KernelConfig
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper import vjp as hopper_vjp
from pallas_flash.hopper.config import HopperBwdConfig, HopperConfig
from tests.helpers import HOPPER_BACKWARD_VARIANTS, MOSAIC_CALL, abstract_inputs, lower_for_cuda

pytestmark = pytest.mark.lowering


def _overlap_params():
    """Each mask and schedule at head_dim 128 (where the overlap is the default), and once at 64 and 256; the
    rest is `slow`."""
    fast = {(128, 0), (128, 1), (128, 2), (64, 1), (256, 2)}
    return [
        pytest.param(head_dim, block_kv, *case, marks=() if (head_dim, i) in fast else pytest.mark.slow)
        for head_dim, block_kv in ((64, 128), (128, 128), (256, 64))
        for i, case in enumerate([(False, False, False), (True, False, True), (False, True, False)])
    ]


@pytest.mark.parametrize("head_dim, block_kv, is_causal, segments, persistent", _overlap_params())
def test_overlapped_hopper_forward_lowers_for_gpu(head_dim, block_kv, is_causal, segments, persistent):
    """`HopperConfig.overlap` goes through Mosaic GPU's lowering (wgmma on a register operand while another
    group is in flight, the partial wait), ragged and GQA, with the masked/unmasked loop split; the kernel
    carries the name a profile shows."""
    q, k, _, ids = abstract_inputs((2, 300, 333, 4, 2, head_dim), segments)
    config = HopperConfig(64, block_kv, 2, persistent, overlap=True)

    def forward(q, k, v, q_ids, kv_ids):
        return hopper_fwd.hopper_forward(
            q, k, v, scale=0.1, is_causal=is_causal, q_segment_ids=q_ids, kv_segment_ids=kv_ids, config=config
        )

    text = lower_for_cuda(forward, q, k, k, *ids)
    assert text.count(MOSAIC_CALL) == 1
    assert "flash_forward_sm90" in text


def _variant_params():
    """Every variant at both shapes, causal at the first (q_len > kv_len) and not at the second (a padded
    head_dim, q_len < kv_len); the other causality at each shape is `slow`."""
    shapes = [((1, 300, 200, 4, 2, 64), jnp.bfloat16), ((1, 200, 333, 2, 1, 96), jnp.float16)]
    return [
        pytest.param(shape, dtype, is_causal, variant, marks=() if is_causal == (i == 0) else pytest.mark.slow)
        for variant in HOPPER_BACKWARD_VARIANTS
        for is_causal in (False, True)
        for i, (shape, dtype) in enumerate(shapes)
    ]


@pytest.mark.parametrize("shape, dtype, is_causal, variant", _variant_params())
def test_lowers_for_gpu(shape, dtype, is_causal, variant):
    """Both backward kernels (or, with dq_atomic, the one-pass kernel and its TMA reduce-adds into a dQ buffer)
    go through Mosaic GPU's lowering (ragged lengths, GQA, head_dim 96 on 64-byte swizzled tiles), under the names
    a profile shows; the one pass refuses 96 by name."""
    batch, q_len, kv_len, heads, kv_heads, head_dim = shape
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), dtype)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), dtype)
    lse = jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)
    config = dataclasses.replace(
        HopperBwdConfig.default(128 if head_dim > 64 else 64), **HOPPER_BACKWARD_VARIANTS[variant]
    )
    dq_atomic = config.dq_atomic

    def backward(*args):
        return hopper_bwd.hopper_backward(*args, scale=0.125, is_causal=is_causal, config=config)

    if dq_atomic and head_dim % 64:  # 96 runs on 64-byte swizzled Q/K tiles; the one pass's dS tiles are 128-byte
        with pytest.raises(ValueError, match="multiples of 64"):
            lower_for_cuda(backward, q, k, k, q, lse, q, lse)
        return
    text = lower_for_cuda(backward, q, k, k, q, lse, q, lse)
    assert text.count(MOSAIC_CALL) == (1 if dq_atomic else 2)
    assert ("cp.reduce.async.bulk.tensor" in text) == dq_atomic
    assert "flash_backward_dkdv_sm90" in text and ("flash_backward_dq_sm90" in text) != dq_atomic


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    "head_dim, dtype",
    [
        (64, jnp.float16),
        (128, jnp.bfloat16),  # test_lowers_for_gpu's one_pass runs (64, bf16), (96 -> 128, fp16)
        pytest.param(64, jnp.bfloat16, marks=pytest.mark.slow),
        pytest.param(128, jnp.float16, marks=pytest.mark.slow),
    ],
)
def test_one_pass_lowers_for_gpu(head_dim, is_causal, dtype):
    """The one-pass kernel (shared dS^T tile, each consumer's share of dQ from all keys: columns at head_dim
    128, query rows at 64; two dQ staging slots) goes through Mosaic GPU's lowering: ragged, GQA."""
    q = jax.ShapeDtypeStruct((1, 200, 4, head_dim), dtype)
    k = jax.ShapeDtypeStruct((1, 333, 2, head_dim), dtype)
    lse = jax.ShapeDtypeStruct((1, 4, 200), jnp.float32)
    config = dataclasses.replace(HopperBwdConfig.default(head_dim), dq_atomic=True, dq_ordered=False, num_stages_dkv=2)

    def backward(*args):
        return hopper_bwd.hopper_backward(*args, scale=0.125, is_causal=is_causal, config=config)

    text = lower_for_cuda(backward, q, k, k, q, lse, q, lse)
    assert text.count(MOSAIC_CALL) == 1
    assert "cp.reduce.async.bulk.tensor" in text


MASKS = [((30, 5), False), ((40, None), True), (None, True)]  # (local window, segment ids)


@pytest.mark.parametrize(
    "window, segments, is_causal",
    [
        pytest.param(*mask, is_causal, marks=() if is_causal == (i == 1) else pytest.mark.slow)
        for i, mask in enumerate(MASKS)
        for is_causal in (False, True)
    ],
)  # causal with the window and segment ids
def test_masked_forward_lowers_for_gpu(window, segments, is_causal):
    """The forward with a local window and/or segment ids (the key ids streamed beside K) goes through Mosaic
    GPU's lowering."""
    q, k, _, ids = abstract_inputs((2, 300, 200, 4, 2, 64), segments)

    def forward(q, k, v, q_ids, kv_ids):
        return hopper_fwd.hopper_forward(
            q,
            k,
            v,
            q_segment_ids=q_ids,
            kv_segment_ids=kv_ids,
            scale=0.125,
            is_causal=is_causal,
            local_window_size=window,
        )

    assert lower_for_cuda(forward, q, k, k, *ids).count(MOSAIC_CALL) == 1


def _masked_backward_params():
    """Every variant with a window and segment ids together; each alone is `slow` (CI's time: the masks' code is
    the same in every variant, and the interpreter tests run each alone)."""
    params = []
    for variant in HOPPER_BACKWARD_VARIANTS:
        for i, (window, segments) in enumerate(MASKS):
            fast = i == 1
            params.append(pytest.param(window, segments, variant, marks=() if fast else pytest.mark.slow))
    return params


@pytest.mark.parametrize("window, segments, variant", _masked_backward_params())
def test_masked_backward_lowers_for_gpu(window, segments, variant):
    """Both backward kernels (or the one pass) with a local window and/or segment ids (their ids streamed
    beside K or Q) go through Mosaic GPU's lowering, causal or not."""
    q, k, lse, ids = abstract_inputs((2, 300, 200, 4, 2, 64), segments)
    config = dataclasses.replace(HopperBwdConfig.default(64), **HOPPER_BACKWARD_VARIANTS[variant])
    for is_causal in (False, True):

        def backward(q, k, v, out, lse, d_out, d_lse, q_ids, kv_ids):
            return hopper_bwd.hopper_backward(
                q,
                k,
                v,
                out,
                lse,
                d_out,
                d_lse,
                q_segment_ids=q_ids,
                kv_segment_ids=kv_ids,
                config=config,
                scale=0.125,
                is_causal=is_causal,
                local_window_size=window,
            )

        text = lower_for_cuda(backward, q, k, k, q, lse, q, lse, *ids)
        assert text.count(MOSAIC_CALL) == (1 if config.dq_atomic else 2)


@pytest.mark.parametrize(
    "head_dim, is_causal, window, segments",
    [
        pytest.param(64, False, None, False, marks=pytest.mark.slow),
        pytest.param(64, True, None, False, marks=pytest.mark.slow),
        (64, False, (40, 10), True),
        (64, True, None, True),
        (128, False, None, False),
        (128, False, (40, 10), True),  # dQ split by columns instead of rows
        pytest.param(128, True, None, False, marks=pytest.mark.slow),
        pytest.param(128, True, None, True, marks=pytest.mark.slow),
    ],
)
def test_dq_ordered_lowers_for_gpu(head_dim, is_causal, window, segments):
    """The deterministic one-pass kernel (dq_ordered) goes through Mosaic GPU's lowering: one kernel, its TMA
    reduce-adds into the dQ buffer, a GPU-scope acquire wait and release signal on global semaphores, which
    XLA passes in as a zeroed int32 buffer of one counter per (batch, query head, query block), aliased to an
    output; ragged lengths, GQA, bands and segment ids. The one-pass kernel without dq_ordered has none.
    The ordered kernel's float32 dQ buffer is an output (its first visitors store), not a zeroed input."""
    batch, q_len, heads = 2, 300, 4
    q, k, lse, ids = abstract_inputs((batch, q_len, 333, heads, 2, head_dim), segments)
    one_pass = dataclasses.replace(HopperBwdConfig.default(head_dim), dq_atomic=True, num_stages_dkv=2)
    texts = {}
    for ordered in (False, True):
        config = dataclasses.replace(one_pass, dq_ordered=ordered)

        def backward(q, k, v, out, lse, d_out, d_lse, q_ids, kv_ids):
            return hopper_bwd.hopper_backward(
                q,
                k,
                v,
                out,
                lse,
                d_out,
                d_lse,
                q_segment_ids=q_ids,
                kv_segment_ids=kv_ids,
                scale=0.125,
                is_causal=is_causal,
                local_window_size=window,
                config=config,
            )

        texts[ordered] = lower_for_cuda(backward, q, k, k, q, lse, q, lse, *ids)
    granule = math.lcm(one_pass.block_q_dkv, 2 * one_pass.block_q_dq)  # of the padded query length
    counters = f"tensor<{batch * heads * (-(-q_len // granule) * granule // one_pass.block_q_dkv)}xi32>"
    dq_buffer = f"tensor<{batch}x{granule * -(-q_len // granule)}x{heads}x{head_dim}xf32>"
    for ordered, text in texts.items():
        assert text.count(MOSAIC_CALL) == 1
        call = next(line for line in text.splitlines() if MOSAIC_CALL in line)
        operand_types, result_types = call[call.rindex(": (") :].split("->")
        assert (dq_buffer in operand_types) != ordered and dq_buffer in result_types
        assert "cp.reduce.async.bulk.tensor" in text
        for ptx in ("red.release.gpu.global.add", "ld.relaxed.gpu.global", "fence.acquire.gpu"):
            assert (ptx in text) == ordered, ptx
        assert (counters in text) == ordered


@pytest.mark.parametrize(
    "head_dim, deterministic, is_causal, kernels",
    [
        (64, True, False, 2),
        (64, True, True, 3),
        pytest.param(64, False, True, 2, marks=pytest.mark.slow),
        (128, True, False, 3),
        pytest.param(128, False, True, 3, marks=pytest.mark.slow),
    ],
)  # test_dq_ordered_config: the same config
def test_deterministic_picks_the_backward(head_dim, deterministic, is_causal, kernels):
    """jax.grad of the Hopper attention lowers to forward + dK/dV + dQ kernels (3) at head_dim 128, and to the
    one-pass backward (2: its dK/dV kernel sums dQ) at head_dim 64, where it measured faster: with its dQ
    adds ordered by semaphores unless deterministic=False; deterministic causal calls of up to 2k keys (these
    have 333) keep the two passes. Also under jax.vmap, which the one-pass kernel only takes through
    `_fold_vmap`."""
    q = jax.ShapeDtypeStruct((3, 1, 200, 4, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((3, 1, 333, 2, head_dim), jnp.bfloat16)

    def loss(q, k, v):
        out, _ = hopper_vjp.flash_attention_hopper(
            q,
            k,
            v,
            scale=0.125,
            band=masks.Band.of(is_causal, None),
            config=KernelConfig(),
            deterministic=deterministic,
        )
        return out.astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    for fn, args in ((grad, (q.update(shape=q.shape[1:]), k.update(shape=k.shape[1:]))), (jax.vmap(grad), (q, k))):
        text = lower_for_cuda(fn, args[0], args[1], args[1])
        assert text.count(MOSAIC_CALL) == kernels
        assert ("cp.reduce.async.bulk.tensor" in text) == (kernels == 2)
        assert ("red.release.gpu.global.add" in text) == (kernels == 2 and deterministic)
