"""The model zoo: flash and dense attention give the same logits and parameter gradients from the same
parameters; parameters do not depend on the attention choice; a step runs under jit, grad and vmap."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from models import encoder, gpt, vit
from models.transformer import TransformerConfig
from pallas_flash import parallel
from pallas_flash.flax import attention_fn
from tests.tolerances import GRADIENT, OUTPUT

BATCH, SEQ = 2, 24


def _tokens(vocab, seed=0):
    return jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 0, vocab)


def _lengths_mask():
    # The second sequence is padding past position 13: no token may attend to it.
    return jnp.arange(SEQ)[None, :] < jnp.array([[SEQ], [13]])


# A one-layer encoder and ViT (GELU, LayerNorm, MHA) keep compile times small; GPT keeps the tiny preset's
# two layers (SwiGLU, RMSNorm, GQA), so gradients also flow through flash into an earlier layer.
ONE_LAYER = dict(num_layers=1, mlp="gelu", norm="layernorm")
CASES = {  # name -> (model class, config, make inputs)
    "gpt": (gpt.GPT, gpt.PRESETS["tiny"], lambda: (_tokens(256),)),
    "encoder_padded": (
        encoder.Encoder,
        dataclasses.replace(encoder.PRESETS["tiny"], **ONE_LAYER),
        lambda: (_tokens(256), _lengths_mask()),
    ),
    "vit": (
        vit.ViT,
        dataclasses.replace(vit.PRESETS["tiny"], **ONE_LAYER),
        lambda: (jax.random.normal(jax.random.key(3), (BATCH, 16, 16, 3)),),
    ),
}


def _build(cls, cfg, attention, dtype="float32", **overrides):
    cfg = dataclasses.replace(
        cfg, attention=attention, attention_implementation="xla_chunked", dtype=dtype, **overrides
    )
    return cls(cfg, rngs=nnx.Rngs(params=0, dropout=1))


@nnx.jit(static_argnames=("deterministic",))
def _forward(model, *inputs, deterministic=True):
    return model(*inputs, deterministic=deterministic)


def _loss_and_grads(model, inputs):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(*inputs)
        # A fixed random probe of the log-probabilities: every logit gets a gradient of order one.
        probe = jax.random.normal(jax.random.key(7), logits.shape)
        return jnp.sum(jax.nn.log_softmax(logits) * probe), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, grads


def _relative(ours, ref) -> float:
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)])
    ours, ref = flat(ours), flat(ref)
    assert np.all(np.isfinite(ours)), "non-finite values"
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


# ViT's gradients are `slow`: its forward through flash is checked against dense in
# test_parameters_do_not_depend_on_attention, and gradients through flash in the other models.
@pytest.mark.parametrize(
    "case, dtype",
    [
        ("encoder_padded", "float32"),
        ("gpt", "float32"),
        ("gpt", "bfloat16"),
        pytest.param("vit", "float32", marks=pytest.mark.slow),
    ],
)
def test_flash_matches_dense(case, dtype):
    cls, cfg, make_inputs = CASES[case]
    inputs = make_inputs()
    logits_f, grads_f = _loss_and_grads(_build(cls, cfg, "flash", dtype), inputs)
    logits_d, grads_d = _loss_and_grads(_build(cls, cfg, "dense", dtype), inputs)
    # Low-precision models compound the attention tolerance over their layers; flash and dense must
    # still agree far better than either agrees with a different model.
    key = jnp.dtype(dtype).type
    assert logits_f.dtype == jnp.float32
    assert _relative(logits_f, logits_d) <= OUTPUT[key] * 2, "logits"
    assert _relative(grads_f, grads_d) <= GRADIENT[key] * 2, "parameter gradients"


@pytest.mark.parametrize("lookup", ["one_hot", "gather"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_lookup_is_the_tables_rows(lookup, dtype, monkeypatch):
    """Both lookups give exactly nnx.Embed's rows, and the table's gradient sums each token's cotangents."""
    from models import transformer

    if lookup == "gather":
        monkeypatch.setattr(transformer, "ONE_HOT_MAX_VOCAB", 0)
    model = _build(gpt.GPT, gpt.PRESETS["tiny"], "flash", dtype)
    tokens = _tokens(7)  # 48 tokens over 7 ids: every row repeats
    ours = model.embed_tokens(tokens)
    assert ours.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(model.embed(tokens), np.float32))
    table = model.embed.embedding[...]
    cotangent = jax.random.normal(jax.random.key(2), ours.shape)
    got = jax.grad(lambda t: jnp.sum(transformer.lookup_rows(t, tokens, jnp.dtype(dtype)) * cotangent))(table)
    expected = np.zeros(table.shape)
    np.add.at(
        expected,
        np.asarray(tokens).ravel(),
        np.asarray(cotangent.astype(dtype), np.float64).reshape(-1, table.shape[1]),
    )
    assert np.abs(np.asarray(got, np.float64)[7:]).max() == 0.0, "rows of unused tokens got a gradient"
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=1e-5, atol=1e-5)


def test_value_heads_of_their_own_width():
    """Value heads wider than the query/key heads (as MLA's differ): the flash model's logits and gradients are
    the dense float32 reference's (flash_attention's "xla"); Flax's dense attention, which takes one head_dim, is
    refused by name."""
    cfg = dataclasses.replace(gpt.PRESETS["tiny"], value_head_dim=32)  # head_dim 16
    inputs = (_tokens(256),)
    models = [
        gpt.GPT(dataclasses.replace(cfg, attention_implementation=impl), rngs=nnx.Rngs(0))
        for impl in ("xla_chunked", "xla")
    ]
    (logits, grads), (ref_logits, ref_grads) = (_loss_and_grads(m, inputs) for m in models)
    assert models[0].stack.blocks[0].attention.value.kernel.shape == (64, 2 * 32)  # kv_heads * value_head_dim
    assert _relative(logits, ref_logits) <= OUTPUT[jnp.float32] and _relative(grads, ref_grads) <= GRADIENT[jnp.float32]
    with pytest.raises(ValueError, match="value_head_dim 32 differs from head_dim 16"):
        dataclasses.replace(cfg, attention="dense")


def test_padding_is_hidden():
    """Changing padded tokens changes nothing at real positions (so the mask reaches the attention)."""
    _, cfg, _ = CASES["encoder_padded"]
    model = _build(encoder.Encoder, cfg, "flash")
    tokens, mask = _tokens(256), _lengths_mask()
    other = jnp.where(mask, tokens, (tokens + 1) % 256)
    a, b = _forward(model, tokens, mask), _forward(model, other, mask)
    np.testing.assert_allclose(a[1, :13], b[1, :13], rtol=1e-5, atol=1e-5)
    assert not np.allclose(_forward(model, other)[1, :13], a[1, :13], atol=1e-3), "unmasked run should differ"


def test_gpt_is_causal():
    """Changing a future token changes nothing before it."""
    model = _build(gpt.GPT, gpt.PRESETS["tiny"], "flash")
    tokens = _tokens(256)
    other = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    a, b = _forward(model, tokens), _forward(model, other)
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 10:], b[:, 10:], atol=1e-3)


@pytest.mark.parametrize("case", ["gpt", "encoder_padded", "vit"])
def test_parameters_do_not_depend_on_attention(case):
    cls, cfg, make_inputs = CASES[case]
    states = [nnx.state(_build(cls, cfg, attention), nnx.Param) for attention in ("flash", "dense", attention_fn)]
    for state in states[1:]:
        assert jax.tree.structure(state) == jax.tree.structure(states[0])
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(states[0])):
            np.testing.assert_array_equal(a, b)
    # One checkpoint runs with either: load flash's parameters into a dense model built from another seed.
    dense = cls(dataclasses.replace(cfg, attention="dense"), rngs=nnx.Rngs(5))
    nnx.update(dense, states[0])
    flash = _build(cls, cfg, "flash")
    np.testing.assert_allclose(_forward(dense, *make_inputs()), _forward(flash, *make_inputs()), rtol=1e-4, atol=1e-5)


def test_callable_attention_and_dropout():
    """A callable attention runs; residual dropout draws the same masks whatever the attention."""
    cfg = dataclasses.replace(gpt.PRESETS["tiny"], dropout_rate=0.2)
    tokens = _tokens(256)
    runs = {name: _forward(_build(gpt.GPT, cfg, name), tokens, deterministic=False) for name in ("flash", "dense")}
    runs["callable"] = _forward(_build(gpt.GPT, cfg, attention_fn), tokens, deterministic=False)
    np.testing.assert_allclose(runs["flash"], runs["dense"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(runs["callable"], runs["dense"], rtol=1e-4, atol=1e-5)
    quiet = _forward(_build(gpt.GPT, cfg, "flash"), tokens, deterministic=True)
    assert not np.allclose(runs["flash"], quiet, atol=1e-3), "dropout had no effect"


def test_remat_changes_nothing():
    """Rematerialised blocks give the same gradients, with dropout over two steps (so the RNG state
    advances through the checkpoint)."""
    cfg = dataclasses.replace(gpt.PRESETS["tiny"], dropout_rate=0.1)
    tokens = _tokens(256)

    @nnx.jit
    def step(model):
        return nnx.grad(lambda model: jnp.sum(model(tokens, deterministic=False) ** 2))(model)

    grads = {}
    for remat in (False, True):
        model = _build(gpt.GPT, cfg, "flash", remat=remat)
        grads[remat] = [step(model), step(model)]
    assert _relative(grads[True], grads[False]) <= 1e-5
    assert _relative(grads[True][0], grads[True][1]) > 1e-2, "the second step should draw new dropout masks"


def test_per_example_gradients_under_vmap():
    """vmap(grad) of a tiny (rematerialised) GPT's loss under jit: each example's gradient equals that
    example's gradient computed alone."""
    model = _build(gpt.GPT, gpt.PRESETS["tiny"], "flash", remat=True)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = _tokens(256)

    def loss(params, tokens):  # tokens [batch, seq]
        logits = nnx.merge(graphdef, params, rest)(tokens)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.sum(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(params, tokens[:, None, :])
    grad = jax.jit(jax.grad(loss))
    for i in range(BATCH):
        alone = grad(params, tokens[i : i + 1])
        assert _relative(jax.tree.map(lambda g: g[i], per_example), alone) <= 1e-5
    assert _relative(jax.tree.map(lambda g: g[0], per_example), jax.tree.map(lambda g: g[1], per_example)) > 0.1


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_heads", 3, "multiple of it"),
        ("num_kv_heads", 3, "multiple of it"),
        ("embed_dim", 0, "positive int"),
        ("norm", "batchnorm", "norm must be"),
        ("mlp", "relu", "mlp must be"),
        ("attention", "sparse", "attention must be"),
        ("attention_implementation", "cuda", "attention_implementation"),
        ("dtype", "float64", "dtype must be"),
        ("dropout_rate", 1.0, "dropout_rate"),
        ("deterministic_gradients", "no", "deterministic_gradients must be a bool"),
        ("context_layout", "striped", "context_layout must be one of"),
    ],
)
@pytest.mark.parametrize("config_cls", [TransformerConfig, gpt.GPTConfig, encoder.EncoderConfig, vit.ViTConfig])
def test_config_errors(config_cls, field, value, match):
    with pytest.raises(ValueError, match=match):
        config_cls(**{field: value})


def test_zigzag_needs_flash():
    with pytest.raises(ValueError, match="context_layout 'zigzag' needs attention='flash'"):
        gpt.GPTConfig(attention="dense", context_layout="zigzag")


@pytest.mark.parametrize(  # zig-zag `slow` for CI time: the trainer's mesh test trains it to one device's losses
    "layout", [pytest.param("zigzag", marks=pytest.mark.slow), "contiguous"]
)
def test_a_mesh_computes_the_logits_of_one_device(layout):
    """On a (data 1, context 2) mesh the ring serves attention; with the zig-zag layout the model takes its
    tokens permuted (`parallel.zigzag_order`), rotates them at their global positions and returns logits in the
    same order: the one-device logits, permuted."""
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "context"))
    config = gpt.PRESETS["tiny"]
    one = gpt.GPT(config, rngs=nnx.Rngs(0))
    sharded = gpt.GPT(dataclasses.replace(config, mesh=mesh, context_layout=layout), rngs=nnx.Rngs(0))
    tokens = _tokens(256)
    order = parallel.zigzag_order(SEQ, 2) if layout == "zigzag" else np.arange(SEQ)
    want = one(tokens)[:, order]
    got = sharded(tokens[:, order])
    assert _relative(got, want) <= OUTPUT[jnp.float32]
    if layout == "zigzag":  # the KV cache's natural order would be read as zig-zag order: refused
        with pytest.raises(ValueError, match="KV cache keeps tokens in natural order"):
            sharded.prefill(tokens, jnp.full((BATCH,), SEQ), sharded.init_cache(BATCH, SEQ))


@pytest.mark.parametrize(
    "config_cls, field, value",
    [
        (gpt.GPTConfig, "vocab_size", 0),
        (encoder.EncoderConfig, "max_seq_len", -1),
        (vit.ViTConfig, "patch_size", 5),
    ],
)
def test_model_config_errors(config_cls, field, value):
    with pytest.raises(ValueError, match=field):
        config_cls(**{field: value})


@pytest.mark.parametrize(
    "presets, base", [(gpt.PRESETS, "gpt2_small"), (encoder.PRESETS, "bert_base"), (vit.PRESETS, "vit_base")]
)
def test_presets(presets, base):
    assert {"tiny", "small", base} <= set(presets)
    assert (presets[base].num_layers, presets[base].embed_dim, presets[base].num_heads) == (12, 768, 12)
    assert presets["tiny"].embed_dim <= 64


@pytest.mark.parametrize("deterministic_gradients", [True, False])
def test_flash_attention_fn_passes_deterministic_gradients(monkeypatch, deterministic_gradients):
    """`deterministic_gradients` reaches `flash_attention` as `deterministic`, with the implementation."""
    from pallas_flash import flax as pf_flax

    seen = {}
    original = pf_flax.flash_attention

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(pf_flax, "flash_attention", recording)
    cfg = dataclasses.replace(
        gpt.PRESETS["tiny"], deterministic_gradients=deterministic_gradients, attention_implementation="xla_chunked"
    )
    x = jnp.ones((1, 8, 2, cfg.head_dim), jnp.float32)
    cfg.attention_fn()(x, x, x)
    assert seen["deterministic"] is deterministic_gradients and seen["implementation"] == "xla_chunked"
