"""A dense bias and a dense mask (arrays over both queries and keys) in the Hopper kernels: tiles riding the K ring
(forward, dQ pass) or the Q ring (dK/dV pass, key-major), the dQ pass writing dbias. The kernels in JAX's Mosaic
GPU interpreter (race detection on) against the float32 reference, their lowering for CUDA, the tiles' shared-
memory fitting, and on an H100 the public API and its gradients against the reference.

Interpreter tiles are the smallest the kernels take: 128 query rows (two consumers of 64) and 64-key blocks (the
backward's likewise); every case has ragged lengths (a padded key tail, padded query rows)."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, api, device, masks, mods, reference
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper import vjp as hopper_vjp
from pallas_flash.hopper.config import H100_SHARED_MEMORY, HopperBwdConfig, HopperConfig
from tests.helpers import (
    MOSAIC_CALL,
    abstract_inputs,
    assert_gradients_close,
    interpreted_hopper_backward,
    lower_for_cuda,
    make_backward_inputs,
    make_inputs,
    packed_ids,
)
from tests.tolerances import GRADIENT, assert_close

SCALE = 0.125


def _bias(shape, dims, dtype, seed=0):
    """A bias [Bd, Hd, q_len, kv_len]: `dims` says which of (batch, heads) it spans."""
    batch, q_len, kv_len, heads = shape[:4]
    lead = (batch if dims[0] else 1, heads if dims[1] else 1)
    return jnp.asarray(np.random.default_rng(seed).standard_normal((*lead, q_len, kv_len)), dtype)


def _mask(shape, dims, seed=1, hidden_row=None):
    """A bool mask like `_bias` hiding ~30% of keys (and every key of query `hidden_row`: a row that sees none)."""
    batch, q_len, kv_len, heads = shape[:4]
    lead = (batch if dims[0] else 1, heads if dims[1] else 1)
    mask = np.random.default_rng(seed).uniform(size=(*lead, q_len, kv_len)) > 0.3
    if hidden_row is not None:
        mask[:, :, hidden_row] = False
    return jnp.asarray(mask)


def _ids(shape, *starts):
    """Segment ids (q, kv) [batch, len] of documents packed from `starts` on."""
    batch, q_len, kv_len = shape[:3]
    return tuple(jnp.asarray(np.stack([packed_ids(n, *starts)] * batch)) for n in (q_len, kv_len))


# name: (shape (batch, q_len, kv_len, heads, kv_heads, head_dim), bias (dims, dtype) or None, mask (dims,
# hidden row) or None, options: is_causal, segments (document starts), soft_cap, score (a score_mod), config).
FORWARD_CASES = {
    # a bias shared by every (batch, head) under a causal band: skipped blocks, the diagonal's masked ones; GQA
    "bias_causal_gqa": ((1, 150, 100, 2, 1, 64), ((False, False), jnp.float32), None, dict(is_causal=True)),
    # a mask per example beside segment ids; a row that sees no key; persistent CTAs and the overlapped loop
    "mask_segments_overlap": (
        (2, 130, 200, 1, 1, 64),
        None,
        ((True, False), 7),
        dict(segments=(60,), config=HopperConfig(64, 64, 2, persistent=True, overlap=True)),
    ),
    # a bf16 bias per (batch, head) after a soft cap, before an ALiBi score program, with a per-head mask
    "bias_mask_soft_cap_alibi": (
        (2, 100, 150, 2, 2, 64),
        ((True, True), jnp.bfloat16),
        ((False, True), None),
        dict(soft_cap=2.0, score=mods.alibi(jnp.asarray([0.1, 0.3]))),
    ),
}


def _reference(q, k, v, bias, *, mask, options):
    """The float32 reference (out, lse) of a case."""
    q_ids, kv_ids = _ids(_shape_of(q, k), *options["segments"]) if "segments" in options else (None, None)
    score = None
    if "score" in options:
        score = mods.trace(options["score"], "score")
    return reference.attention_reference(
        *(x.astype(jnp.float32) for x in (q, k, v)),
        scale=SCALE,
        band=masks.Band.of(options.get("is_causal", False), None),
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        bias=bias,
        mask=mask,
        logits_soft_cap=options.get("soft_cap"),
        score_mod=None if score is None else score[0],
        score_consts=() if score is None else score[1],
    )


def _shape_of(q, k):
    return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3])


def _kernel_options(shape, options):
    """hopper_forward's / hopper_backward's keyword arguments of a case's options (but config)."""
    kwargs = dict(is_causal=options.get("is_causal", False), logits_soft_cap=options.get("soft_cap"))
    if "segments" in options:
        kwargs.update(zip(("q_segment_ids", "kv_segment_ids"), _ids(shape, *options["segments"])))
    if "score" in options:
        program, consts = mods.trace(options["score"], "score")
        staged, why = mods.stage(program)
        assert staged is not None, why
        kwargs.update(score_mod=staged, score_stacks=staged.stacks(consts, shape[0], shape[3], shape[1], shape[2]))
    return kwargs


def _arrays(shape, bias_spec, mask_spec):
    bias = None if bias_spec is None else _bias(shape, *bias_spec)
    mask = None if mask_spec is None else _mask(shape, mask_spec[0], hidden_row=mask_spec[1])
    return bias, mask


# `slow` for CI time: the flash_attention test below runs a shared bias with GQA and skipped blocks (a window), and a
# mask with a row that sees no key; bias_mask_soft_cap_alibi a mask per head beside a bias.
SLOW_FORWARD_CASES = {"bias_causal_gqa", "mask_segments_overlap"}


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow if c in SLOW_FORWARD_CASES else ()) for c in FORWARD_CASES]
)
def test_dense_forward_in_mosaic_gpu_interpreter(case):
    """The forward with a dense bias and/or mask read tile by tile beside each K block (broadcast batch or heads
    at index 0) matches the reference; a row that sees no key gets zeros and lse = -inf, never NaN."""
    shape, bias_spec, mask_spec, options = FORWARD_CASES[case]
    bias, mask = _arrays(shape, bias_spec, mask_spec)
    q, k, v, _ = make_inputs(shape, jnp.bfloat16, seed=31)
    out, lse = hopper_fwd.hopper_forward(
        q,
        k,
        v,
        scale=SCALE,
        config=options.get("config", HopperConfig(64, 64)),
        bias=bias,
        mask=mask,
        interpret=_compat.mosaic_gpu_interpret_params(detect_races=True) or pytest.skip("no interpreter"),
        **_kernel_options(shape, options),
    )
    assert not _compat.mosaic_gpu_races_found()
    ref_out, ref_lse = _reference(q, k, v, bias, mask=mask, options=options)
    assert_close(out, ref_out, jnp.bfloat16)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(np.asarray(ref_lse))
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")
    np.testing.assert_array_equal(np.asarray(out)[~finite.transpose(0, 2, 1)], 0)
    if mask_spec is not None and mask_spec[1] is not None:
        assert (~finite).any(), "this case is meant to contain a row that sees no key"


BACKWARD_CASES = {
    # a float32 bias per head and a mask per example, causal, GQA, a row that sees no key: plain steps
    "bias_mask_causal_gqa": (
        (2, 150, 100, 2, 1, 64),
        ((False, True), jnp.float32),
        ((True, False), 5),
        dict(is_causal=True),
        HopperBwdConfig(),
    ),
    # a bf16 bias over everything after a soft cap, with segment ids: both overlapped loops
    "bias_soft_cap_segments_overlap": (
        (1, 130, 200, 2, 2, 64),
        ((True, True), jnp.bfloat16),
        None,
        dict(soft_cap=2.0, segments=(90,)),
        HopperBwdConfig(num_stages_dkv=3, num_stages_dq=3, dq_overlap=True, dkv_overlap=True),
    ),
}


# `slow` for CI time (run them with -m slow); outside it the flash_attention test below runs both passes on a dense
# bias and mask through the custom_vjp.
SLOW_BACKWARD_CASES = {"bias_soft_cap_segments_overlap", "bias_mask_causal_gqa"}


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow if c in SLOW_BACKWARD_CASES else ()) for c in BACKWARD_CASES]
)
def test_dense_backward_in_mosaic_gpu_interpreter(case):
    """Both passes recompute P with the dense bias and mask tiles (key-major in the dK/dV pass) from the
    reference's residuals: dq, dk, dv and dbias (the dQ pass's dS, summed over the bias's broadcast dims, zeros
    where no tile visits) against the reference's vjp."""
    shape, bias_spec, mask_spec, options, config = BACKWARD_CASES[case]
    bias, mask = _arrays(shape, bias_spec, mask_spec)
    q, k, v, d_out, d_lse = make_backward_inputs(shape, jnp.bfloat16, seed=32)
    (out, lse), vjp = jax.vjp(lambda q, k, v, b: _reference(q, k, v, b, mask=mask, options=options), q, k, v, bias)
    want = vjp((d_out.astype(jnp.float32), d_lse))
    params = _compat.mosaic_gpu_interpret_params(detect_races=True) or pytest.skip("no interpreter")
    dq, dk, dv, _, _, dbias = interpreted_hopper_backward(
        q, k, v, out.astype(q.dtype), lse, d_out, d_lse,
        scale=SCALE, config=config, bias=bias, mask=mask, interpret=params, **_kernel_options(shape, options),
    )  # fmt: skip
    assert_gradients_close((dq, dk, dv, dbias), want, (q, k, v, bias), names=("dq", "dk", "dv", "dbias"))


@pytest.mark.interpreter
def test_flash_attention_serves_a_dense_bias_and_mask_on_hopper(monkeypatch):
    """On sm90 (faked), flash_attention runs the Hopper custom_vjp on a dense bias (broadcast over heads) and mask
    with a soft cap and a window: the soft cap stays out of the score program (the kernels apply it before the
    bias), the gradient reaches the bias in its own shape; both kernels in the interpreter, against the
    reference."""
    params = _compat.mosaic_gpu_interpret_params(detect_races=False) or pytest.skip("no interpreter")
    shape = (1, 100, 130, 2, 1, 64)
    q, k, v, d_out = make_inputs(shape, jnp.bfloat16, seed=33)
    bias, mask = _bias(shape, (True, False), jnp.float32), _mask(shape, (False, False), hidden_row=3)
    options = dict(local_window_size=(70, 20), logits_soft_cap=3.0, mask=mask)
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    monkeypatch.setattr(hopper_vjp.hopper_fwd, "hopper_forward", functools.partial(hopper_fwd.hopper_forward,
                                                                                     interpret=params))  # fmt: skip
    monkeypatch.setattr(hopper_vjp.hopper_bwd, "hopper_backward", functools.partial(hopper_bwd.hopper_backward,
                                                                                      interpret=params))  # fmt: skip
    out, vjp = jax.vjp(
        lambda q, k, v, b: pf.flash_attention(q, k, v, bias=b, scale=SCALE, implementation="mosaic", **options),
        q,
        k,
        v,
        bias,
    )
    grads = vjp(d_out)
    ref_out, ref_vjp = jax.vjp(
        lambda q, k, v, b: pf.flash_attention(q, k, v, bias=b, scale=SCALE, implementation="xla", **options),
        *(x.astype(jnp.float32) for x in (q, k, v)),
        bias,
    )
    assert_close(out, ref_out, jnp.bfloat16)
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), grads, ref_vjp(d_out.astype(jnp.float32))):
        assert_close(got, ref, jnp.bfloat16, table=GRADIENT, what=name)


# ---- lowering -----------------------------------------------------------------------------------------------


def _dense_abstract(shape, which):
    """Abstract (bias, mask) of a lowering case: a bf16 bias per example, or a mask per head, or both."""
    batch, q_len, kv_len, heads = shape[:4]
    bias = jax.ShapeDtypeStruct((batch, 1, q_len, kv_len), jnp.bfloat16) if which != "mask" else None
    mask = jax.ShapeDtypeStruct((1, heads, q_len, kv_len), jnp.bool_) if which != "bias" else None
    return bias, mask


@pytest.mark.lowering
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("which", ["bias", "mask"])
def test_dense_forward_lowers_for_gpu(which, overlap):
    """The forward with a dense bias (and a soft cap) or mask goes through Mosaic GPU's lowering (the tiles' TMA
    into swizzled shared memory, their loads into the WGMMA register layout), ragged, GQA, causal, with and
    without the overlapped loop."""
    shape = (2, 300, 333, 4, 2, 128)
    q, k, _, _ = abstract_inputs(shape, False)
    config = HopperConfig(64, 64, 2, persistent=not overlap, overlap=overlap)
    cap = 20.0 if which == "bias" else None

    def forward(q, k, v, bias, mask):
        return hopper_fwd.hopper_forward(
            q, k, v, scale=0.1, is_causal=True, config=config, bias=bias, mask=mask, logits_soft_cap=cap
        )

    text = lower_for_cuda(forward, q, k, k, *_dense_abstract(shape, which))
    assert text.count(MOSAIC_CALL) == 1


@pytest.mark.lowering
@pytest.mark.parametrize("variant", ["plain", "overlap"])
@pytest.mark.parametrize("which", ["bias", "mask", "constant_bias"])
def test_dense_backward_lowers_for_gpu(which, variant):
    """Both passes with a dense bias (the dQ pass's dbias stores included, or not for a constant bias; a soft cap)
    or mask go through Mosaic GPU's lowering, ragged and GQA, with the plain steps (delta_in_dp) and with both
    overlapped loops."""
    shape = (2, 300, 333, 4, 2, 64)
    q, k, lse, _ = abstract_inputs(shape, False)
    config = HopperBwdConfig(delta_in_dp=True)
    if variant == "overlap":
        config = HopperBwdConfig(num_stages_dkv=3, num_stages_dq=3, dq_overlap=True, dkv_overlap=True)
    cap = 20.0 if which != "mask" else None

    def backward(q, k, v, out, lse, d_out, bias, mask):
        return hopper_bwd.hopper_backward(
            q, k, v, out, lse, d_out, None, scale=0.1, config=config, bias=bias, mask=mask, logits_soft_cap=cap,
            bias_grad=which != "constant_bias",
        )  # fmt: skip

    text = lower_for_cuda(backward, q, k, k, q, lse, q, *_dense_abstract(shape, "bias" if "bias" in which else which))
    assert text.count(MOSAIC_CALL) == 2
    dbias_buffer = "tensor<2x4x384x384xf32>"  # the dQ pass's dS: [batch, heads, q_pad, kv_pad] float32
    assert (dbias_buffer in text) == (which == "bias")


@pytest.mark.parametrize("differentiated", [(0, 1, 2), (0, 3)])
def test_only_a_differentiated_bias_gets_its_gradient_computed(monkeypatch, differentiated):
    """The Hopper custom_vjp asks the backward for dbias only where the bias is differentiated (symbolic zeros):
    a bias held constant spares the float32 [batch, heads, q, kv] dS buffer. Traced, not run."""
    calls, hopper_backward = [], hopper_bwd.hopper_backward

    def backward(*args, **kwargs):
        calls.append(kwargs.get("bias_grad"))
        return hopper_backward(*args, **kwargs)

    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    monkeypatch.setattr(hopper_vjp.hopper_bwd, "hopper_backward", backward)
    shape = (1, 128, 128, 2, 2, 64)
    q, k, v, _ = make_inputs(shape, jnp.bfloat16, seed=34)
    bias = _bias(shape, (True, True), jnp.float32)

    def loss(q, k, v, b):
        return pf.flash_attention(q, k, v, bias=b, implementation="mosaic").astype(jnp.float32).sum()

    jax.make_jaxpr(jax.grad(loss, differentiated))(q, k, v, bias)
    assert calls == [3 in differentiated]


# ---- configs and dispatch (CPU, nothing runs) -------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tile_bytes", [1, 2, 5])
def test_default_configs_shrink_to_hold_the_dense_tiles(head_dim, tile_bytes):
    """The default forward and backward tiles, with dense tiles of 1 (a mask), 2 (a bf16 bias) or 5 (a float32
    bias and a mask) bytes per logit, shrink until they fit an H100's shared memory; the backward takes the two
    passes (the dQ pass writes dbias), or at head_dim 128 with 5 bytes none (the portable backward runs)."""
    band = masks.Band.of(False, None)
    forward = hopper_fwd.default_config(head_dim, 4096, band, tile_bytes)
    assert forward.smem_bytes(head_dim, 2, tile_bytes) <= H100_SHARED_MEMORY
    assert forward.block_q == HopperConfig.default(head_dim, 4096).block_q
    backward = hopper_bwd.default_config(head_dim, 4096, band, True, tile_bytes=tile_bytes, dbias=True)
    if (head_dim, tile_bytes) == (128, 5):  # the dQ pass's 2-stage ring and dS staging exceed it: the portable runs
        assert backward is None
        return
    assert not backward.dq_atomic
    assert backward.smem_bytes_dkv(head_dim, 2, tile_bytes) <= H100_SHARED_MEMORY
    assert backward.smem_bytes_dq(head_dim, 2, tile_bytes, dbias=True) <= H100_SHARED_MEMORY


def test_dense_tiles_that_cannot_fit_are_refused():
    """At head_dim 256 no forward tiles hold a bias tile: the default is None, an explicit config raises before
    any kernel, and the backward refuses the one pass."""
    band = masks.Band.of(False, None)
    assert hopper_fwd.default_config(256, 1024, band, 2) is None
    x = jnp.zeros((1, 128, 1, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="fit shared memory"):
        hopper_fwd.hopper_forward(x, x, x, scale=1.0, config=HopperConfig(64, 64), bias=jnp.zeros((1, 1, 128, 128)))
    y = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="dq_atomic"):
        hopper_bwd.hopper_backward(
            y, y, y, y, jnp.zeros((1, 1, 128)), y, None, scale=1.0, config=HopperBwdConfig(128, 64, dq_atomic=True),
            mask=jnp.ones((1, 1, 128, 128), bool),
        )  # fmt: skip


@pytest.mark.parametrize("bias_dtype, served", [(jnp.bfloat16, True), (jnp.float32, False)])
def test_dispatch_sizes_bias_tiles_by_the_bias_dtype(monkeypatch, caplog, bias_dtype, served):
    """At head_dim 192 a bf16 bias and a mask over both axes (3 bytes per logit) fit the forward's tiles, a float32
    bias with them (5) does not: flash_attention's dispatch reads the bias's dtype (on sm90, faked; traced only)."""
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    q = jax.ShapeDtypeStruct((1, 256, 2, 192), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 1, 256, 256), bias_dtype)
    mask = jax.ShapeDtypeStruct((1, 1, 256, 256), jnp.bool_)
    api._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="pallas_flash"):
        jax.eval_shape(lambda q, b, m: pf.flash_attention(q, q, q, bias=b, mask=m), q, bias, mask)
    ran = [r.getMessage() for r in caplog.records if "implementation=None ran" in r.getMessage()]
    assert ran and ("ran 'mosaic'" in ran[0]) == served, ran


def test_hopper_programs_keep_the_soft_cap_before_a_dense_bias():
    """`api._hopper_programs` leaves a dense bias and mask to the kernels and, with such a bias, the soft cap too
    (it precedes the bias); ALiBi still folds into the score program. Without a dense bias the soft cap folds."""
    dense = masks.ScoreMods(bias_dims=(True, False, True, True), mask_dims=(False, False, True, True), soft_cap=5.0,
                            alibi=True)  # fmt: skip
    folded = api._hopper_programs(dense)
    assert (folded.bias_dims, folded.mask_dims, folded.soft_cap) == (dense.bias_dims, dense.mask_dims, 5.0)
    assert folded.score_mod is not None and not folded.alibi
    folded = api._hopper_programs(masks.ScoreMods(mask_dims=(False, False, True, True), soft_cap=5.0))
    assert folded.soft_cap is None and folded.score_mod is not None and folded.mask_dims is not None


# ---- on the GPU ---------------------------------------------------------------------------------------------------

# name: (dense arrays: bias (dims, dtype), mask (dims, hidden row); options; the inputs' dtype)
GPU_CASES = {
    "bias_1x1": (dict(bias=((False, False), jnp.bfloat16)), dict(is_causal=True), jnp.bfloat16),
    "bias_bxh_f32_gqa": (dict(bias=((True, True), jnp.float32)), dict(), jnp.bfloat16),
    "bias_bx1_mask_soft_cap": (
        dict(bias=((True, False), jnp.bfloat16), mask=((False, True), 17)),
        dict(logits_soft_cap=4.0, is_causal=True),
        jnp.bfloat16,
    ),
    "mask_segments_alibi": (dict(mask=((True, False), None)), dict(segments=(100, 300)), jnp.bfloat16),
    "bias_mask_dropout_window": (
        dict(bias=((False, True), jnp.float16), mask=((True, True), None)),
        dict(local_window_size=(128, 32), dropout_rate=0.1),
        jnp.float16,
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", GPU_CASES)
def test_dense_flash_attention_on_hopper(case, head_dim):
    """On sm90, flash_attention(implementation="mosaic") with a dense bias and/or mask (broadcast shapes, GQA,
    ragged lengths, with causal, windows, segment ids, soft cap, ALiBi, dropout) and its gradients (dbias in the
    bias's own shape) against the reference."""
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    arrays, options, dtype = GPU_CASES[case]
    shape = (2, 333, 460, 4, 2, head_dim)
    q, k, v, d_out = make_inputs(shape, dtype, seed=34)
    bias = _bias(shape, *arrays["bias"]) if "bias" in arrays else None
    mask = _mask(shape, *arrays["mask"]) if "mask" in arrays else None
    options = dict(options, scale=SCALE, mask=mask)
    if "segments" in options:
        options["segment_ids"], options["kv_segment_ids"] = _ids(shape, *options.pop("segments"))
        options["alibi_slopes"] = jnp.asarray([0.05, 0.1, 0.2, 0.4], jnp.float32)
    if options.get("dropout_rate"):
        options["dropout_rng"] = jax.random.key(3)

    def run(implementation, q, k, v, b):
        return pf.flash_attention(q, k, v, bias=b, implementation=implementation, return_lse=True, **options)

    diff = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    primals = (q, k, v, bias)
    (out, lse), vjp = jax.vjp(lambda *x: run("mosaic", *x, *primals[len(diff) :]), *primals[: len(diff)])
    f32 = [x.astype(jnp.float32) for x in (q, k, v)] + [bias]
    (ref_out, ref_lse), ref_vjp = jax.vjp(lambda *x: run("xla", *x, *f32[len(diff) :]), *f32[: len(diff)])
    assert_close(out, ref_out, dtype)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    d_lse = jnp.zeros_like(lse)
    grads = vjp((d_out, d_lse))
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), grads, ref_vjp((d_out.astype(jnp.float32), d_lse))):
        assert_close(got, ref, dtype, table=GRADIENT, what=name)
    if bias is not None:
        assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
