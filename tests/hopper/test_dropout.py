"""Dropout in the Hopper kernels: the forward and both backward passes in JAX's Mosaic GPU interpreter (race
detection on) against the float32 reference with the same seed (so the same keep mask, `masks.dropout_keep_mask`),
their lowering for CUDA in every backward variant, the dispatcher serving it, and on an H100 the public API
against the reference and against the portable kernels.

Tiles are 128 query rows (two consumers of 64) and 64-key blocks: every case has several query tiles and key
blocks and ragged lengths (a padded key tail, padded query rows)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, api, device, masks, mods, reference
from pallas_flash.config import KernelConfig
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper import vjp as hopper_vjp
from pallas_flash.hopper.config import HopperBwdConfig, HopperConfig
from tests.helpers import (
    HOPPER_BACKWARD_VARIANTS,
    MOSAIC_CALL,
    abstract_inputs,
    assert_gradients_close,
    interpreted_hopper_backward,
    lower_for_cuda,
    make_backward_inputs,
    make_inputs,
    packed_ids,
    shape_id,
)
from tests.tolerances import GRADIENT, OUTPUT, assert_close, relative_error

SCALE = 0.125
RATE = 0.3  # high enough that a wrong keep mask is far outside the tolerances


def _seed(n):
    return masks.dropout_seed(jax.random.key(n))


def _slopes(heads):
    return jnp.asarray(np.linspace(0.05, 0.4, heads), jnp.float32)


def _staged_score(fn, shape):
    """(the reference's score program and consts, the kernels' staged program and stacks) of a score_mod."""
    batch, q_len, kv_len, heads = shape[:4]
    program, consts = mods.trace(fn, "score")
    staged, why = mods.stage(program)
    assert staged is not None, why
    return (program, consts), (staged, staged.stacks(consts, batch, heads, q_len, kv_len))


def _segment_ids(shape):
    """Packed documents per example (query and key ids of one layout), as int32 [batch, len]."""
    batch, q_len, kv_len = shape[:3]
    return [jnp.asarray(np.stack([packed_ids(n, 50, 90)] * batch)) for n in (q_len, kv_len)]


# name: (shape (batch, q_len, kv_len, heads, kv_heads, head_dim), is_causal, broadcast_dropout, segment ids,
# score_mod, forward config, backward variant (`HOPPER_BACKWARD_VARIANTS`))
CASES = {
    # GQA, q_len < kv_len, causal; persistent forward CTAs; the plain two passes
    "causal_gqa": (
        (1, 130, 200, 2, 1, 64),
        True,
        False,
        False,
        None,
        HopperConfig(64, 64, 2, persistent=True),
        "two_pass",
    ),
    # one mask for every (batch, head); q_len > kv_len; the overlapped forward and both overlapped passes
    "broadcast_overlap": (
        (2, 150, 100, 2, 2, 64),
        False,
        True,
        False,
        None,
        HopperConfig(64, 64, 2, overlap=True),
        "two_pass_dkv_overlap",
    ),
    # with segment ids (masked blocks, rows that skip blocks) and a score program (soft cap, ALiBi: its float
    # row values get gradients): the programs' backward path; delta_in_dp asked for, which dropout turns off
    "segments_score_mod": (
        (1, 140, 140, 2, 1, 64),
        False,
        False,
        True,
        lambda s: mods.chain(mods.soft_cap(2.0), mods.alibi(_slopes(s[3]))),
        HopperConfig(64, 64, 2),
        "two_pass_dkv_overlap_delta_in_dp",
    ),
}
SLOW = {"broadcast_overlap"}
# Outside `slow`, the forward runs causal_gqa and the backward segments_score_mod (CI's time; the GPU runs all).
FORWARD_PARAMS = [pytest.param(c, marks=pytest.mark.slow if c in SLOW | {"segments_score_mod"} else ()) for c in CASES]
BACKWARD_PARAMS = [pytest.param(c, marks=pytest.mark.slow if c in SLOW | {"causal_gqa"} else ()) for c in CASES]


def _case(name):
    """(q, k, v, d_out, d_lse, the kernels' keyword arguments, the reference's) of a case."""
    shape, is_causal, broadcast, segments, score, _, _ = CASES[name]
    q, k, v, d_out, d_lse = make_backward_inputs(shape, jnp.bfloat16, seed=31)
    seed = _seed(5)
    kernel = dict(is_causal=is_causal, dropout_rate=RATE, dropout_seed=seed, broadcast_dropout=broadcast)
    ref = dict(band=masks.Band.of(is_causal, None), dropout_rate=RATE, dropout_seed=seed, broadcast_dropout=broadcast)
    if segments:
        q_ids, kv_ids = _segment_ids(shape)
        kernel.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
        ref.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    if score is not None:
        (program, consts), (staged, stacks) = _staged_score(score(shape), shape)
        kernel.update(score_mod=staged, score_stacks=stacks)
        ref.update(score_mod=program, score_consts=consts)
    return q, k, v, d_out, d_lse, kernel, ref


def _interpret_params():
    params = _compat.mosaic_gpu_interpret_params(detect_races=True)
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    return params


def _reference(q, k, v, ref_args):
    return reference.attention_reference(q, k, v, scale=SCALE, **ref_args)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", FORWARD_PARAMS)
def test_dropout_forward_in_mosaic_gpu_interpreter(case):
    """The forward drops the reference's probabilities (same seed, same keep mask) and rescales the kept ones:
    output and LSE (of the softmax before dropout) match; without dropout the reference is far off."""
    config = CASES[case][5]
    q, k, v, _, _, kernel_args, ref_args = _case(case)
    out, lse = hopper_fwd.hopper_forward(
        q, k, v, scale=SCALE, config=config, interpret=_interpret_params(), **kernel_args
    )
    assert not _compat.mosaic_gpu_races_found()
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_out, ref_lse = _reference(*f32, ref_args)
    assert_close(out, ref_out, jnp.bfloat16)
    assert_close(lse, ref_lse, jnp.float32, what="lse")
    undropped, _ = _reference(*f32, dict(ref_args, dropout_rate=0.0))
    assert relative_error(out, undropped) > 10 * OUTPUT[jnp.bfloat16]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", BACKWARD_PARAMS)
def test_dropout_backward_in_mosaic_gpu_interpreter(case):
    """Both passes regenerate the forward's keep mask (the dK/dV pass on transposed tiles, its query hashes along
    the columns): dq, dk, dv from the reference's residuals match the reference's gradients, including a
    cotangent on the LSE."""
    variant = CASES[case][6]
    config = dataclasses.replace(HopperBwdConfig(), **HOPPER_BACKWARD_VARIANTS[variant])
    q, k, v, d_out, d_lse, kernel_args, ref_args = _case(case)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (out, lse), vjp = jax.vjp(lambda q, k, v: _reference(q, k, v, ref_args), *f32)
    want = vjp((d_out.astype(jnp.float32), d_lse))
    dq, dk, dv, _, _ = interpreted_hopper_backward(
        q, k, v, out.astype(q.dtype), lse, d_out, d_lse,
        scale=SCALE, config=config, interpret=_interpret_params(), **kernel_args,
    )  # fmt: skip
    assert_gradients_close((dq, dk, dv), want, (q, k, v))


def test_dropout_needs_a_seed():
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs dropout_seed"):
        hopper_fwd.hopper_forward(q, q, q, scale=SCALE, dropout_rate=0.1)


def test_dispatcher_sends_dropout_to_the_hopper_kernels(monkeypatch):
    """On sm90 (faked) a call with dropout runs on the Hopper kernels, alone or with a score_mod."""
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    dropout = masks.ScoreMods(dropout_rate=0.1)
    call = api.Call(x, x, masks.Band.of(True), KernelConfig(), ("dropout",), dropout)
    assert api.dispatch("mosaic", call) == "mosaic"
    program, _ = mods.trace(mods.soft_cap(5.0), "score")
    call = api.Call(
        x, x, masks.Band(), KernelConfig(), ("dropout", "score_mod"), dataclasses.replace(dropout, score_mod=program)
    )
    assert api.dispatch(None, call) == "mosaic"


# ---- lowering for CUDA --------------------------------------------------------------------------------------------


@pytest.mark.lowering
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("is_causal, segments, broadcast", [(True, False, False), (False, True, True)])
def test_dropout_forward_lowers_for_gpu(overlap, is_causal, segments, broadcast):
    """The forward with dropout (the seed table read as scalars, row hashes in the WGMMA row layout, the keep
    bits on register tiles: uint32 multiplies, xors, logical shifts) goes through Mosaic GPU's lowering, ragged
    and GQA, with and without the overlapped loop."""
    q, k, _, ids = abstract_inputs((2, 300, 333, 4, 2, 128), segments)
    config = HopperConfig(64, 128, 2, persistent=not overlap, overlap=overlap)

    def forward(q, k, v, seed, q_ids, kv_ids):
        return hopper_fwd.hopper_forward(
            q,
            k,
            v,
            scale=0.1,
            is_causal=is_causal,
            q_segment_ids=q_ids,
            kv_segment_ids=kv_ids,
            config=config,
            dropout_rate=0.1,
            dropout_seed=seed,
            broadcast_dropout=broadcast,
        )

    seed = jax.ShapeDtypeStruct((2,), jnp.uint32)
    text = lower_for_cuda(forward, q, k, k, seed, *ids)
    assert text.count(MOSAIC_CALL) == 1


def _backward_lowering_params():
    variants = {**HOPPER_BACKWARD_VARIANTS, "one_pass_ordered": dict(dq_atomic=True, dq_ordered=True, num_stages_dkv=2)}
    return [
        pytest.param(variant, segments, marks=() if segments == (i % 2 == 0) else pytest.mark.slow)
        for i, variant in enumerate(variants)
        for segments in (False, True)
    ], variants


_BACKWARD_PARAMS, _BACKWARD_VARIANTS = _backward_lowering_params()


@pytest.mark.lowering
@pytest.mark.parametrize("variant, segments", _BACKWARD_PARAMS)
def test_dropout_backward_lowers_for_gpu(variant, segments):
    """Every backward variant with dropout (the two passes, each overlap, delta_in_dp asked for, the one pass in
    free and in semaphore order) goes through Mosaic GPU's lowering, causal, ragged and GQA."""
    q, k, lse, ids = abstract_inputs((2, 300, 200, 4, 2, 64), segments)
    config = dataclasses.replace(HopperBwdConfig.default(64), **_BACKWARD_VARIANTS[variant])

    def backward(q, k, v, out, lse, d_out, d_lse, seed, q_ids, kv_ids):
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
            is_causal=True,
            dropout_rate=0.1,
            dropout_seed=seed,
        )

    seed = jax.ShapeDtypeStruct((2,), jnp.uint32)
    text = lower_for_cuda(backward, q, k, k, q, lse, q, lse, seed, *ids)
    assert text.count(MOSAIC_CALL) == (1 if config.dq_atomic else 2)


@pytest.mark.lowering
@pytest.mark.parametrize("head_dim, kernels", [(64, 2), (128, 3)])
def test_grad_with_dropout_lowers_for_gpu(head_dim, kernels):
    """jax.grad of `flash_attention_hopper` with dropout (the seed from `ModArrays`, the rate from `ScoreMods`)
    lowers to the forward and the default backward (the one pass at head_dim 64, two passes at 128), and under
    jax.vmap, where the one pass folds the vmapped axis into its batch with the seed table."""
    q = jax.ShapeDtypeStruct((3, 1, 200, 4, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((3, 1, 333, 2, head_dim), jnp.bfloat16)
    seed = jax.ShapeDtypeStruct((2,), jnp.uint32)

    def loss(q, k, v, seed):
        out, lse = hopper_vjp.flash_attention_hopper(
            q,
            k,
            v,
            scale=0.125,
            band=masks.Band(),
            config=KernelConfig.default(head_dim),
            mods=masks.ScoreMods(dropout_rate=0.1),
            mod_arrays=masks.ModArrays(dropout_seed=seed),
        )
        return out.astype(jnp.float32).sum() + lse.sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    text = lower_for_cuda(lambda q, k, v, seed: grad(q[0], k[0], v[0], seed), q, k, k, seed)
    assert text.count(MOSAIC_CALL) == kernels
    if head_dim == 64:
        text = lower_for_cuda(jax.vmap(grad, in_axes=(0, 0, 0, None)), q, k, k, seed)
        assert text.count(MOSAIC_CALL) == kernels


# ---- on an H100 ---------------------------------------------------------------------------------------------------

GPU_CASES = [
    ((2, 1000, 1000, 4, 2, 64), True, False, True),
    ((2, 1000, 1000, 4, 2, 64), False, True, False),
    ((1, 777, 1500, 2, 2, 128), False, False, True),
    ((1, 777, 1500, 2, 2, 128), True, True, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, is_causal, broadcast, deterministic",
    [pytest.param(*c, id=f"{shape_id(c[0])}-{'causal' if c[1] else 'full'}-{c[2]}-{c[3]}") for c in GPU_CASES],
)
def test_mosaic_dropout_matches_reference_and_pallas(shape, is_causal, broadcast, deterministic):
    """flash_attention(implementation="mosaic", dropout_rate=0.1) against the float32 reference with the same seed
    (output, LSE, dq, dk, dv) and against implementation="pallas": the same keep mask, so the outputs agree to bf16
    rounding. deterministic=False takes the free-order one pass at head_dim 64."""
    q, k, v, d_out = make_inputs(shape, jnp.bfloat16, seed=12)
    rng = jax.random.key(9)
    options = dict(is_causal=is_causal, dropout_rate=0.1, dropout_rng=rng, broadcast_dropout=broadcast)

    def run(implementation):
        def attention(q, k, v):
            return pf.flash_attention(
                q, k, v, implementation=implementation, deterministic=deterministic, return_lse=True, **options
            )

        (out, lse), vjp = jax.vjp(attention, q, k, v)
        return out, lse, vjp((d_out, jnp.zeros_like(lse)))

    def ref(q, k, v):
        return reference.attention_reference(
            q,
            k,
            v,
            scale=1.0 / np.sqrt(shape[-1]),
            band=masks.Band.of(is_causal, None),
            dropout_rate=0.1,
            dropout_seed=masks.dropout_seed(rng),
            broadcast_dropout=broadcast,
        )

    (ref_out, ref_lse), vjp = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    ref_grads = vjp((d_out.astype(jnp.float32), jnp.zeros_like(ref_lse)))
    out, lse, grads = run("mosaic")
    assert_close(out, ref_out, jnp.bfloat16)
    assert_close(lse, ref_lse, jnp.float32, what="lse")
    for name, ours, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(ours, want, jnp.bfloat16, table=GRADIENT, what=name)
    portable_out, _, portable_grads = run("pallas")
    assert_close(out, portable_out, jnp.bfloat16, what="output against the portable kernels")
    for name, ours, theirs in zip(("dq", "dk", "dv"), grads, portable_grads):
        assert_close(ours, theirs, jnp.bfloat16, table=GRADIENT, what=f"{name} against the portable kernels")
