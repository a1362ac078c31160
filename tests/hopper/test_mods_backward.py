"""score_mod and mask_mod in the Hopper backward kernels (dK/dV and dQ passes): gradients of q, k, v and of a
score program's closed-over float arrays, in JAX's Mosaic GPU interpreter against the float32 reference, and
through Mosaic GPU's lowering for CUDA."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, masks, mods, reference
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import bwd_dkdv as hopper_bwd_dkdv
from pallas_flash.hopper import bwd_dq as hopper_bwd_dq
from pallas_flash.hopper.common import long_tiles_first
from pallas_flash.hopper.config import HopperBwdConfig
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


def _document_causal_alibi(shape):
    """GQA, causal documents as a mask program, ALiBi plus a per-(head, key) bias table as the score program:
    float row values (the slopes, per head) and float column values that vary with the query head within a
    kv head's group. Documents [0, 256) and [256, ...): some blocks wholly visible in both passes (the
    unmasked run), others partly; query rows 300-309 have a document of their own with no keys (they see
    no key: lse = -inf)."""
    batch, q_len, kv_len, heads = shape[:4]
    kv_ids = packed_ids(kv_len, 256)
    q_ids = packed_ids(q_len, 256)
    q_ids[300:310] = 9
    ids = [jnp.asarray(np.stack([x] * batch)) for x in (q_ids, kv_ids)]
    slopes = jnp.asarray([0.05, 0.2, 0.1, 0.02], jnp.float32)[:heads]
    table = 0.3 * jnp.asarray(np.random.default_rng(5).standard_normal((heads, kv_len)), jnp.float32)
    score = lambda slopes, table: mods.chain(mods.alibi(slopes), lambda s, b, h, q, k: s + table[h, k])  # noqa: E731
    return score, (slopes, table), mods.and_masks(mods.causal(), mods.document(*ids))


def _capped_key_bias(shape):
    """A soft cap then a per-(batch, key) bias vector (float column values that vary with the batch); a prefix
    LM mask whose first example's prefix covers every key (wholly visible blocks, and one with padded keys
    that only the band's ragged-tail rule masks) and whose second's is short (causal blocks)."""
    batch, _, kv_len = shape[:3]
    bias = 0.5 * jnp.asarray(np.random.default_rng(6).standard_normal((batch, kv_len)), jnp.float32)
    score = lambda bias: mods.chain(mods.soft_cap(4.0), lambda s, b, h, q, k: s + bias[b, k])  # noqa: E731
    return score, (bias,), mods.prefix_lm(jnp.asarray([kv_len, 10][:batch], jnp.int32))


def _causal_alibi(shape):
    """ALiBi with constant slopes under a causal band (`mods.causal`): no value needs a gradient, so both passes
    read |k - q| as q - k and take the per-query term off lse2; q_len > kv_len leaves rows past the keys."""
    slopes = jnp.asarray([0.3, 0.05], jnp.float32)[: shape[3]]
    return (lambda slopes: mods.alibi(jax.lax.stop_gradient(slopes))), (slopes,), mods.causal()


def _global_window_alibi(shape):
    """ALiBi with constant slopes under 16 global keys and a 40-key window, causal: every query tile past the
    window's reach has a gap of hidden key blocks between the global keys and its window, which the dQ pass steps
    over (`Gap`)."""
    slopes = jnp.asarray([0.3, 0.05], jnp.float32)[: shape[3]]
    window = mods.or_masks(lambda b, h, q, k: k < 16, mods.sliding_window(40, 0))
    return (lambda slopes: mods.alibi(jax.lax.stop_gradient(slopes))), (slopes,), mods.and_masks(mods.causal(), window)


# Cases whose kernels also get the causal band (as `flash_attention` gives them for `mods.causal`).
CAUSAL_BAND = {"alibi_causal"}


# (shape, programs, config): tiles of 64 (dQ tiles of 128 queries, dK/dV tiles of 128 keys).
CASES = {
    "alibi_causal": ((1, 200, 130, 2, 1, 64), _causal_alibi, HopperBwdConfig()),
    "documents_alibi_gqa": ((1, 320, 320, 2, 1, 64), _document_causal_alibi, HopperBwdConfig()),
    "soft_cap_key_bias_overlap": (
        (2, 150, 100, 1, 1, 64),
        _capped_key_bias,
        HopperBwdConfig(dq_overlap=True, dkv_overlap=True, num_stages_dkv=3, num_stages_dq=3),
    ),
    "global_window_gap_overlap": (
        (1, 400, 400, 1, 1, 64),
        _global_window_alibi,
        HopperBwdConfig(dq_overlap=True, dkv_overlap=True, num_stages_dkv=3, num_stages_dq=3),
    ),
    # the plain steps, as a nonlinear score program's head_dim-128 default runs them
    "soft_cap_key_bias": ((2, 150, 100, 1, 1, 64), _capped_key_bias, HopperBwdConfig()),
}


def _programs(case, shape=None):
    """(score Program, its consts, mask Program, its consts) of a case, at its shape or at `shape`."""
    case_shape, build, _ = CASES[case]
    score_fn, score_arrays, mask_fn = build(shape or case_shape)
    score, score_consts = mods.trace(score_fn(*score_arrays), "score")
    mask, mask_consts = mods.trace(mask_fn, "mask")
    return score, score_consts, mask, mask_consts


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=() if c == "alibi_causal" else pytest.mark.slow) for c in CASES],
)  # `slow` (CI's time): outside it the dropout backward with a score_mod (test_dropout) and attention_backward with
# a mask_mod (test_api) run programs through both passes; the GPU test runs soft cap and the overlaps
def test_backward_with_programs_in_mosaic_gpu_interpreter(case):
    """Both passes with a score and a mask program (recomputed modified scores, dS taken back through the score
    program, the mask program's block ranges and unmasked runs, row values resident / riding the K ring in
    the dQ pass and riding the Q ring / resident per head in the dK/dV pass) from the reference's residuals:
    dq, dk, dv, and the gradients of the score program's closed-over float arrays (from the kernels' row
    and column cotangents, through `Staged.stacks`) against the reference's. Under a causal band (CAUSAL_BAND)
    ALiBi's |k - q| is read as q - k and its per-query term is taken off lse2 in both passes."""
    _check_backward_with_programs(case)


@pytest.mark.interpreter
@pytest.mark.slow  # CI's time: test_backward_ctas_read_the_launch_order covers the lookup
def test_dkdv_ctas_take_items_in_launch_order_in_mosaic_gpu_interpreter(monkeypatch):
    """Under block ranges each dK/dV CTA takes its (batch, kv head, key tile) from the launch order
    (`long_tiles_first`): in reverse order the gradients are still the reference's."""
    reverse = lambda ranges, *, batch, heads, num_tiles: jnp.arange(batch * heads * num_tiles)[::-1]  # noqa: E731
    monkeypatch.setattr(hopper_bwd_dkdv, "long_tiles_first", reverse)
    _check_backward_with_programs("global_window_gap_overlap")


@pytest.mark.interpreter
def test_backward_ctas_read_the_launch_order(monkeypatch):
    """With every CTA of both passes given the last tile by the launch order, the last tile's dQ and dK are the
    reference's and the first tile's are never written (a kernel that ignored the order would compute both)."""
    params = _compat.mosaic_gpu_interpret_params(detect_races=False)
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    last = lambda ranges, *, batch, heads, num_tiles, **_: jnp.full((batch * heads * num_tiles,), num_tiles - 1)  # noqa: E731
    monkeypatch.setattr(hopper_bwd_dkdv, "long_tiles_first", last)
    monkeypatch.setattr(hopper_bwd_dq, "long_tiles_first", last)
    shape = (1, 256, 256, 1, 1, 64)  # two dK/dV tiles of 128 keys, two dQ tiles of 128 queries
    q, k, v, d_out, d_lse = make_backward_inputs(shape, jnp.bfloat16, seed=8)
    mask, consts = mods.trace(mods.sliding_window(100, 100), "mask")
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = lambda q, k, v: reference.attention_reference(q, k, v, scale=0.125, mask_mod=mask, mask_consts=consts)  # noqa: E731
    (out, lse), vjp = jax.vjp(ref, *f32)
    want_dq, want_dk, _ = vjp((d_out.astype(jnp.float32), d_lse))
    staged = mods.stage(mask)[0]
    dq, dk, _, _, _ = hopper_bwd.hopper_backward(
        q, k, v, out.astype(q.dtype), lse, d_out, d_lse, scale=0.125, config=HopperBwdConfig(), mask_mod=staged,
        mask_stacks=staged.stacks(consts, batch=1, heads=1, q_len=256, kv_len=256), interpret=params,
    )  # fmt: skip
    for name, ours, ref in (("dq", dq, want_dq), ("dk", dk, want_dk)):
        assert_close(ours[:, 128:], ref[:, 128:], jnp.bfloat16, table=GRADIENT, what=f"{name} of the last tile")
        assert not np.allclose(np.asarray(ours[:, :128], np.float32), np.asarray(ref[:, :128]), atol=1e-2), name


@pytest.mark.interpreter
def test_dkdv_steps_over_the_gap_of_global_queries():
    """Global queries (a query-only term ORed in) and a window, with queries 64-191 seeing nothing: the dK/dV pass's
    key tiles past the window's reach step over those query blocks, so their NaN queries and output cotangents
    leave dK and dV equal to the reference's (and dQ outside those rows)."""
    params = _compat.mosaic_gpu_interpret_params(detect_races=True)
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    shape = (1, 512, 512, 1, 1, 64)
    q, k, v, d_out, d_lse = make_backward_inputs(shape, jnp.bfloat16, seed=44)
    window = mods.or_masks(lambda b, h, q, k: q < 16, mods.sliding_window(20, 20))
    mask, consts = mods.trace(mods.and_masks(window, lambda b, h, q, k: (q < 64) | (q >= 192)), "mask")
    staged = mods.stage(mask)[0]
    assert staged.ors_query_term
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = lambda q, k, v: reference.attention_reference(q, k, v, scale=0.125, mask_mod=mask, mask_consts=consts)  # noqa: E731
    (out, lse), vjp = jax.vjp(ref, *f32)
    want = vjp((d_out.astype(jnp.float32), d_lse))
    hidden = jnp.asarray((np.arange(512) >= 64) & (np.arange(512) < 192))
    poison = lambda x: jnp.where(hidden[None, :, None, None], jnp.nan, x).astype(x.dtype)  # noqa: E731
    dq, dk, dv, _, _ = interpreted_hopper_backward(
        poison(q), k, v, out.astype(q.dtype), lse, poison(d_out), d_lse, scale=0.125, config=HopperBwdConfig(),
        mask_mod=staged, mask_stacks=staged.stacks(consts, batch=1, heads=1, q_len=512, kv_len=512), interpret=params,
    )  # fmt: skip
    assert_gradients_close((dk, dv), want[1:], names=("dk", "dv"))
    assert_close(dq[:, ~hidden], want[0][:, ~hidden], jnp.bfloat16, table=GRADIENT, what="dq")


def test_ors_query_term():
    """Which mask programs get the dK/dV pass's gap: those ORing in a term of the query position alone."""
    staged = lambda fn: mods.stage(mods.trace(fn, "mask")[0])[0]  # noqa: E731
    window = mods.sliding_window(64, 64)
    assert staged(mods.or_masks(lambda b, h, q, k: q < 16, window)).ors_query_term
    assert not staged(mods.or_masks(lambda b, h, q, k: k < 16, window)).ors_query_term
    assert not staged(mods.document(jnp.zeros((1, 64), jnp.int32))).ors_query_term


def test_long_tiles_first_order():
    """Tiles over LONG_TILE_FACTOR times the mean number of visited blocks launch first, longest first; the others
    keep their grid order (row-major over batch, head, tile), which may run a tile axis in reverse."""
    steps = np.array([[[2, 2, 40, 20], [2, 2, 2, 2]]])  # [batch, heads, tiles]: mean 9
    ranges = jnp.asarray(np.stack([np.zeros_like(steps), steps], axis=-1))
    order = long_tiles_first(ranges, batch=1, heads=2, num_tiles=4)
    np.testing.assert_array_equal(order, [2, 0, 1, 3, 4, 5, 6, 7])  # 20 < 4 x 9: not long
    order = long_tiles_first(ranges, batch=1, heads=2, num_tiles=4, reverse_tiles=True)
    np.testing.assert_array_equal(order, [1, 0, 2, 3, 4, 5, 6, 7])  # grid tile 1 is range tile 2


def _check_backward_with_programs(case):
    shape, _, config = CASES[case]
    params = _compat.mosaic_gpu_interpret_params(detect_races=True)
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    batch, q_len, kv_len, heads = shape[:4]
    q, k, v, d_out, d_lse = make_backward_inputs(shape, jnp.bfloat16, seed=7)
    score, score_consts, mask, mask_consts = _programs(case)
    scale = 0.125

    def ref(q, k, v, consts):
        return reference.attention_reference(
            q, k, v, scale=scale, score_mod=score, score_consts=consts, mask_mod=mask, mask_consts=mask_consts
        )

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (out, lse), vjp = jax.vjp(ref, *f32, score_consts)
    want = vjp((d_out.astype(jnp.float32), d_lse))
    assert np.isneginf(lse).any() == (case == "documents_alibi_gqa")

    staged_score, staged_mask = mods.stage(score)[0], mods.stage(mask)[0]
    dims = dict(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)
    score_stacks, stacks_vjp = jax.vjp(lambda c: staged_score.stacks(c, **dims), score_consts)
    dq, dk, dv, d_rows, d_cols = interpreted_hopper_backward(
        q, k, v, out.astype(q.dtype), lse, d_out, d_lse,
        scale=scale, config=config, score_mod=staged_score, score_stacks=score_stacks, mask_mod=staged_mask,
        mask_stacks=staged_mask.stacks(mask_consts, **dims), interpret=params, is_causal=case in CAUSAL_BAND,
    )  # fmt: skip
    assert_gradients_close((dq, dk, dv), want, (q, k, v))
    cotangents = tuple(None if s is None else jnp.zeros_like(s) for s in score_stacks)
    cotangents = (cotangents[0], d_rows, cotangents[2], d_cols)
    (d_consts,) = stacks_vjp(cotangents)
    for i, (ours, ref_grad) in enumerate(zip(d_consts, want[3])):
        assert_close(ours, ref_grad, jnp.bfloat16, table=GRADIENT, what=f"closed-over array {i}")


@pytest.mark.lowering
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_with_programs_lowers_for_gpu(case, head_dim):
    """Both passes with a score and a mask program (register-layout joint evaluation, the score program's vjp,
    the staged vectors' loads and the gradients' stores) go through Mosaic GPU's lowering at the default
    config (two passes with programs: at head_dim 64 the plain ones; at 128 with delta_in_dp, and both overlaps
    unless the score program is nonlinear, as the soft cap's), ragged and GQA."""
    shape = (2, 300, 200, 4, 2, head_dim)
    q, k, lse, _ = abstract_inputs(shape, False)
    score, score_consts, mask, mask_consts = _programs(case, shape)
    staged_score, staged_mask = mods.stage(score)[0], mods.stage(mask)[0]
    dims = dict(batch=2, heads=4, q_len=300, kv_len=200)
    score_kind = hopper_bwd.score_kind(staged_score)
    config = hopper_bwd.default_config(head_dim, 200, masks.Band.of(False, None), True, programs=True, score=score_kind)
    assert not config.dq_atomic
    if head_dim == 128:
        assert config.delta_in_dp and config.dkv_overlap == (score_kind == "linear")

    def backward(q, k, v, out, lse, d_out, d_lse):
        score_stacks = staged_score.stacks(score_consts, **dims)
        return hopper_bwd.hopper_backward(
            q,
            k,
            v,
            out,
            lse,
            d_out,
            d_lse,
            scale=0.125,
            config=config,
            score_mod=staged_score,
            score_stacks=score_stacks,
            mask_mod=staged_mask,
            mask_stacks=staged_mask.stacks(mask_consts, **dims),
        )

    text = lower_for_cuda(backward, q, k, k, q, lse, q, lse)
    assert text.count(MOSAIC_CALL) == 2
    assert "flash_backward_dkdv_sm90" in text and "flash_backward_dq_sm90" in text


def test_one_pass_refuses_programs():
    """The one-pass backward takes no programs: a clear error, and the default config is two passes."""
    mask, consts = mods.trace(mods.causal(), "mask")
    staged = mods.stage(mask)[0]
    x = jax.ShapeDtypeStruct((1, 64, 1, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 1, 64), jnp.float32)
    config = dataclasses.replace(HopperBwdConfig.default(64), dq_atomic=True)
    with pytest.raises(ValueError, match="dq_atomic"):
        jax.eval_shape(
            lambda q, lse: hopper_bwd.hopper_backward(
                q, q, q, q, lse, q, None, scale=1.0, config=config, mask_mod=staged,
                mask_stacks=staged.stacks(consts, batch=1, heads=1, q_len=64, kv_len=64),
            ),
            x,
            lse,
        )  # fmt: skip
    assert not hopper_bwd.default_config(64, 8192, masks.Band.of(False, None), True, programs=True).dq_atomic


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_grad_of_mosaic_attention_with_programs(head_dim):
    """jax.grad of flash_attention(implementation="mosaic") with a score_mod (ALiBi, slopes closed over and
    differentiated) and a mask_mod (causal documents) on the H100, against the float32 reference."""
    shape = (2, 1000, 1000, 4, 2, head_dim)
    q, k, v, cotangent = make_inputs(shape, jnp.bfloat16, seed=11)
    ids = jnp.asarray(np.stack([packed_ids(1000, 300, 620), packed_ids(1000, 500)]))
    slopes = jnp.asarray([0.01, 0.02, 0.05, 0.1], jnp.float32)
    mask_mod = mods.and_masks(mods.causal(), mods.document(ids))

    def loss(attend, q, k, v, slopes):
        out = attend(q, k, v, score_mod=mods.alibi(slopes), mask_mod=mask_mod)
        return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

    def ours(q, k, v, score_mod, mask_mod):
        return pf.flash_attention(q, k, v, implementation="mosaic", score_mod=score_mod, mask_mod=mask_mod)

    def ref(q, k, v, score_mod, mask_mod):
        score, score_consts = mods.trace(score_mod, "score")
        mask, mask_consts = mods.trace(mask_mod, "mask")
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return reference.attention_reference(
            *f32, scale=head_dim**-0.5, score_mod=score, score_consts=score_consts, mask_mod=mask,
            mask_consts=mask_consts,
        )[0]  # fmt: skip

    grads = jax.jit(jax.grad(lambda *x: loss(ours, *x), argnums=(0, 1, 2, 3)))(q, k, v, slopes)
    want = jax.jit(jax.grad(lambda *x: loss(ref, *x), argnums=(0, 1, 2, 3)))(q, k, v, slopes)
    for name, ours_grad, ref_grad in zip(("dq", "dk", "dv", "d_slopes"), grads, want):
        assert_close(ours_grad, ref_grad, jnp.bfloat16, table=GRADIENT, what=name)


def _gain_times_bias(shape):
    """-2 s + gain[q] * bias[b, k]: a constant d score / d s of -2, float row and column values."""
    batch, q_len, kv_len = shape[:3]
    gain = jnp.asarray(np.random.default_rng(8).uniform(0.5, 1.5, q_len), jnp.float32)
    bias = jnp.asarray(np.random.default_rng(9).standard_normal((batch, kv_len)), jnp.float32)
    return lambda s, b, h, q, k: -2.0 * s + gain[q] * bias[b, k]


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [4096, 1500])
def test_causal_alibi_with_fixed_slopes(q_len):
    """Causal ALiBi with constant slopes (`alibi_slopes`) on the H100: |k - q| read as q - k, its per-query term
    in each pass's row shift and positions counted from each key block, at a length where positions times the
    slopes are large; q_len < kv_len. Output, LSE and dq, dk, dv against the float32 reference."""
    shape = (1, q_len, 4096, 2, 2, 128)
    q, k, v, cotangent = make_inputs(shape, jnp.bfloat16, seed=12)
    slopes = jnp.asarray([0.5, 0.0625], jnp.float32)

    def ours(q, k, v):
        return pf.flash_attention(q, k, v, is_causal=True, alibi_slopes=slopes, implementation="mosaic",
                                  return_lse=True)  # fmt: skip

    def ref(q, k, v):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return reference.attention_reference(*f32, scale=128**-0.5, is_causal=True, alibi_slopes=slopes)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v)[0].astype(jnp.float32) * cotangent.astype(jnp.float32))

    (out, lse), (ref_out, ref_lse) = jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v)
    assert_close(out, ref_out, jnp.bfloat16, what="out")
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-3, atol=2e-3)
    grads, want = (jax.jit(jax.grad(functools.partial(loss, f), argnums=(0, 1, 2)))(q, k, v) for f in (ours, ref))
    for name, ours_grad, ref_grad in zip(("dq", "dk", "dv"), grads, want):
        assert_close(ours_grad, ref_grad, jnp.bfloat16, table=GRADIENT, what=name)


# name: a score_mod at a shape (batch, q_len, kv_len, heads): each `program_score` path (a constant d score / d s
# with and without a vjp for the values' gradients, and a vjp in the logits).
PULLBACK_PROGRAMS = {
    "alibi": lambda shape: mods.alibi(jnp.linspace(0.1, 0.4, shape[3])),
    "fixed_alibi": lambda shape: lambda s, b, h, q, k: s - 0.1 * jnp.abs(k - q).astype(jnp.float32),
    "soft_cap_key_bias": lambda shape: (lambda score, arrays, _: score(*arrays))(*_capped_key_bias(shape)),
    "gain_times_bias": _gain_times_bias,
    # a per-query bias: a row term wherever the pass does not differentiate row values
    "query_bias": lambda shape: lambda s, b, h, q, k, t=jnp.linspace(-1.0, 1.0, shape[1]): s + t[q],
    # positions read otherwise than as their difference: the kernels' origin must not reach them
    "position_sum": lambda shape: lambda s, b, h, q, k: s + 0.01 * (q + k - 1).astype(jnp.float32),
}


@pytest.mark.parametrize("key_before_query", [False, True])
@pytest.mark.parametrize("q_axis", [0, 1])
@pytest.mark.parametrize("name", PULLBACK_PROGRAMS)
def test_program_score_pullback_matches_autodiff(name, q_axis, key_before_query):
    """`common.program_score` (the backward kernels' evaluation of a score program on vectors, its constants
    folded, with a pullback that skips the vjp of the logits where d score / d s is a constant) against jax.vjp
    of the program on full tiles: base-2 logits (with `key_before_query`, where the key is at or before the
    query, |k - q| read as q - k and the per-query term apart; positions from an origin where only their
    difference is read), d x, and the gradients of the float values on the side a pass accumulates (queries in
    the dQ pass, keys in the dK/dV pass)."""
    from pallas_flash.blocks import LOG2E
    from pallas_flash.hopper.common import program_score

    shape = (2, 24, 40, 3)
    batch, q_len, kv_len, heads = shape
    program, consts = mods.trace(PULLBACK_PROGRAMS[name](shape), "score")
    staged, why = mods.stage(program)
    assert why is None
    stacks = staged.stacks(consts, batch, heads, q_len, kv_len)
    scale, b, h = 0.3, 1, 2
    s = jnp.asarray(np.random.default_rng(3).standard_normal((q_len, kv_len)) * 3, jnp.float32)
    d_score = jnp.asarray(np.random.default_rng(4).standard_normal((q_len, kv_len)), jnp.float32)
    s, d_score = (s, d_score) if q_axis == 0 else (s.T, d_score.T)
    vectors = [[] if x is None else list(x[b if x.shape[0] > 1 else 0, h if x.shape[1] > 1 else 0]) for x in stacks]
    q, k = jnp.arange(q_len, dtype=jnp.int32), jnp.arange(kv_len, dtype=jnp.int32)
    assert staged.needs_grad == (name not in ("fixed_alibi", "position_sum"))  # these close over no float array
    grad_side = ("row" if q_axis == 0 else "col") if staged.needs_grad else None
    logits2, pullback, row2 = program_score(
        staged, s, vectors[:2], vectors[2:], scale=scale, batch=b, head=h, q_idx=q, kv_idx=k, q_axis=q_axis,
        max_position=kv_len, grad_side=grad_side, key_before_query=key_before_query, origin=16,
    )  # fmt: skip
    d_x, d_values = pullback(d_score)

    tile = lambda x, side: jax.lax.broadcast_in_dim(x, s.shape, [q_axis if side == "row" else 1 - q_axis])  # noqa: E731
    # A per-query term kept apart (ALiBi's under the band, the query bias's), unless this pass differentiates the
    # program's row values (the slopes, the bias).
    kept_apart = name == "query_bias" or (key_before_query and "alibi" in name)
    assert (row2 is not None) == (kept_apart and grad_side != "row")
    if row2 is not None:
        logits2 = logits2 + tile(row2, "row")
    if key_before_query:  # the kernels hide the rest
        logits2 = jnp.where(tile(k, "col") <= tile(q, "row"), logits2, 0.0)
    ri, rf, ci, cf = ([tile(x, side) for x in group] for group, side in zip(vectors, ["row"] * 2 + ["col"] * 2))
    floats = {"row": rf, "col": cf}.get(grad_side, [])

    def reference(x, floats):
        row_floats, col_floats = (floats, cf) if grad_side == "row" else (rf, floats if grad_side else cf)
        return staged.joint(x, b, h, tile(q, "row"), tile(k, "col"), ri, row_floats, ci, col_floats)

    want, vjp = jax.vjp(reference, scale * s, floats)
    want_d_x, want_d_floats = vjp(d_score)
    if key_before_query:
        want = jnp.where(tile(k, "col") <= tile(q, "row"), want, 0.0)
    np.testing.assert_allclose(logits2, want * LOG2E, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_x, want_d_x, rtol=1e-5, atol=1e-5)
    assert len(d_values) == len(want_d_floats) == (0 if grad_side is None else len(floats))
    for ours, ref in zip(d_values, want_d_floats):
        np.testing.assert_allclose(ours, ref.sum(axis=1), rtol=1e-4, atol=1e-4)  # over the other side


@pytest.mark.parametrize("differentiated", ["q", "q_and_slopes", "q_stopped_slopes"])
def test_backward_computes_only_the_wanted_program_gradients(differentiated, monkeypatch):
    """jax.grad through flash_attention(implementation="mosaic") with a score_mod closing over a float array (ALiBi's
    slopes): the Hopper backward gets the program with gradients of its values only where the array is
    differentiated; constant or stopped, none (the kernels skip that work). Traced on CPU, as on sm90."""
    from pallas_flash import device
    from pallas_flash.hopper import vjp as hopper_vjp

    needs_grad = []
    traced = hopper_vjp.hopper_bwd.hopper_backward

    def recording(*args, **kwargs):
        needs_grad.append(kwargs["score_mod"].needs_grad)
        return traced(*args, **kwargs)

    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    monkeypatch.setattr(hopper_vjp.hopper_bwd, "hopper_backward", recording)
    jax.clear_caches()  # the backward is traced anew (another case may have traced the same one)
    q, k, v, _ = make_inputs((1, 128, 128, 2, 2, 64), jnp.bfloat16, seed=3)
    slopes = jnp.asarray([0.1, 0.2], jnp.float32)

    def loss(q, slopes):
        if differentiated == "q_stopped_slopes":
            slopes = jax.lax.stop_gradient(slopes)
        out = pf.flash_attention(q, k, v, is_causal=True, score_mod=mods.alibi(slopes), implementation="mosaic")
        return out.astype(jnp.float32).sum()

    argnums = (0, 1) if differentiated != "q" else 0
    jax.make_jaxpr(jax.grad(loss, argnums=argnums))(q, slopes)
    assert needs_grad == [differentiated == "q_and_slopes"]
