"""pallas_flash.flax: Flax's attention modules with our attention_fn match their default attention, every
argument is honoured, and a dense fallback is logged once naming the argument."""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import pallas_flash.flax as pf
from pallas_flash import KernelConfig, flash_attention
from tests.tolerances import GRADIENT, assert_close

BATCH, Q_LEN, KV_LEN, FEATURES, HEADS = 2, 16, 24, 32, 2  # head_dim 16, the kernels' smallest
FLASH = pf.make_attention_fn(implementation="xla_chunked")
CAUSAL_FLASH = pf.make_attention_fn(is_causal=True, implementation="xla_chunked")


@pytest.fixture(autouse=True)
def fresh_log_once(monkeypatch):
    monkeypatch.setattr(pf, "_logged", set())


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _mask(kind, q_len, kv_len):
    """A mask broadcastable to [batch, heads, q_len, kv_len], or None."""
    if kind == "none":
        return None
    if kind == "padding":  # key padding, as an encoder builds it: [batch, 1, 1, kv_len]
        return (jnp.arange(kv_len)[None, :] < jnp.array([[kv_len], [kv_len // 2]]))[:, None, None, :]
    if kind == "causal":
        return linen.make_causal_mask(jnp.zeros((BATCH, q_len)))
    # "random": [batch, heads, q_len, kv_len], about a third hidden, and query 3 sees no key at all.
    mask = jax.random.uniform(jax.random.key(9), (BATCH, HEADS, q_len, kv_len)) > 0.3
    return mask.at[:, :, 3, :].set(False)


def _inputs(kind, dtype):
    inputs_q = _normal(1, (BATCH, Q_LEN, FEATURES), dtype)
    inputs_kv = inputs_q if kind == "self" else _normal(2, (BATCH, KV_LEN, FEATURES), dtype)
    return inputs_q, inputs_kv


GRID = (
    [("self", m, "float32") for m in ("none", "padding", "causal", "random")]
    + [("cross", m, "float32") for m in ("none", "padding", "random")]
    + [("self", "none", "bfloat16"), ("self", "causal", "bfloat16"), ("cross", "padding", "bfloat16")]
)


@pytest.mark.parametrize("kind, mask_kind, dtype", GRID)
def test_linen_module_matches_default(kind, mask_kind, dtype):
    inputs_q, inputs_kv = _inputs(kind, dtype)
    mask = _mask(mask_kind, Q_LEN, inputs_kv.shape[1])
    # A causal mask goes to the factory that declared it; other masks are applied exactly as given.
    ours = CAUSAL_FLASH if mask_kind == "causal" else FLASH
    module = functools.partial(linen.MultiHeadDotProductAttention, num_heads=HEADS, qkv_features=FEATURES)
    params = module().init(jax.random.key(0), inputs_q, inputs_kv, mask=mask)
    # The reference is Flax's default attention in float32, on the same parameters.
    ref = module(dtype=jnp.float32).apply(
        params, inputs_q.astype(jnp.float32), inputs_kv.astype(jnp.float32), mask=mask
    )
    out = jax.jit(module(attention_fn=ours, dtype=dtype).apply)(params, inputs_q, inputs_kv, mask=mask)
    assert out.dtype == jnp.dtype(dtype)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("kind, mask_kind", [("self", "none"), ("self", "causal"), ("cross", "padding")])
def test_linen_module_gradients_match_default(kind, mask_kind):
    inputs_q, inputs_kv = _inputs(kind, jnp.float32)
    mask = _mask(mask_kind, Q_LEN, inputs_kv.shape[1])
    ours = CAUSAL_FLASH if mask_kind == "causal" else FLASH
    module = functools.partial(linen.MultiHeadDotProductAttention, num_heads=HEADS, qkv_features=FEATURES)
    params = module().init(jax.random.key(0), inputs_q, inputs_kv, mask=mask)
    probe = _normal(5, inputs_q.shape)

    def grads(attention_fn):
        loss = lambda p, q, kv: jnp.sum(module(attention_fn=attention_fn).apply(p, q, kv, mask=mask) * probe)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, inputs_q, inputs_kv)

    ref = grads(linen.dot_product_attention)
    for got, want in zip(jax.tree.leaves(grads(ours)), jax.tree.leaves(ref)):
        assert_close(got, want, jnp.float32, table=GRADIENT, what="gradient")


NNX_GRID = [
    ("self", "none", False),
    ("self", "padding", False),
    ("self", "none", True),
    ("self", "padding", True),
    ("cross", "none", False),
    ("cross", "random", False),
]


@pytest.mark.parametrize("kind, mask_kind, is_causal", NNX_GRID)
def test_nnx_module_matches_default(kind, mask_kind, is_causal):
    inputs_q, inputs_kv = _inputs(kind, jnp.float32)
    mask = _mask(mask_kind, Q_LEN, inputs_kv.shape[1])
    module = lambda attention_fn: nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=FEATURES, attention_fn=attention_fn, decode=False, rngs=nnx.Rngs(0)
    )
    call = lambda m: m(inputs_q, inputs_kv, mask=mask, is_causal=is_causal)
    ref = call(module(nnx.dot_product_attention))
    out = nnx.jit(call)(module(pf.attention_fn))
    assert_close(out, ref, jnp.float32)


@pytest.mark.parametrize("kv_heads, dtype", [(4, "float32"), (2, "float32"), (1, "bfloat16")])
def test_function_extra_batch_dims_gqa_bias_mask(kv_heads, dtype):
    """[batch1, batch2, seq, heads, head_dim] inputs, grouped-query heads, a bias and a mask together."""
    batch, heads, head_dim = (2, 3), 4, 16
    query = _normal(1, (*batch, Q_LEN, heads, head_dim), dtype)
    key = _normal(2, (*batch, KV_LEN, kv_heads, head_dim), dtype)
    value = _normal(3, (*batch, KV_LEN, kv_heads, head_dim), dtype)
    bias = _normal(4, (*batch, heads, Q_LEN, KV_LEN))
    mask = jax.random.uniform(jax.random.key(5), (*batch, 1, Q_LEN, KV_LEN)) > 0.2
    f32 = lambda x: x.astype(jnp.float32)
    for kwargs in ({}, {"bias": bias, "mask": mask}):
        ref = nnx.dot_product_attention(f32(query), f32(key), f32(value), **kwargs)
        out = jax.jit(pf.attention_fn)(query, key, value, **kwargs)
        assert out.shape == query.shape and out.dtype == jnp.dtype(dtype)
        assert_close(out, ref, dtype)


def test_value_head_dim_of_its_own_runs_in_the_kernels(caplog):
    """A value head_dim unlike query/key's (MLA-style: 32 and 16) goes to flash_attention, nothing logged, with
    Flax's result: out [batch, q_len, heads, head_dim_v]."""
    query, key = (_normal(i, (BATCH, Q_LEN, HEADS, 32)) for i in range(2))
    value = _normal(2, (BATCH, Q_LEN, HEADS, 16))
    mask = _mask("random", Q_LEN, Q_LEN)
    with caplog.at_level(logging.WARNING, logger="pallas_flash"):
        out = jax.jit(pf.attention_fn)(query, key, value, mask=mask)
    assert caplog.records == [] and out.shape == (BATCH, Q_LEN, HEADS, 16)
    # Flax's own attention takes one head_dim: the oracle is written out (hidden logits at the lowest float).
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, precision="highest") / np.sqrt(32)
    weights = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)
    assert_close(out, jnp.einsum("bhqk,bkhd->bqhd", weights, value, precision="highest"), jnp.float32)


@pytest.mark.parametrize("broadcast_dropout", [True, False])
def test_dropout_runs_in_the_kernels(broadcast_dropout, caplog):
    """Dropout is served by flash_attention (nothing logged), with its counter-based keep mask: the same as
    flash_attention's with the same key, not Flax's bernoulli draw (same distribution, other bits)."""
    query, key, value = (_normal(i, (BATCH, Q_LEN, HEADS, 16)) for i in range(3))
    mask = _mask("random", Q_LEN, Q_LEN)
    kwargs = dict(
        dropout_rng=jax.random.key(11), dropout_rate=0.4, broadcast_dropout=broadcast_dropout, deterministic=False
    )
    with caplog.at_level(logging.WARNING, logger="pallas_flash"):
        out = FLASH(query, key, value, mask=mask, **kwargs)
    assert caplog.records == []
    ours = flash_attention(
        query,
        key,
        value,
        mask=mask,
        dropout_rate=0.4,
        dropout_rng=jax.random.key(11),
        broadcast_dropout=broadcast_dropout,
        implementation="xla",
    )
    # Query 3 sees no key: Flax's uniform row (the mean of the values), undropped.
    ours = ours.at[:, 3].set(jnp.mean(value, axis=1))
    assert_close(out, ours, jnp.float32)
    no_dropout = FLASH(query, key, value, deterministic=True, dropout_rate=0.4)
    assert_close(no_dropout, linen.dot_product_attention(query, key, value), jnp.float32)
    assert not np.allclose(out, FLASH(query, key, value, mask=mask), atol=1e-3)
    if broadcast_dropout:  # one keep mask for every batch element and head: equal inputs, equal outputs
        same = jnp.broadcast_to(query[:1, :, :1], query.shape)
        shared = FLASH(same, same, same, **kwargs)
        np.testing.assert_allclose(shared[0, :, 0], shared[1, :, 1], rtol=1e-6)


def test_dropout_without_rng_is_an_error():
    query = _normal(0, (BATCH, Q_LEN, HEADS, 16))
    with pytest.raises(ValueError, match="dropout_rng"):
        pf.attention_fn(query, query, query, dropout_rate=0.1, deterministic=False)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_sown_attention_weights_match_default(api, caplog):
    inputs_q, _ = _inputs("self", jnp.float32)
    with caplog.at_level(logging.WARNING, logger="pallas_flash"):
        if api == "linen":
            module = lambda fn: linen.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=fn)
            params = module(FLASH).init(jax.random.key(0), inputs_q)
            sown = [
                module(fn).apply(params, inputs_q, sow_weights=True, mutable=["intermediates"])[1]
                for fn in (FLASH, linen.dot_product_attention)
            ]
        else:
            sown = []
            for fn in (FLASH, nnx.dot_product_attention):
                module = nnx.MultiHeadAttention(
                    num_heads=HEADS, in_features=FEATURES, attention_fn=fn, decode=False, rngs=nnx.Rngs(0)
                )
                # nnx.capture collects what `sow` stores (sowing outside it is deprecated in Flax).
                forward = nnx.capture(lambda module, x: module(x, sow_weights=True), nnx.Intermediate)
                sown.append(forward(module, inputs_q)[1])
    ours, ref = (jax.tree.leaves(s) for s in sown)
    assert len(ours) == len(ref) == 1 and ours[0].shape == (BATCH, HEADS, Q_LEN, Q_LEN)
    assert_close(ours[0], ref[0], jnp.float32)
    assert "`module`" in caplog.text


def test_custom_einsums_are_used():
    """linen's quantisation hook: custom einsums replace the matmuls, so they must actually run."""
    calls = []

    def einsum(*args, **kwargs):
        calls.append(args[0])
        return jnp.einsum(*args, **kwargs)

    query, key, value = (_normal(i, (BATCH, Q_LEN, HEADS, 16)) for i in range(3))
    out = pf.attention_fn(query, key, value, qk_attn_weights_einsum=einsum, attn_weights_value_einsum=einsum)
    assert len(calls) == 2
    assert_close(out, linen.dot_product_attention(query, key, value), jnp.float32)


def test_fallback_logs_once_naming_the_argument(caplog):
    query, key, value = (_normal(i, (BATCH, Q_LEN, HEADS, 16)) for i in range(3))
    mask = _mask("random", Q_LEN, Q_LEN)
    bias = _normal(4, (BATCH, HEADS, Q_LEN, Q_LEN))
    with caplog.at_level(logging.WARNING, logger="pallas_flash"):
        pf.attention_fn(query, key, value)
        pf.attention_fn(query, key, value, mask=mask, bias=bias)
        assert caplog.records == [], "masks and bias run in the kernels and must not log"
        for _ in range(3):
            pf.attention_fn(query[..., :8], key[..., :8], value[..., :8])  # head_dim 8: below the kernels' 16
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "head_dim" in messages[0]


def _compiled_hlo(attention_fn, seq):
    """The optimised HLO of a linen attention layer called with a make_causal_mask mask."""
    module = linen.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=attention_fn)
    x = _normal(1, (BATCH, seq, FEATURES))
    params = module.init(jax.random.key(0), x)

    def apply(params, x):
        return module.apply(params, x, mask=linen.make_causal_mask(x[..., 0]))

    return jax.jit(apply).lower(params, x).compile().as_text()


def test_factory_causal_mask_costs_no_quadratic_memory():
    """With make_attention_fn(is_causal=True) the [seq, seq] causal mask is never read, so XLA removes it:
    no array of the compiled layer has two seq-sized dimensions. The default attention_fn applies the
    same mask exactly, and does build such arrays."""
    seq = 48  # a size no other dimension here has (and 3x the key chunk)
    pattern = re.compile(rf"\b{seq},{seq}\]")
    chunked = KernelConfig(xla_block_kv=16)
    factory = pf.make_attention_fn(is_causal=True, implementation="xla_chunked", config=chunked)
    assert not pattern.search(_compiled_hlo(factory, seq))
    assert pattern.search(_compiled_hlo(pf.make_attention_fn(implementation="xla_chunked", config=chunked), seq))


@pytest.mark.parametrize("argument", ["is_causal", "deterministic_gradients"])
def test_factory_rejects_non_bools(argument):
    with pytest.raises(TypeError, match=f"{argument} must be a bool"):
        pf.make_attention_fn(**{argument: "yes"})


@pytest.mark.parametrize("deterministic_gradients", [True, False])
def test_factory_passes_deterministic_gradients(deterministic_gradients, monkeypatch):
    """Flax's own `deterministic` (dropout off) is not ours: `deterministic_gradients` is what reaches
    flash_attention's `deterministic`."""
    import pallas_flash.flax as adapter

    seen = []
    real = adapter.flash_attention
    monkeypatch.setattr(adapter, "flash_attention", lambda *a, **kw: seen.append(kw["deterministic"]) or real(*a, **kw))
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))
    fn = pf.make_attention_fn(implementation="xla_chunked", deterministic_gradients=deterministic_gradients)
    fn(q, q, q, deterministic=True)
    assert seen == [deterministic_gradients]


@pytest.mark.parametrize(
    "impl, is_causal",
    [
        ("xla_chunked", False),
        ("xla_chunked", True),
        ("pallas", True),
        pytest.param("pallas", False, marks=pytest.mark.slow),
    ],
)  # is_causal=True holds both kinds of empty rows
def test_key_padding_mask_runs_in_the_kernels(impl, is_causal, caplog):
    """A [batch, 1, 1, kv_len] key-padding mask is served by the kernels (no dense fallback is logged), with
    Flax's semantics kept for queries that see no key: example 1 has no valid key at all, and with
    is_causal example 2's first valid key is 5, so its queries 0-4 see none; both attend uniformly in Flax."""
    q = _normal(11, (3, 12, 4, 16))
    k, v = _normal(12, (3, 20, 2, 16)), _normal(13, (3, 20, 2, 16))
    valid = jnp.array([[True] * 14 + [False] * 6, [False] * 20, [False] * 5 + [True] * 15])
    mask = valid[:, None, None, :]
    fn = pf.make_attention_fn(
        implementation=impl,
        config=KernelConfig(block_q=16, block_kv=16, block_q_dkv=16, block_kv_dkv=16, block_q_dq=16, block_kv_dq=16),
    )
    with caplog.at_level(logging.WARNING, logger="pallas_flash"):
        out, grads = jax.value_and_grad(
            lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, mask=mask, is_causal=is_causal))), argnums=(0, 1, 2)
        )(q, k, v)
    assert "dense" not in caplog.text
    ref_fn = lambda q, k, v: jnp.sum(jnp.sin(nnx.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)))
    ref, ref_grads = jax.value_and_grad(ref_fn, argnums=(0, 1, 2))(q, k, v)
    assert_close(out, ref, jnp.float32)
    assert_close(
        fn(q, k, v, mask=mask, is_causal=is_causal),
        nnx.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal),
        jnp.float32,
    )
    for g, rg in zip(grads, ref_grads):
        assert_close(g, rg, jnp.float32, table=GRADIENT)


def test_factory_score_and_mask_mods_reach_the_kernels():
    """make_attention_fn(score_mod=, mask_mod=) inside nnx.MultiHeadAttention equals flash_attention called with the
    same programs on the module's projections; a call that must run densely refuses them, naming why."""
    from pallas_flash import mods

    slopes = jnp.asarray([0.5, 0.25])
    fn = pf.make_attention_fn(
        implementation="xla_chunked", score_mod=mods.alibi(slopes), mask_mod=mods.sliding_window(4, 0)
    )
    q, k, v = (_normal(i, (BATCH, Q_LEN, HEADS, 16)) for i in range(3))
    want = flash_attention(
        q, k, v, score_mod=mods.alibi(slopes), mask_mod=mods.sliding_window(4, 0), implementation="xla"
    )
    assert_close(fn(q, k, v), want, jnp.float32)
    module = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, attention_fn=fn, rngs=nnx.Rngs(0))
    assert module(_normal(1, (BATCH, Q_LEN, FEATURES))).shape == (BATCH, Q_LEN, FEATURES)
    with pytest.raises(ValueError, match="score_mod, mask_mod=...\\) needs the flash path"):
        fn(q, k, v, qk_attn_weights_einsum=functools.partial(jnp.einsum, "...qhd,...khd->...hqk"))
