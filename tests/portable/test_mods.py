"""score_mod and mask_mod in the portable kernels (Pallas interpret mode on CPU): forward, LSE and gradients
(of q, k, v, a bias and the mods' closed-over float arrays) against the dense reference running the same
programs; the visit tables a mask_mod's block classes make; programs the kernels cannot stage; the Triton
lowering; and on a GPU the compiled kernels. The semantics on every implementation: tests/test_mods.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, masks, mods
from pallas_flash._compat import TritonCompilerParams
from pallas_flash.block_sparse import VISITS_HEADER
from pallas_flash.portable import vjp as portable
from tests.helpers import (
    MODIFIER_SHAPE,
    SMALL_BLOCKS,
    _check_rows_and_lse,
    _outputs_and_grads,
    make_inputs,
    modifier_block_mask,
    normal,
    packed_segment_ids,
    reference_mask_args,
)
from tests.tolerances import GRADIENT, assert_close


def _alibi_soft_cap(params, shape):
    return dict(score_mod=mods.chain(mods.soft_cap(2.0), mods.alibi(params["slopes"])))


def _document_causal_key_bias(params, shape):
    """Documents (a per-example int array on both sides) and a closed-over per-key float bias (a column value
    with a gradient), with per-example key lengths (segment ids in the kernels: every visited tile masked)."""
    batch, q_len, kv_len = shape[:3]
    docs = packed_segment_ids(batch, max(q_len, kv_len), [(9, 30), (17,)])
    key_bias = params["key_bias"]
    return dict(
        score_mod=lambda s, b, h, qi, ki: s + key_bias[b, ki],
        mask_mod=mods.and_masks(mods.document(docs[:, :q_len], docs[:, :kv_len]), mods.causal()),
        key_value_seq_lengths=jnp.asarray([kv_len, kv_len - 11][:batch]),
    )


def _sliding_window_block_mask(params, shape):
    """A mask_mod and a per-head block mask, which hides a whole query block of head 0 (rows that see no key)."""
    return dict(mask_mod=mods.sliding_window(8, 3), block_mask=modifier_block_mask(shape))


def _prefix_lm_query_scale_bias(params, shape):
    """prefix_lm beside an existing modifier (a bias, with its gradient through the score_mod) and a
    per-(head, query) float factor (a row value with a gradient)."""
    factor = params["factor"]
    return dict(
        score_mod=lambda s, b, h, qi, ki: s * factor[h, qi],
        mask_mod=mods.prefix_lm(jnp.asarray([7, 0])),
        bias=params["bias"],
    )


def _empty_rows_dropout(params, shape):
    """Head 1 and the first two queries see nothing (zeros, LSE -inf, finite gradients), with dropout."""
    return dict(
        mask_mod=lambda b, h, qi, ki: (h != 1) & (qi >= 2) & (ki <= qi + 4),
        dropout_rate=0.3,
        dropout_rng=jax.random.key(29),
    )


# name: (mods builder, (batch, q_len, kv_len, heads, kv_heads, head_dim), is_causal, float arrays to differentiate)
CASES = {
    # GQA, q_len != kv_len, lengths that are not block multiples
    "alibi_soft_cap_causal": (_alibi_soft_cap, MODIFIER_SHAPE, True, lambda s: dict(slopes=jnp.geomspace(0.5, 0.1, 4))),
    "document_causal_key_bias": (
        _document_causal_key_bias,
        (2, 40, 40, 2, 1, 16),
        False,
        lambda s: dict(key_bias=normal(40, (s[0], s[2]))),
    ),
    "sliding_window_block_mask": (_sliding_window_block_mask, (1, 45, 37, 2, 2, 16), False, lambda s: {}),
    "prefix_lm_query_scale_bias": (
        _prefix_lm_query_scale_bias,
        (2, 37, 37, 2, 2, 16),
        False,
        lambda s: dict(factor=1.0 + normal(41, (s[3], s[1]), 0.3), bias=normal(42, (1, s[3], 1, s[2]))),
    ),
    "empty_rows_dropout": (_empty_rows_dropout, (1, 37, 37, 2, 1, 16), False, lambda s: {}),
}


def _reference(q, k, v, params, *, build, shape, is_causal):
    """The dense float32 reference with the same programs and modifiers as `flash_attention(**build(...))`."""
    kwargs = build(params, shape)
    args = reference_mask_args(shape, kwargs, is_causal)
    for name in ("key_value_seq_lengths", "query_seq_lengths", "segment_ids", "kv_segment_ids"):
        kwargs.pop(name, None)
    for kind in ("score", "mask"):
        fn = kwargs.pop(f"{kind}_mod", None)
        if fn is not None:
            program, consts = mods.trace(fn, kind)
            args.update({f"{kind}_mod": program, f"{kind}_consts": consts})
    rng = kwargs.pop("dropout_rng", None)
    if rng is not None:
        kwargs["dropout_seed"] = masks.dropout_seed(rng)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return pf.attention_reference(*f32, scale=shape[-1] ** -0.5, **args, **kwargs)


def _ours(q, k, v, params, *, build, shape, is_causal, config):
    return pf.flash_attention(
        q, k, v, is_causal=is_causal, implementation="pallas", config=config, return_lse=True, **build(params, shape)
    )


def check_case(name, shape, dtype, config):
    """Output, LSE and the gradients of q, k, v and the case's float arrays against the reference; rows that
    see no key must be zeros with LSE -inf. Returns the [batch, q_len, heads] rows that see no key."""
    build, _, is_causal, make_params = CASES[name]
    q, k, v, cotangent = make_inputs(shape, dtype, seed=3)
    params = make_params(shape)
    case = dict(build=build, shape=shape, is_causal=is_causal)
    ours, ref = functools.partial(_ours, config=config, **case), functools.partial(_reference, **case)
    primals = (q, k, v, params)
    (out, lse), grads, (ref_out, ref_lse), ref_grads = _outputs_and_grads(ours, ref, primals, primals, cotangent)
    empty = _check_rows_and_lse(out, lse, ref_out, ref_lse, dtype)
    for what, g, r in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
        assert_close(g, r, dtype, table=GRADIENT, what=what)
    for key in params:
        assert_close(grads[3][key], ref_grads[3][key], dtype, table=GRADIENT, what=f"d{key}")
    return empty


@pytest.mark.parametrize("name", list(CASES))
def test_mods_against_reference(name):
    shape = CASES[name][1]
    empty = check_case(name, shape, jnp.float32, SMALL_BLOCKS)
    assert empty.any() == (name in ("empty_rows_dropout", "sliding_window_block_mask"))


def test_mask_mod_visit_tables_are_sound():
    """The device-side tables skip only blocks where nothing is visible and leave the token mask (and the
    mask_mod) off only where everything is: checked against the dense visibility, with a band, segment-free
    ragged lengths and per-example documents."""
    batch, q_len, kv_len, heads, block_q, block_kv = 2, 70, 90, 1, 16, 32
    docs = packed_segment_ids(batch, kv_len, [(70,), (20, 50)])
    mask_mod = mods.and_masks(mods.document(docs[:, :q_len], docs), mods.sliding_window(60, None))
    program, consts = mods.trace(mask_mod, "mask")
    band = masks.Band(None, 5)
    q_pad, kv_pad = 80, 96
    classes = portable._mask_mod_classes(
        masks.ScoreMods(mask_mod=program),
        masks.ModArrays(mask_consts=consts),
        batch=batch,
        heads=heads,
        q_len=q_len,
        kv_len=kv_len,
        block_q=16,
        block_kv=16,
    )
    kind = portable._tile_kinds(
        classes, None, block_q=block_q, block_kv=block_kv, q_pad=q_pad, kv_pad=kv_pad, kv_len=kv_len, band=band,
        has_segments=False,
    )  # fmt: skip
    kind = np.asarray(kind)
    qi, ki = np.arange(q_pad)[:, None], np.arange(kv_pad)[None, :]
    for b in range(batch):
        seen = np.asarray(program.apply(consts, b, 0, np.minimum(qi, q_len - 1), ki))
        seen = seen & (ki <= qi + 5) & (ki < kv_len)
        real = np.broadcast_to(qi < q_len, seen.shape)
        tiles = lambda x: x.reshape(q_pad // block_q, block_q, kv_pad // block_kv, block_kv).swapaxes(1, 2)
        some = (tiles(seen) & tiles(real)).any(axis=(2, 3))
        every = (tiles(seen) | ~tiles(real)).all(axis=(2, 3))
        np.testing.assert_array_equal(kind[b, 0] > 0, some)  # exact here: no block is visited for nothing
        assert np.all(every[kind[b, 0] == 2]), "a tile left unmasked hides something"
    assert (kind == 0).any() and (kind == 2).any() and (kind == 1).any()
    table = np.asarray(portable._table(jnp.asarray(kind)))
    for b, row in np.ndindex(batch, q_pad // block_q):
        n_full, n_visits = table[b, 0, row, :VISITS_HEADER]
        listed = table[b, 0, row, VISITS_HEADER : VISITS_HEADER + n_visits]
        np.testing.assert_array_equal(listed[:n_full], np.flatnonzero(kind[b, 0, row] == 2))
        np.testing.assert_array_equal(listed[n_full:], np.flatnonzero(kind[b, 0, row] == 1))


def test_program_the_kernels_cannot_stage_is_refused_with_its_reason():
    """A table indexed by both positions (relative_position_bias) has no elementwise tile form: forcing the
    portable kernels says why, naming the argument."""
    q, k, v, _ = make_inputs((1, 16, 16, 2, 2, 16), jnp.float32, seed=0)
    with pytest.raises(ValueError, match="score_mod: its .* depends on both q_idx and kv_idx"):
        pf.flash_attention(q, k, v, score_mod=mods.relative_position_bias(normal(1, (2, 9))), implementation="pallas")


@pytest.mark.lowering
@pytest.mark.skipif(TritonCompilerParams is None, reason="this JAX has no Pallas Triton lowering")
def test_mod_kernels_lower_to_triton_for_cuda():
    """Forward, dK/dV (with per-key value gradients), dQ (per-query value gradients) and dbias (through the
    score_mod's vjp) with a score_mod closing over float arrays and a document + causal mask_mod, lowered
    for CUDA on this machine."""
    batch, q_len, kv_len, heads, kv_heads, head_dim = 2, 256, 200, 4, 2, 64
    docs = jnp.asarray(np.repeat(np.arange(4), 64)[None].repeat(batch, 0), jnp.int32)
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
    slopes = jax.ShapeDtypeStruct((heads,), jnp.float32)
    table = jax.ShapeDtypeStruct((heads, kv_len), jnp.float32)
    bias = jax.ShapeDtypeStruct((1, heads, 1, kv_len), jnp.float32)

    def fwd_bwd(q, k, v, slopes, table, bias):
        score_mod = mods.chain(mods.alibi(slopes), lambda s, b, h, qi, ki: s * slopes[h] + table[h, ki])
        mask_mod = mods.and_masks(mods.document(docs, docs[:, :kv_len]), mods.causal())
        (score, score_consts), (mask, mask_consts) = mods.trace(score_mod, "score"), mods.trace(mask_mod, "mask")

        def fn(q, k, v, score_consts, bias):  # the kernels' own entry: flash_attention would pick interpret mode
            return portable.flash_attention_portable(
                q, k, v, scale=0.1, band=masks.Band(), config=pf.KernelConfig.default(head_dim), interpret=False,
                mods=masks.ScoreMods(bias_dims=(False, True, False, True), score_mod=score, mask_mod=mask),
                mod_arrays=masks.ModArrays(bias=bias, score_consts=score_consts, mask_consts=mask_consts),
            )  # fmt: skip

        out, vjp = jax.vjp(fn, q, k, v, score_consts, bias)
        return vjp(out)

    triton = "__gpu$xla.gpu.triton"
    with _compat.lowering_gpu():
        exported = jax.export.export(
            jax.jit(fwd_bwd), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)]
        )(q, k, k, slopes, table, bias)
    assert exported.mlir_module().count(f"stablehlo.custom_call @{triton}") == 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["alibi_soft_cap_causal", "document_causal_key_bias", "prefix_lm_query_scale_bias"])
def test_gpu_mods_default_blocks(name, dtype):
    """The compiled kernels with their default tiles at a realistic size, against the reference."""
    check_case(name, (2, 1000, 1000, 4, 2, 64), dtype, config=None)
