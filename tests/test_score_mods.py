"""Score modifiers (bias, mask, ALiBi, logit soft cap, dropout) in every implementation, forward and backward,
against the float32 dense reference given the same modifiers (and, for dropout, the same keep mask)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import masks
from pallas_flash._compat import TritonCompilerParams
from pallas_flash.kernels import portable
from tests.conftest import has_nvidia_gpu
from tests.test_attention import SMALL_BLOCKS, make_inputs
from tests.tolerances import GRADIENT, assert_close

IMPLEMENTATIONS = ["pallas", "xla_chunked"]
SHAPE = (2, 37, 45, 4, 2, 16)  # GQA, lengths that are not block multiples (3 query and key blocks of 16)


def _normal(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _random_mask(seed, shape, hide=0.3):
    return jax.random.uniform(jax.random.key(seed), shape) > hide


def _case(name, shape):
    """Keyword arguments of flash_attention for a named case, with arrays for `shape`."""
    batch, q_len, kv_len, heads, _, _ = shape
    rows_hidden = _random_mask(21, (batch, 1, q_len, kv_len)).at[:, :, 3, :].set(False)  # query 3 sees nothing
    minus_inf_row = _normal(22, (batch, heads, q_len, kv_len)).at[1, :, 5, :].set(-jnp.inf)
    return {
        "bias_full": dict(bias=_normal(23, (batch, heads, q_len, kv_len))),
        "bias_heads_keys": dict(bias=_normal(24, (1, heads, 1, kv_len), 2.0)),
        "bias_batch_queries": dict(bias=_normal(25, (batch, 1, q_len, 1), 2.0)),
        "bias_rank2_bf16": dict(bias=_normal(26, (q_len, kv_len)).astype(jnp.bfloat16)),
        "bias_minus_inf_rows": dict(bias=minus_inf_row),
        "mask_empty_rows": dict(mask=rows_hidden),
        "mask_keys": dict(mask=_random_mask(27, (batch, 1, 1, kv_len), 0.5)),
        "alibi": dict(alibi_slopes=jnp.geomspace(0.5, 0.05, heads)),
        "alibi_per_example_soft_cap": dict(alibi_slopes=_normal(28, (batch, heads), 0.1) ** 2, logits_soft_cap=1.5),
        "soft_cap": dict(logits_soft_cap=0.7),
        "dropout": dict(dropout_rate=0.3, dropout_rng=jax.random.key(29)),
        "dropout_broadcast": dict(dropout_rate=0.5, dropout_rng=jax.random.key(30), broadcast_dropout=True),
        "everything": dict(bias=_normal(31, (1, heads, q_len, kv_len)), mask=rows_hidden,
                           alibi_slopes=jnp.geomspace(0.5, 0.05, heads), logits_soft_cap=2.0, dropout_rate=0.2,
                           dropout_rng=jax.random.key(32)),
    }[name]


def _reference_kwargs(kwargs):
    """flash_attention's modifier arguments in the reference's terms (the seed instead of the key)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    rng = kwargs.pop("dropout_rng", None)
    if rng is not None:
        kwargs["dropout_seed"] = masks.dropout_seed(rng)
    return kwargs


def check_against_reference(impl, shape, dtype, is_causal, kwargs, config, seed=0):
    """Outputs, LSE, dq/dk/dv and (with a bias) dbias of `impl` against the reference with the same
    modifiers; rows that see no key must give zeros and LSE -inf, and every gradient must be finite."""
    q, k, v, cotangent = make_inputs(shape, dtype, seed)
    bias = kwargs.get("bias")
    rest = {name: value for name, value in kwargs.items() if name != "bias"}
    scale = shape[-1] ** -0.5

    def ours(q, k, v, bias):
        return pf.flash_attention(q, k, v, bias=bias, is_causal=is_causal, implementation=impl, config=config,
                                  return_lse=True, **rest)

    def ref(q, k, v, bias):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return pf.attention_reference(*f32, scale=scale, is_causal=is_causal, bias=bias,
                                      **_reference_kwargs(rest))

    out, lse = ours(q, k, v, bias)
    ref_out, ref_lse = ref(q, k, v, bias)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, ref_out, dtype)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(np.asarray(ref_lse))
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")
    empty = np.asarray(np.isneginf(ref_lse)).transpose(0, 2, 1)  # [batch, q_len, heads]
    assert np.all(np.asarray(out)[empty] == 0.0), "rows that see no key must be zeros"

    def loss(fn, q, k, v, bias):
        return jnp.sum(fn(q, k, v, bias)[0].astype(jnp.float32) * cotangent.astype(jnp.float32))

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    grads = jax.grad(functools.partial(loss, ours), argnums=argnums)(q, k, v, bias)
    ref_grads = jax.grad(functools.partial(loss, ref), argnums=argnums)(q, k, v, bias)
    for name, g, rg in zip(["dq", "dk", "dv", "dbias"], grads, ref_grads):
        assert g.shape == rg.shape, name
        if name == "dbias":
            assert g.dtype == bias.dtype
        assert_close(g, rg, dtype, table=GRADIENT, what=name)
    return empty


# (case, is_causal): every modifier once, causal and not, in CI time; the slow grid takes every combination.
# A bias that spans everything gets one batch element: its dbias kernel runs a program per bias tile, slow
# in interpret mode.
CI_CASES = [("bias_full", False), ("bias_heads_keys", True), ("bias_batch_queries", False),
            ("bias_minus_inf_rows", True), ("mask_empty_rows", True), ("alibi_per_example_soft_cap", True),
            ("dropout", False), ("everything", True)]
CI_SHAPES = {"bias_full": (1, 37, 45, 2, 1, 16)}
ALL_CASES = ["bias_full", "bias_heads_keys", "bias_batch_queries", "bias_rank2_bf16", "bias_minus_inf_rows",
             "mask_empty_rows", "mask_keys", "alibi", "alibi_per_example_soft_cap", "soft_cap", "dropout",
             "dropout_broadcast", "everything"]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case, is_causal", CI_CASES, ids=lambda x: str(x))
def test_modifier_against_reference(case, is_causal, impl):
    shape = CI_SHAPES.get(case, SHAPE)
    empty = check_against_reference(impl, shape, jnp.float32, is_causal, _case(case, shape), SMALL_BLOCKS)
    if case in ("mask_empty_rows", "bias_minus_inf_rows", "everything"):
        assert empty.any(), "this case is meant to contain fully masked rows"


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", ALL_CASES)
@pytest.mark.parametrize("shape", [SHAPE, (1, 50, 23, 3, 1, 32), (2, 1, 33, 2, 2, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_modifier_grid(shape, case, is_causal, impl):
    check_against_reference(impl, shape, jnp.float32, is_causal, _case(case, shape), SMALL_BLOCKS)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_modifiers_low_precision(impl):
    kwargs = dict(bias=_normal(40, (1, 4, 1, 45)), mask=_random_mask(41, (2, 1, 37, 45), 0.2),
                  logits_soft_cap=3.0, alibi_slopes=jnp.geomspace(0.3, 0.03, 4))
    check_against_reference(impl, SHAPE, jnp.bfloat16, True, kwargs, SMALL_BLOCKS, seed=1)


def test_bias_and_mask_semantics_match_jax_nn():
    """An independent oracle for bias and mask: jax.nn.dot_product_attention (rows that see some key)."""
    q, k, v, _ = make_inputs((2, 20, 20, 4, 2, 16), jnp.float32, seed=42)
    bias, mask = _normal(43, (1, 4, 20, 20)), _random_mask(44, (2, 1, 20, 20))
    ours = pf.flash_attention(q, k, v, bias=bias, mask=mask, is_causal=True, implementation="xla_chunked",
                              config=SMALL_BLOCKS)
    theirs = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=True, implementation="xla")
    seen = np.asarray(mask & jnp.tril(jnp.ones((20, 20), bool))).any(-1).transpose(0, 2, 1)  # [b, q, 1]
    rows = np.broadcast_to(seen, ours.shape[:3])
    assert_close(np.asarray(ours)[rows], np.asarray(theirs)[rows], jnp.float32)


# ---- dropout ------------------------------------------------------------------------------------------------

def _revealed_keep_mask(impl, config, rate, broadcast, rng):
    """Run attention on inputs that make the output the keep mask: all logits equal (q = 0), so
    p = 1 / kv_len, and v = identity rows, so out[b, i, h, j] = keep[b, h, i, j] / (1 - rate) / kv_len."""
    batch, q_len, heads, kv_len = 2, 20, 2, 32
    q = jnp.zeros((batch, q_len, heads, kv_len))
    v = jnp.broadcast_to(jnp.eye(kv_len)[None, :, None, :], (batch, kv_len, heads, kv_len))
    out = pf.flash_attention(q, q[:, :1].repeat(kv_len, 1), v, dropout_rate=rate, dropout_rng=rng,
                             broadcast_dropout=broadcast, implementation=impl, config=config)
    return np.asarray(out * (1 - rate) * kv_len).round().transpose(0, 2, 1, 3)  # [batch, heads, q, k]


@pytest.mark.parametrize("broadcast", [False, True])
def test_kernel_keep_mask_is_the_plain_jax_mask(broadcast):
    """Bit for bit, in the kernels with two tilings and in the XLA path."""
    rate, rng = 0.4, jax.random.key(50)
    b, h = (0, 0) if broadcast else (np.arange(2)[:, None, None, None], np.arange(2)[None, :, None, None])
    expected = masks.dropout_keep_mask(masks.dropout_seed(rng), b, h, np.arange(20)[:, None],
                                       np.arange(32)[None, :], rate)
    expected = np.broadcast_to(expected, (2, 2, 20, 32)).astype(np.float32)
    runs = [("pallas", SMALL_BLOCKS), ("pallas", pf.KernelConfig()), ("xla_chunked", SMALL_BLOCKS)]
    for impl, config in runs:
        np.testing.assert_array_equal(_revealed_keep_mask(impl, config, rate, broadcast, rng), expected,
                                      err_msg=f"{impl} {config.block_q}x{config.block_kv}")
    if not broadcast:  # each (batch, head) draws its own mask
        assert not np.array_equal(expected[0, 0], expected[1, 1])


def test_keep_mask_properties():
    seed = masks.dropout_seed(jax.random.key(51))
    pos = np.arange(512)
    for rate in (0.1, 0.5, 0.9):
        keep = masks.dropout_keep_mask(seed, 0, 0, pos[:, None], pos[None, :], rate)
        assert abs(float(keep.mean()) - (1 - rate)) < 5e-3, rate
    keep = masks.dropout_keep_mask(seed, 0, 0, pos[:, None], pos[None, :], 0.5)
    # No visible structure: rows, columns and the two halves of the key axis are uncorrelated.
    assert abs(float(jnp.corrcoef(keep[:-1].ravel(), keep[1:].ravel())[0, 1])) < 0.02
    assert abs(float(jnp.corrcoef(keep[:, :-1].ravel(), keep[:, 1:].ravel())[0, 1])) < 0.02
    other = masks.dropout_keep_mask(masks.dropout_seed(jax.random.key(52)), 0, 0, pos[:, None], pos[None, :], 0.5)
    assert 0.45 < float(jnp.mean(keep == other)) < 0.55
    # Raw uint32 key data and the typed key give the same seed.
    np.testing.assert_array_equal(masks.dropout_seed(jax.random.PRNGKey(3)), masks.dropout_seed(jax.random.key(3)))


def test_dropout_expectation_is_no_dropout():
    """Averaged over seeds, dropout's output is the no-dropout output (kept weights are scaled by 1/(1-rate))."""
    q, k, v, _ = make_inputs((1, 24, 24, 2, 2, 16), jnp.float32, seed=53)
    attend = functools.partial(pf.flash_attention, q, k, v, is_causal=True, implementation="xla_chunked",
                               config=SMALL_BLOCKS)
    plain = attend()
    seeds = jax.random.split(jax.random.key(54), 2000)
    mean = jnp.mean(jax.vmap(lambda rng: attend(dropout_rate=0.3, dropout_rng=rng))(seeds), axis=0)
    single = attend(dropout_rate=0.3, dropout_rng=seeds[0])
    # The mean of 2000 draws is ~45x closer than one draw (sqrt(2000)); ask for 10x.
    assert float(jnp.linalg.norm(mean - plain)) < 0.1 * float(jnp.linalg.norm(single - plain))


def test_dropout_lse_is_the_undropped_one():
    q, k, v, _ = make_inputs((1, 20, 30, 2, 1, 16), jnp.float32, seed=55)
    _, lse = pf.flash_attention(q, k, v, return_lse=True, implementation="pallas", config=SMALL_BLOCKS)
    _, lse_dropped = pf.flash_attention(q, k, v, return_lse=True, implementation="pallas", config=SMALL_BLOCKS,
                                        dropout_rate=0.5, dropout_rng=jax.random.key(0))
    # Not bit-equal: the modifier path scales the logits in two multiplies (scale, then log2(e)).
    np.testing.assert_allclose(lse, lse_dropped, rtol=1e-6)


# ---- the dbias kernel is dropped when unused ------------------------------------------------------------------

def _while_loops(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text().count(" while(")


@pytest.mark.skipif(has_nvidia_gpu(), reason="counts interpret mode's while loops; compiled kernels are custom calls")
def test_dbias_kernel_is_dead_code_without_a_bias_cotangent():
    """In interpret mode each pallas_call is a while loop over its grid: differentiating only in q must
    compile one loop fewer than differentiating in q and the bias."""
    q, k, v, _ = make_inputs((1, 20, 20, 2, 2, 16), jnp.float32, seed=56)
    bias = _normal(57, (1, 2, 20, 20))

    def loss(q, bias):
        return jnp.sum(pf.flash_attention(q, k, v, bias=bias, implementation="pallas", config=SMALL_BLOCKS))

    only_q = _while_loops(jax.grad(loss, argnums=0), q, bias)
    with_bias = _while_loops(jax.grad(loss, argnums=(0, 1)), q, bias)
    assert only_q < with_bias, (only_q, with_bias)


# ---- argument checking ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    (dict(bias=jnp.zeros((2, 2, 8, 7))), ValueError, r"bias has shape \(2, 2, 8, 7\); it must broadcast"),
    (dict(bias=jnp.zeros((1, 2, 2, 8, 8))), ValueError, "bias must have rank <= 4"),
    (dict(bias=jnp.zeros((8, 8), jnp.int32)), TypeError, "bias must be a float array"),
    (dict(mask=jnp.ones((8, 8), jnp.float32)), TypeError, "mask must be a bool array"),
    (dict(mask=jnp.ones((3, 1, 8, 8), bool)), ValueError, "mask has shape"),
    (dict(alibi_slopes=jnp.ones((3,))), ValueError, r"alibi_slopes must have shape \(2,\) or \(2, 2\)"),
    (dict(alibi_slopes=jnp.ones((2,), jnp.int32)), TypeError, "alibi_slopes must be a float array"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be"),
    (dict(logits_soft_cap=jnp.float32(1.0)), ValueError, "logits_soft_cap must be"),
    (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError, r"dropout_rate must be a Python float in \[0, 1\)"),
    (dict(dropout_rate=0.1), ValueError, "needs dropout_rng"),
    (dict(dropout_rate=0.1, dropout_rng=jnp.zeros((3,), jnp.uint32)), TypeError, "dropout_rng must be"),
    (dict(broadcast_dropout=1), TypeError, "broadcast_dropout must be a bool"),
])
def test_bad_modifier_arguments_are_named(kwargs, error, words):
    q = jnp.ones((2, 8, 2, 16))
    with pytest.raises(error, match=words):
        pf.flash_attention(q, q, q, **kwargs)


@pytest.mark.parametrize("name, kwargs", [
    ("bias", dict(bias=jnp.zeros((32, 32)))), ("mask", dict(mask=jnp.ones((32, 32), bool))),
    ("alibi_slopes", dict(alibi_slopes=jnp.ones((2,)))), ("logits_soft_cap", dict(logits_soft_cap=5.0)),
    ("dropout", dict(dropout_rate=0.1, dropout_rng=jax.random.key(0))),
    ("block_mask", dict(block_mask=pf.BlockMask(np.array([[True, False], [True, True]]), 16, 16))),
], ids=lambda x: x if isinstance(x, str) else "")
def test_hopper_kernel_refuses_modifiers(name, kwargs, monkeypatch):
    """The Mosaic GPU forward has no modifiers and no block mask: forcing it raises and names each feature
    the call uses (and None dispatches such calls to 'pallas'). The Hopper check is faked so that the
    refusal is the features', not this machine's."""
    from pallas_flash.kernels import hopper
    monkeypatch.setattr(hopper, "on_hopper_gpu", lambda: True)
    q = jnp.ones((1, 32, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"implementation='mosaic' cannot serve.* no .*{name}"):
        pf.flash_attention(q, q, q, implementation="mosaic", **kwargs)


# ---- with a block mask ----------------------------------------------------------------------------------------

def _block_mask(shape):
    """A random per-head BlockMask of 16 x 16 blocks for `shape`, with a query block of head 0 that sees
    nothing and a key block of head 1 that nobody sees."""
    _, q_len, kv_len, heads, _, _ = shape
    nq, nk = -(-q_len // 16), -(-kv_len // 16)
    blocks = np.random.default_rng(70).random((1, heads, nq, nk)) < 0.6
    blocks[0, 0, 1, :] = False
    blocks[0, 1, :, 2] = False
    return pf.BlockMask(blocks, 16, 16)


def _block_mask_case(name, shape):
    batch, q_len, kv_len, heads, _, _ = shape
    return {
        # dbias sums dS over query blocks: the hidden tiles must add nothing
        "bias_heads_keys": dict(bias=_normal(71, (1, heads, 1, kv_len), 2.0)),
        "mask": dict(mask=_random_mask(72, (batch, 1, q_len, kv_len))),
        "dropout_bias": dict(dropout_rate=0.3, dropout_rng=jax.random.key(73),
                             bias=_normal(74, (batch, 1, q_len, 1))),
    }[name]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case, is_causal", [("bias_heads_keys", True), ("mask", False), ("dropout_bias", False)],
                         ids=lambda x: str(x))
def test_modifiers_with_block_mask(case, is_causal, impl):
    """A BlockMask and score modifiers in one call: outputs, LSE, dq/dk/dv and dbias against the reference
    given both (with dropout, the same keep mask)."""
    kwargs = dict(_block_mask_case(case, SHAPE), block_mask=_block_mask(SHAPE))
    empty = check_against_reference(impl, SHAPE, jnp.float32, is_causal, kwargs, SMALL_BLOCKS)
    assert empty.any(), "the block mask hides a whole query block of head 0"


@pytest.mark.skipif(TritonCompilerParams is None, reason="this JAX has no Pallas Triton lowering")
def test_kernels_with_modifiers_and_block_mask_lower_to_triton_for_cuda():
    """Forward, dK/dV, dQ and dbias with a bias, dropout and a per-head block mask, lowered for CUDA on this
    machine (Pallas's Triton lowering runs without a GPU), so that what it rejects fails in CI."""
    batch, q_len, kv_len, heads, kv_heads, head_dim = 2, 256, 200, 4, 2, 64
    block_mask = pf.BlockMask(np.random.default_rng(80).random((1, heads, 4, 4)) < 0.5, 64, 64)
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, heads, 1, kv_len), jnp.float32)
    mods = masks.ScoreMods(bias_dims=(False, True, False, True), dropout_rate=0.1)

    def fwd_bwd(q, k, v, bias):  # the kernels' own entry point: flash_attention would pick interpret mode here
        fn = lambda q, k, v, bias: portable.flash_attention_portable(
            q, k, v, scale=0.1, band=masks.Band.of(True), config=pf.KernelConfig.default(head_dim),
            interpret=False, block_mask=block_mask, mods=mods,
            mod_arrays=masks.ModArrays(bias=bias, dropout_seed=jnp.array([1, 2], jnp.uint32)))
        out, vjp = jax.vjp(fn, q, k, v, bias)
        return vjp(out)

    triton = "__gpu$xla.gpu.triton"
    exported = jax.export.export(jax.jit(fwd_bwd), platforms=["cuda"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(q, k, k, bias)
    assert exported.mlir_module().count(f"stablehlo.custom_call @{triton}") == 4


# ---- GPU: the compiled kernels at realistic sizes ---------------------------------------------------------------

def _gpu_case(name, shape):
    batch, q_len, kv_len, heads, _, _ = shape
    return {
        "bias_mask": dict(bias=_normal(60, (batch, heads, q_len, kv_len)),
                          mask=_random_mask(61, (batch, 1, q_len, kv_len), 0.2).at[:, :, 7, :].set(False)),
        "broadcast_bias_alibi_cap": dict(bias=_normal(62, (1, heads, 1, kv_len)), logits_soft_cap=5.0,
                                         alibi_slopes=jnp.geomspace(0.25, 0.004, heads)),
        "dropout_everything": dict(bias=_normal(63, (batch, 1, q_len, kv_len)), mask=_random_mask(64, (1, 1, 1, kv_len)),
                                   alibi_slopes=jnp.geomspace(0.25, 0.004, heads), logits_soft_cap=5.0,
                                   dropout_rate=0.1, dropout_rng=jax.random.key(65)),
    }[name]


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", ["bias_mask", "broadcast_bias_alibi_cap", "dropout_everything"])
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 4, 2, 64), (1, 2048, 1531, 4, 4, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_modifiers_default_blocks(shape, case, dtype, is_causal):
    check_against_reference("pallas", shape, dtype, is_causal, _gpu_case(case, shape), None, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_bias_shared_over_batch_head_dim_128(is_causal):
    """A bias shared by the batch ([1, heads, q, k]) makes the dbias kernel loop over the batch, and Triton
    pipelines that loop's Q, dO, K and V loads: at head_dim 128 its stages must fit shared memory."""
    shape = (2, 1024, 1024, 4, 4, 128)
    case = dict(bias=_normal(66, (1, shape[3], shape[1], shape[2])).astype(jnp.bfloat16))
    check_against_reference("pallas", shape, jnp.bfloat16, is_causal, case, None, seed=4)


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16, None])
@pytest.mark.parametrize("mask_spans_queries", [True, False])
def test_default_tiles_leave_room_for_bias_and_mask_tiles(bias_dtype, mask_spans_queries):
    """A bias or mask spanning queries and keys is streamed as a [block_q, block_kv] tile beside K and V; at
    head_dim 128 in bf16 the tuned tiles alone nearly fill an H100's shared memory, so the default config
    must shrink (Triton refused the unshrunk tiles with a float32 bias on the H100, 2026-11-23)."""
    batch, q_len, kv_len, heads = 1, 256, 256, 4
    q = jnp.zeros((batch, q_len, heads, 128), jnp.bfloat16)
    bias = None if bias_dtype is None else jnp.zeros((batch, heads, q_len, kv_len), bias_dtype)
    mask = jnp.ones((batch, 1, q_len if mask_spans_queries else 1, kv_len), bool)
    mods, mod_arrays = pf.api._score_mods(q, q, bias, mask, None, None, 0.0, None, False)
    tile_bytes = pf.api._score_tile_bytes(mods, mod_arrays)
    expected = ((0 if bias_dtype is None else jnp.dtype(bias_dtype).itemsize) + (1 if mask_spans_queries else 0))
    assert tile_bytes == expected
    config = pf.KernelConfig.default(128, 2, pf.config.H100_SHARED_MEMORY, tile_bytes)
    needed = config.shared_memory(128, 2, tile_bytes)
    assert max(needed.values()) <= pf.config.H100_SHARED_MEMORY
    if tile_bytes:
        assert config != pf.KernelConfig.default(128, 2)
