"""Argument checking, dispatch, and behaviour under JAX transformations."""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import api, device, masks
from pallas_flash import mods as pf_mods
from pallas_flash.block_sparse import BlockMask
from pallas_flash.hopper import vjp as hopper_vjp
from tests.helpers import SMALL_BLOCKS, make_inputs, reference
from tests.tolerances import GRADIENT, assert_close

SHAPE = (2, 24, 40, 4, 2, 16)


@pytest.mark.parametrize("impl", ["pallas", "xla_chunked"])
def test_vmap_over_extra_leading_axis_and_vmap_of_grad(impl):
    q, k, v, _ = make_inputs(SHAPE, jnp.float32, seed=10)
    stack = lambda x: jnp.stack([x, jnp.flip(x, axis=1)])  # [2, batch, seq, heads, dim]
    attend = functools.partial(pf.flash_attention, is_causal=True, implementation=impl, config=SMALL_BLOCKS)
    out = jax.vmap(attend)(stack(q), stack(k), stack(v))
    for i in range(2):
        ref = reference(stack(q)[i], stack(k)[i], stack(v)[i], is_causal=True)[0]
        assert_close(out[i], ref, jnp.float32)

    loss = lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)))
    ref_loss = lambda q, k, v: jnp.sum(jnp.sin(reference(q, k, v, is_causal=True)[0]))
    grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(stack(q), stack(k), stack(v))
    ref_grads = jax.vmap(jax.grad(ref_loss, argnums=(0, 1, 2)))(stack(q), stack(k), stack(v))
    for g, rg in zip(grads, ref_grads):
        assert_close(g, rg, jnp.float32, table=GRADIENT)


@pytest.mark.parametrize("impl", ["pallas", "xla_chunked"])
def test_jit_checkpoint_and_scan(impl):
    q, k, v, _ = make_inputs(SHAPE, jnp.float32, seed=11)
    attend = functools.partial(pf.flash_attention, is_causal=False, implementation=impl, config=SMALL_BLOCKS)

    def layers(fn, q):  # two "layers" through lax.scan, each rematerialised
        def body(x, _):
            return jax.checkpoint(lambda x: fn(x, k, v) + x)(x), None

        return jnp.sum(jax.lax.scan(body, q, None, length=2)[0] ** 2)

    ours = jax.jit(jax.value_and_grad(functools.partial(layers, attend)))(q)
    ref = jax.value_and_grad(functools.partial(layers, lambda q, k, v: reference(q, k, v, is_causal=False)[0]))(q)
    assert_close(ours[0], ref[0], jnp.float32)
    assert_close(ours[1], ref[1], jnp.float32, table=GRADIENT)


def test_default_implementation_on_cpu_is_chunked_and_logged_with_its_reason(caplog):
    if device.on_nvidia_gpu():
        pytest.skip("the CPU rule")
    q, k, v, _ = make_inputs((1, 8, 8, 2, 2, 16), jnp.float32, seed=12)
    api._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="pallas_flash"):
        pf.flash_attention(q, k, v)
        pf.flash_attention(q, k, v)
    messages = [r.getMessage() for r in caplog.records if "implementation=None" in r.getMessage()]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        "pallas_flash: implementation=None ran 'xla_chunked' on backend 'cpu' (not 'mosaic': "
    )
    assert "sm90" in messages[0] and "; not 'pallas': no NVIDIA GPU" in messages[0]


def test_eager_calls_are_traced_once_per_configuration(monkeypatch):
    """Outside jit, repeated calls reuse one compiled function (no re-trace of the chunked scan per call)."""
    from pallas_flash import xla_chunked

    traces = []
    original = xla_chunked.attention_chunked
    monkeypatch.setattr(xla_chunked, "attention_chunked", lambda *a, **kw: traces.append(1) or original(*a, **kw))
    q, k, v, _ = make_inputs((1, 20, 20, 2, 2, 16), jnp.float32, seed=14)
    for _ in range(3):
        pf.flash_attention(q, k, v, is_causal=True, implementation="xla_chunked")
    pf.flash_attention(q + 1, k, v, is_causal=True, implementation="xla_chunked")  # new values, same shapes
    assert len(traces) == 1
    pf.flash_attention(q, k, v, is_causal=False, implementation="xla_chunked")  # a new option: one more trace
    assert len(traces) == 2


def test_jit_of_flash_attention_names_its_static_arguments():
    q, k, v, _ = make_inputs((1, 16, 16, 2, 1, 16), jnp.float32, seed=15)
    with pytest.raises(TypeError, match="is_causal is a traced value.*STATIC_ARGNAMES"):
        jax.jit(pf.flash_attention)(q, k, v, is_causal=True)
    out = jax.jit(pf.flash_attention, static_argnames=pf.STATIC_ARGNAMES)(q, k, v, is_causal=True)
    assert_close(out, reference(q, k, v, is_causal=True)[0], jnp.float32)


@pytest.mark.parametrize("impl", ["xla_chunked", "pallas"])
def test_traced_scale_matches_reference_and_has_a_gradient(impl):
    q, k, v, _ = make_inputs((1, 24, 40, 2, 1, 16), jnp.float32, seed=16)
    attend = lambda s: pf.flash_attention(q, k, v, scale=s, is_causal=True, implementation=impl, config=SMALL_BLOCKS)
    ref = lambda s: reference(q, k, v, scale=s, is_causal=True)[0]
    assert_close(jax.jit(attend)(jnp.float32(0.3)), ref(0.3), jnp.float32)
    loss = lambda f: jax.grad(lambda s: jnp.sum(jnp.sin(f(s))))(jnp.float32(0.3))
    assert_close(loss(attend), loss(ref), jnp.float32, table=GRADIENT)


def test_numpy_scalars_are_accepted_as_options():
    q, k, v, _ = make_inputs((1, 16, 16, 2, 2, 16), jnp.float32, seed=17)
    rng = jax.random.key(0)
    ours = pf.flash_attention(
        q,
        k,
        v,
        scale=np.float32(0.25),
        is_causal=np.bool_(True),
        dropout_rate=np.float32(0.1),
        dropout_rng=rng,
        logits_soft_cap=np.float64(30.0),
    )
    plain = pf.flash_attention(
        q, k, v, scale=0.25, is_causal=True, dropout_rate=float(np.float32(0.1)), dropout_rng=rng, logits_soft_cap=30.0
    )
    np.testing.assert_array_equal(ours, plain)


@pytest.mark.parametrize("impl", [None, "xla_chunked", "xla"])
def test_debug_infs_allows_calls_without_masked_rows(impl):
    """`jax.debug_infs` checks every eager op: the kernels' -inf running-max start must not trip it."""
    q = jnp.zeros((1, 8, 2, 16))
    with jax.debug_infs(True):
        out = pf.flash_attention(q, q, q, implementation=impl)
        grad = jax.grad(lambda q: pf.flash_attention(q, q, q, is_causal=True, implementation=impl).sum())(q)
    assert out.shape == q.shape and bool(jnp.isfinite(grad).all())


def _bad(shape_q=(1, 8, 4, 16), shape_kv=(1, 8, 2, 16), dtype=jnp.float32, kv_dtype=None):
    q = jnp.ones(shape_q, dtype)
    kv = jnp.ones(shape_kv, kv_dtype or dtype)
    return q, kv, kv


@pytest.mark.parametrize(
    "args, kwargs, error, words",
    [
        (_bad(shape_q=(8, 4, 16)), {}, ValueError, "query must have rank 4"),
        (_bad(shape_kv=(2, 8, 2, 16)), {}, ValueError, "key has batch 2"),
        (_bad(shape_kv=(1, 8, 3, 16)), {}, ValueError, "must be a multiple of it"),
        (_bad(shape_kv=(1, 8, 0, 16)), {}, ValueError, "head counts must be >= 1"),
        (_bad(shape_kv=(1, 8, 2, 32)), {}, ValueError, "head_dim 32"),
        (_bad(shape_q=(1, 8, 4, 8), shape_kv=(1, 8, 2, 8)), {}, ValueError, "head_dim is 8"),
        (_bad(shape_q=(1, 8, 4, 512), shape_kv=(1, 8, 2, 512)), {}, ValueError, "head_dim is 512"),
        (_bad(dtype=jnp.int32), {}, TypeError, "query has dtype int32"),
        (_bad(kv_dtype=jnp.bfloat16), {}, TypeError, "share one dtype"),
        (_bad(), {"implementation": "cuda"}, ValueError, "implementation must be"),
        (_bad(), {"scale": "big"}, TypeError, "scale must be"),
        (_bad(), {"is_causal": 1}, TypeError, "is_causal must be a bool"),
        (_bad(), {"deterministic": None}, TypeError, "deterministic must be a bool"),
        (_bad(), {"config": {"block_q": 64}}, TypeError, "config must be"),
    ],
)
def test_bad_input_is_named(args, kwargs, error, words):
    with pytest.raises(error, match=words):
        pf.flash_attention(*args, **kwargs)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("block_q", 48, "power of two"),
        ("block_kv", 8, "at least 16"),
        ("num_warps", 0, "positive int"),
        ("num_stages", 1.5, "positive int"),
    ],
)
def test_bad_config_is_named(field, value, words):
    with pytest.raises(ValueError, match=f"KernelConfig.{field}.*{words}"):
        pf.KernelConfig(**{field: value})


def test_mosaic_is_refused_where_it_cannot_run():
    """Forcing the Hopper kernel where it cannot serve the call raises and says why (never a silent fallback)."""
    q = jnp.ones((1, 8, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="implementation='mosaic' cannot serve"):
        pf.flash_attention(q, q, q, implementation="mosaic")


@pytest.mark.gpu
def test_default_implementation_on_hopper_is_mosaic_where_it_serves(caplog):
    """On sm90, None runs the Hopper kernel for bf16 causal attention and says so; float32 goes to 'pallas'."""
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    q, k, v, _ = make_inputs((1, 256, 256, 2, 2, 64), jnp.bfloat16, seed=13)
    api._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="pallas_flash"):
        pf.flash_attention(q, k, v, is_causal=True)
    assert any("implementation=None ran 'mosaic'" in r.getMessage() for r in caplog.records)
    api._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="pallas_flash"):
        pf.flash_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    assert any("not 'mosaic'" in r.getMessage() and "float32" in r.getMessage() for r in caplog.records)


# ---- the registry ---------------------------------------------------------------------------------------------


def _call(dtype=jnp.bfloat16, head_dim=64, features=(), mods=masks.ScoreMods()):
    x = jax.ShapeDtypeStruct((1, 256, 2, head_dim), dtype)
    return api.Call(x, x, masks.Band.of(True), pf.KernelConfig(), features, mods)


@pytest.mark.parametrize(
    "features, mods_kwargs, serves",
    [
        (("logits_soft_cap", "alibi_slopes"), dict(soft_cap=30.0, alibi=True), True),
        (("bias", "mask"), dict(bias_dims=(True, False, False, True), mask_dims=(False, True, True, False)), True),
        (("bias",), dict(bias_dims=(False, True, True, True)), True),  # over queries and keys: a dense tile
        (("bias", "mask", "logits_soft_cap"), dict(bias_dims=(True,) * 4, mask_dims=(True,) * 4, soft_cap=5.0), True),
        (("score_mod",), "relative_position_bias", False),
        (("mask_mod", "score_mod"), "document_alibi", True),
    ],
)
def test_hopper_takes_modifiers_it_can_stage(features, mods_kwargs, serves, monkeypatch):
    """On sm90 (faked): soft cap, ALiBi, a bias or mask over queries or keys, and stageable programs run in the
    Hopper kernels (as programs), a dense bias and mask as tiles; a program indexing by both positions does not,
    and says why."""
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    if mods_kwargs == "relative_position_bias":
        score = pf_mods.trace(pf_mods.relative_position_bias(jnp.zeros((2, 9))), "score")[0]
        mods_kwargs = dict(score_mod=score)
    elif mods_kwargs == "document_alibi":
        mods_kwargs = dict(
            mask_mod=pf_mods.trace(pf_mods.document(jnp.zeros((1, 256), jnp.int32)), "mask")[0],
            score_mod=pf_mods.trace(pf_mods.alibi(jnp.ones(2)), "score")[0],
        )
    call = _call(features=features, mods=masks.ScoreMods(**mods_kwargs))
    reason = api._mosaic_cannot_serve(call)
    assert (reason is None) == serves, reason
    if not serves:
        assert "bias" in reason or "score_mod: " in reason


def _unstageable_score():
    """A score program indexing a table by both positions: no kernel can stage it."""
    return pf_mods.trace(pf_mods.relative_position_bias(jnp.zeros((2, 9))), "score")[0]


@pytest.mark.parametrize("pattern", ["local", "strided"])
def test_hopper_serves_a_block_mask(pattern, monkeypatch):
    """On sm90 (faked) "mosaic" serves a block mask: a local window by its block ranges, a strided pattern (whose
    kept blocks are not one run per tile) as a dense mask, whose tiles must then fit beside a dense bias."""
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    size = 128 if pattern == "local" else 64
    block_mask = getattr(BlockMask, pattern)(256, 256, 2, block_q=size, block_kv=size)
    call = dataclasses.replace(_call(features=("block_mask",)), block_mask=block_mask)
    assert api._mosaic_cannot_serve(call) is None
    assert api.dispatch(None, call) == "mosaic"
    by_ranges = hopper_vjp._ranges_reason(
        block_mask, call.query, call.key, 64, band=call.band, config=call.config, mods=call.mods
    )
    assert (by_ranges is None) == (pattern == "local"), by_ranges


def test_hopper_refuses_dense_tiles_it_cannot_fit(monkeypatch):
    """On sm90 (faked), at head_dim 256 no forward tiles hold a dense bias tile beside K and V: "mosaic" is passed
    over with a reason that names the tiles; a dense mask alone (1 byte per logit) still fits."""
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    bias = _call(head_dim=256, features=("bias",), mods=masks.ScoreMods(bias_dims=(False, False, True, True)))
    assert "dense bias/mask tiles" in api._mosaic_cannot_serve(bias)
    assert api.dispatch(None, bias) != "mosaic"
    mask = _call(head_dim=256, features=("mask",), mods=masks.ScoreMods(mask_dims=(False, False, True, True)))
    assert api._mosaic_cannot_serve(mask) is None


def test_registry_lists_the_implementations_in_order_of_preference():
    assert tuple(impl.name for impl in api.REGISTRY) == pf.IMPLEMENTATIONS == ("mosaic", "pallas", "xla_chunked", "xla")


def test_dispatch_on_cpu(caplog):
    """Off the GPU, None passes over "mosaic" (no sm90) and "pallas" (interpret mode) to "xla_chunked", saying
    why; a forced implementation that cannot serve raises with the reason; "pallas" may be forced (and says it
    runs in interpret mode); an unknown name is an error."""
    if device.on_nvidia_gpu():
        pytest.skip("the CPU rule")
    api._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="pallas_flash"):
        assert api.dispatch(None, _call()) == "xla_chunked"
        assert api.dispatch("pallas", _call()) == "pallas"
    messages = [r.getMessage() for r in caplog.records]
    assert any("implementation='pallas' runs although no NVIDIA GPU" in m for m in messages), messages
    assert api.dispatch("xla", _call()) == "xla"
    with pytest.raises(ValueError, match="implementation='mosaic' cannot serve this call: .*sm90"):
        api.dispatch("mosaic", _call())
    with pytest.raises(ValueError, match="implementation must be None or one of"):
        api.dispatch("cuda", _call())


def test_dispatch_where_the_hopper_kernel_serves(monkeypatch, caplog):
    """On sm90 (faked) None runs "mosaic" for a bf16 call as the first choice, and passes it over, saying why,
    for float32, a head_dim past the kernel's and a feature it does not have."""
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    api._logged.clear()
    with caplog.at_level(logging.DEBUG, logger="pallas_flash"):
        assert api.dispatch(None, _call()) == "mosaic"
        for call, words in (
            (_call(dtype=jnp.float32), "bfloat16 or float16"),
            (_call(features=("score_mod",), mods=masks.ScoreMods(score_mod=_unstageable_score())), "score_mod: "),
            (_call(head_dim=512), "head_dim <= 256"),
        ):
            assert api.dispatch(None, call) != "mosaic"
            with pytest.raises(ValueError, match=f"implementation='mosaic' cannot serve this call: .*{words}"):
                api.dispatch("mosaic", call)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.endswith("ran 'mosaic' on backend 'cpu' (the first choice)") for m in messages), messages
    assert any("not 'mosaic': the Mosaic GPU kernel takes bfloat16 or float16" in m for m in messages), messages


# ---- the backward on given residuals ----------------------------------------------------------------------------


def _backward_options(name, batch, q_len, kv_len):
    """attention_backward's (and flash_attention's) options of a named case: a band, segment ids, a mask_mod with
    a closed-over array, a bool mask and a soft cap (the options without gradients of their own)."""
    rng = np.random.default_rng(7)
    if name == "causal":
        return dict(is_causal=True)
    if name == "window_segments":
        ids = lambda length: jnp.asarray(np.cumsum(rng.random((batch, length)) < 0.1, axis=1), jnp.int32)
        return dict(local_window_size=(9, 3), segment_ids=ids(q_len), kv_segment_ids=ids(kv_len))
    if name == "mask_mod_mask_soft_cap":
        starts = jnp.asarray(rng.integers(0, kv_len // 2, batch), jnp.int32)
        return dict(
            mask_mod=lambda b, h, qi, ki: ki >= starts[b] - qi % 3,
            mask=jnp.asarray(rng.random((1, 1, 1, kv_len)) < 0.8),
            logits_soft_cap=3.0,
        )
    raise AssertionError(name)


BACKWARD_CASES = ["causal", "window_segments", "mask_mod_mask_soft_cap"]


@pytest.mark.parametrize("case", BACKWARD_CASES)
@pytest.mark.parametrize("impl", ["xla_chunked", "pallas", "xla"])
def test_attention_backward_on_own_residuals_equals_the_vjp(impl, case):
    """attention_backward on a call's own (out, lse) and cotangents equals the vjp of that flash_attention call
    (the same implementation, the same backward), including a cotangent on the lse."""
    q, k, v, d_out = make_inputs(SHAPE, jnp.float32, seed=20)
    d_lse = 0.1 * make_inputs(SHAPE, jnp.float32, seed=21)[0][..., 0].swapaxes(1, 2)
    options = dict(_backward_options(case, SHAPE[0], SHAPE[1], SHAPE[2]), implementation=impl, config=SMALL_BLOCKS)

    @jax.jit
    def both(q, k, v):
        (out, lse), vjp = jax.vjp(lambda *x: pf.flash_attention(*x, return_lse=True, **options), q, k, v)
        return vjp((d_out, d_lse)), api.attention_backward(q, k, v, out, lse, d_out, d_lse, **options)

    want, got = both(q, k, v)
    for name, g, w, x in zip("qkv", got, want, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert_close(g, w, jnp.float32, table=GRADIENT, what=f"d{name}")


@pytest.mark.parametrize("given_delta", [False, True])
@pytest.mark.parametrize("impl", ["xla_chunked", "pallas"])
def test_attention_backward_of_a_key_split_adds_up_to_the_whole(impl, given_delta):
    """With the residuals of attention over all keys, attention_backward on each part of a key split gives that
    part's dk, dv and its share of dq: the parts add up to the whole call's gradient (ring attention's steps),
    from (out, d_lse) or from the delta they make."""
    q, k, v, d_out = make_inputs(SHAPE, jnp.float32, seed=22)
    d_lse = 0.1 * make_inputs(SHAPE, jnp.float32, seed=23)[0][..., 0].swapaxes(1, 2)
    options = _backward_options("window_segments", SHAPE[0], SHAPE[1], SHAPE[2])
    kv_ids = options.pop("kv_segment_ids")
    options.update(implementation=impl, config=SMALL_BLOCKS, local_window_size=None)
    split = 24  # a key block boundary of SMALL_BLOCKS, and a ragged last part

    @jax.jit
    def both(q, k, v):
        (out, lse), vjp = jax.vjp(
            lambda *x: pf.flash_attention(*x, kv_segment_ids=kv_ids, return_lse=True, **options), q, k, v
        )
        rows, delta = (
            ((None, lse, d_out, None), _delta(out, d_out, d_lse)) if given_delta else ((out, lse, d_out, d_lse), None)
        )
        parts = [
            api.attention_backward(
                q, k[:, keys], v[:, keys], *rows, delta=delta, kv_segment_ids=kv_ids[:, keys], **options
            )
            for keys in (slice(0, split), slice(split, None))
        ]
        return vjp((d_out, d_lse)), parts

    (dq, dk, dv), parts = both(q, k, v)
    assert_close(parts[0][0] + parts[1][0], dq, jnp.float32, table=GRADIENT, what="dq")
    assert_close(jnp.concatenate([parts[0][1], parts[1][1]], axis=1), dk, jnp.float32, table=GRADIENT, what="dk")
    assert_close(jnp.concatenate([parts[0][2], parts[1][2]], axis=1), dv, jnp.float32, table=GRADIENT, what="dv")


def _delta(out, d_out, d_lse):
    return jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32)) - d_lse


def test_attention_backward_checks_its_residuals():
    q, k, v, d_out = make_inputs(SHAPE, jnp.float32, seed=24)
    lse = jnp.zeros((SHAPE[0], SHAPE[3], SHAPE[1]), jnp.float32)
    with pytest.raises(ValueError, match="lse must have shape"):
        api.attention_backward(q, k, v, d_out, lse[:, :, :5], d_out)
    with pytest.raises(ValueError, match="delta must have shape"):
        api.attention_backward(q, k, v, None, lse, d_out, delta=lse[:, :, :5])
    with pytest.raises(ValueError, match="delta in place of out and d_lse"):
        api.attention_backward(q, k, v, d_out, lse, d_out, delta=lse)
    with pytest.raises(ValueError, match="needs out"):
        api.attention_backward(q, k, v, None, lse, d_out)
    with pytest.raises(ValueError, match='not served by the "xla" implementation'):
        api.attention_backward(q, k, v, None, lse, d_out, delta=lse, implementation="xla")
    with pytest.raises(TypeError, match="scale must be a Python float"):
        api.attention_backward(q, k, v, d_out, lse, d_out, scale=jnp.float32(0.5))


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [pytest.param("causal", marks=pytest.mark.slow), "mask_mod_mask_soft_cap"])
def test_attention_backward_runs_the_hopper_backward(case, monkeypatch):
    """On sm90 (faked), attention_backward hands the Hopper custom_vjp's backward the residuals its forward would
    save (staged programs included); run in JAX's Mosaic GPU interpreter, it equals the portable backward on the
    same residuals."""
    from pallas_flash import _compat
    from pallas_flash.hopper import vjp as hopper_vjp

    params = _compat.mosaic_gpu_interpret_params(detect_races=False)
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    shape = (1, 64, 64, 2, 1, 64)
    q, k, v, d_out = make_inputs(shape, jnp.bfloat16, seed=25)
    out, lse = pf.flash_attention(q, k, v, return_lse=True, **_backward_options(case, 1, 64, 64))
    options = _backward_options(case, 1, 64, 64)
    want = api.attention_backward(q, k, v, out, lse, d_out, implementation="pallas", **options)
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    interpreted = functools.partial(hopper_vjp.hopper_bwd.hopper_backward, interpret=params)
    monkeypatch.setattr(hopper_vjp.hopper_bwd, "hopper_backward", interpreted)
    got = api.attention_backward(q, k, v, out, lse, d_out, implementation="mosaic", **options)
    for name, g, w in zip("qkv", got, want):
        assert_close(g, w, jnp.bfloat16, table=GRADIENT, what=f"d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_attention_backward_on_hopper_equals_the_vjp(case):
    """On sm90, attention_backward(implementation="mosaic") on a call's own residuals (or on the delta they make)
    equals that call's vjp."""
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    shape = (2, 256, 384, 4, 2, 64)
    q, k, v, d_out = make_inputs(shape, jnp.bfloat16, seed=26)
    d_lse = 0.1 * make_inputs(shape, jnp.float32, seed=27)[0][..., 0].swapaxes(1, 2)
    options = dict(_backward_options(case, *shape[:3]), implementation="mosaic")

    @jax.jit
    def both(q, k, v):
        (out, lse), vjp = jax.vjp(lambda *x: pf.flash_attention(*x, return_lse=True, **options), q, k, v)
        delta = _delta(out, d_out, d_lse)
        return vjp((d_out, d_lse)), [
            api.attention_backward(q, k, v, out, lse, d_out, d_lse, **options),
            api.attention_backward(q, k, v, None, lse, d_out, delta=delta, **options),
        ]

    want, gots = both(q, k, v)
    for got in gots:
        for name, g, w in zip("qkv", got, want):
            assert_close(g, w, jnp.float32, table=GRADIENT, what=f"d{name}")
