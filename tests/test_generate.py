"""GPT with a KV cache: prefill and decode steps give the logits of the full forward pass; greedy generation
gives the tokens of recomputing full attention over the growing sequence, also after a prompt prefilled in
chunks and with pages allocated per sequence; sequences stop at an eos token; no recompilation within a
bucket; the cache is donated; `python -m train.sample` on a 2-step run's checkpoint."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import generate, kv_cache
from models.gpt import GPT, PRESETS, GPTConfig
from pallas_flash import decode
from pallas_flash.api import choose
from tests.tolerances import OUTPUT, relative_error


@pytest.fixture(scope="module")
def model():
    """The tiny preset (GQA 4:2, two layers) with parameters scaled up so that greedy decoding does not just
    repeat a token (at the default initialisation it does)."""
    model = GPT(PRESETS["tiny"], rngs=nnx.Rngs(params=0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(5)
    leaves = [
        jnp.asarray(rng.standard_normal(p.shape, np.float32) * (0.5 if p.ndim == 2 else 0.2) + (p.ndim == 1))
        for p in leaves
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)


def _full_forward(model):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)), state


PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]
STEPS = 12


@pytest.fixture(scope="module")
def greedy_without_cache(model):
    """Greedy decoding of each of PROMPTS by running the whole (causal) model over the growing sequence,
    padded to a fixed width (one compilation)."""
    forward, state = _full_forward(model)
    results = []
    for prompt in PROMPTS:
        tokens = np.zeros((1, 32), np.int32)
        tokens[0, : len(prompt)] = prompt
        for i in range(STEPS):
            logits = forward(state, jnp.asarray(tokens))[0, len(prompt) - 1 + i]
            tokens[0, len(prompt) + i] = int(jnp.argmax(logits))
        results.append(tokens[0, len(prompt) : len(prompt) + STEPS])
    return np.stack(results)


@pytest.mark.parametrize("page_size", [None, 4])
def test_greedy_generation_equals_recomputing_without_a_cache(model, greedy_without_cache, page_size):
    out = model.generate(PROMPTS, STEPS, temperature=0.0, page_size=page_size)  # ragged: padded and masked
    assert out.shape == (2, STEPS) and out.dtype == np.int32
    np.testing.assert_array_equal(out, greedy_without_cache)
    assert len(set(out[1].tolist())) > 3  # not a repeated token
    single = model.generate(np.array(PROMPTS[0]), STEPS, temperature=0.0, page_size=page_size)
    np.testing.assert_array_equal(single, out[0])


def test_prefill_and_a_speculative_decode_step_give_the_full_forward_logits(model):
    tokens = np.random.default_rng(0).integers(0, 256, (2, 20)).astype(np.int32)
    lengths = jnp.array([9, 14])
    full = _full_forward(model)[0](nnx.split(model)[1], jnp.asarray(tokens))

    @nnx.jit
    def run(model, prompts, chunk):
        logits, cache = model.prefill(prompts, lengths, model.init_cache(2, 32, page_size=8))
        chunk_logits, cache = model.decode_step(chunk, cache)  # 3 tokens per sequence at once (Tq = 3)
        return logits, chunk_logits, cache.lengths

    prompts = np.where(np.arange(16)[None] < np.asarray(lengths)[:, None], tokens[:, :16], 0)
    chunk = np.stack([tokens[0, 9:12], tokens[1, 14:17]])
    logits, chunk_logits, new_lengths = run(model, jnp.asarray(prompts), jnp.asarray(chunk))
    np.testing.assert_array_equal(new_lengths, [12, 17])
    want_last = np.stack([full[0, 8], full[1, 13]])
    want_chunk = np.stack([full[0, 9:12], full[1, 14:17]])
    assert relative_error(logits, want_last) <= OUTPUT[jnp.float32]
    assert relative_error(chunk_logits, want_chunk) <= OUTPUT[jnp.float32]


@pytest.mark.parametrize("page_size", [None, 4])
def test_generation_stops_at_the_eos_token(model, greedy_without_cache, page_size):
    eos = int(greedy_without_cache[1, 4])
    stops = [list(row).index(eos) + 1 if eos in row else STEPS for row in greedy_without_cache.tolist()]
    out, lengths = model.generate(PROMPTS, STEPS, temperature=0.0, page_size=page_size, eos_token=eos)
    np.testing.assert_array_equal(lengths, stops)
    for b, stop in enumerate(stops):
        np.testing.assert_array_equal(out[b, :stop], greedy_without_cache[b, :stop])
        assert (out[b, stop:] == eos).all()  # the padding after a stop
    single, length = model.generate(PROMPTS[1], STEPS, temperature=0.0, eos_token=eos)
    assert length == stops[1] and (single == out[1]).all()


@pytest.mark.parametrize("first, width, page_size", [(3, 8, None), (1, 32, 4)])  # 32: two flash_decode pieces
def test_greedy_generation_after_a_chunked_prefill(model, greedy_without_cache, first, width, page_size):
    """Each prompt's first `first` tokens are prefilled, the rest appended as one padded chunk of `width`."""
    lengths = np.array([len(p) for p in PROMPTS])
    head = np.zeros((2, 16), np.int32)
    chunk = np.zeros((2, width), np.int32)
    for b, prompt in enumerate(PROMPTS):
        head[b, :first], chunk[b, : len(prompt) - first] = prompt[:first], prompt[first:]
    graphdef, state = nnx.split(model)
    _, cache = generate.prefill(
        graphdef, state, jnp.asarray(head), jnp.full((2,), first), cache_len=64, page_size=page_size
    )
    extend = nnx.jit(lambda model, chunk, n, cache: model.extend(chunk, n, cache))
    logits, cache = extend(model, jnp.asarray(chunk), jnp.asarray(lengths - first), cache)
    np.testing.assert_array_equal(cache.lengths, lengths)
    out, _, _ = generate.decode(
        graphdef, state, cache, logits, jnp.int32(STEPS), jnp.float32(1.0), jax.random.key(0), greedy=True, top_k=None
    )
    np.testing.assert_array_equal(out[:, :STEPS], greedy_without_cache)


def test_pages_are_allocated_per_sequence(model):
    table, num_pages = kv_cache.allocate_pages([5, 11], 4, 32)
    np.testing.assert_array_equal(table, [[0, 1] + [-1] * 6, [2, 3, 4] + [-1] * 5])
    assert num_pages == 8  # 5 pages handed out, bucketed; a page per 4 of max_len tokens each would be 16
    graphdef, state = nnx.split(model)
    _, cache = generate.prefill(
        graphdef,
        state,
        jnp.ones((2, 16), jnp.int32),
        jnp.array([5, 11]),
        jnp.asarray(table),
        cache_len=32,
        page_size=4,
        num_pages=num_pages,
    )
    assert cache.layers[0].keys.shape[0] == num_pages
    # The prompts' padding past each sequence's pages (positions 8..15 and 12..15) is dropped, not written into
    # another page of the pool: only the 5 allocated pages (20 rows) hold keys.
    held = np.abs(np.asarray(cache.layers[0].keys)).sum(axis=(2, 3)).reshape(-1) > 0
    assert held[:20].all()
    assert not held[20:].any()


def test_no_recompilation_within_a_bucket(model):
    model.generate([[1, 2, 3, 4, 5]], 10, temperature=0.0)
    before = dict(generate.TRACES)
    model.generate([[9, 8, 7, 6, 5, 4, 3]], 10, temperature=0.0)  # another prompt length, the same bucket (16)
    model.generate([[9, 8, 7, 6, 5, 4, 3, 2]], 12, temperature=0.0)  # more new tokens, the same cache (32)
    assert dict(generate.TRACES) == before
    model.generate([list(range(1, 18))], 10, temperature=0.0)  # 17 tokens: the next bucket (32) compiles
    assert generate.TRACES["prefill"] == before["prefill"] + 1


def test_sampling(model):
    greedy = model.generate(PROMPTS, 8, temperature=0.0)
    np.testing.assert_array_equal(model.generate(PROMPTS, 8, temperature=0.7, top_k=1), greedy)
    a = model.generate(PROMPTS, 8, temperature=1.5, rng=jax.random.key(1))
    b = model.generate(PROMPTS, 8, temperature=1.5, rng=jax.random.key(1))
    c = model.generate(PROMPTS, 8, temperature=1.5, rng=jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and a.min() >= 0 and a.max() < 256


def test_the_decode_loop_takes_the_cache_donated(model):
    graphdef, state = nnx.split(model)
    logits, cache = generate.prefill(
        graphdef, state, jnp.ones((1, 16), jnp.int32), jnp.array([4]), cache_len=32, page_size=None
    )
    generate.decode(
        graphdef, state, cache, logits, jnp.int32(3), jnp.float32(1.0), jax.random.key(0), greedy=True, top_k=None
    )
    assert cache.layers[0].keys.is_deleted()  # updated in place, not copied


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=60), "exceeds the model's max_seq_len 64: at most 59 new tokens"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(max_new_tokens=4, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=4, top_k=0), "top_k"),
        (dict(max_new_tokens=4, prompt_tokens=[[1, 2], []]), "prompt 1 must be a non-empty"),
        (dict(max_new_tokens=4, prompt_tokens=[1, 999]), "outside"),
        (dict(max_new_tokens=4, eos_token=256), "eos_token"),
    ],
)
def test_bad_generate_arguments_are_named(model, kwargs, message):
    kwargs = {"prompt_tokens": [1, 2, 3, 4, 5], **kwargs}
    with pytest.raises(ValueError, match=message):
        model.generate(**kwargs)


def test_sample_from_a_trained_checkpoint(tmp_path, capsys):
    from train import __main__ as train_main
    from train import sample

    run = tmp_path / "run"
    train_main.main(
        [
            "--model.num_layers",
            "1",
            "--model.num_heads",
            "2",
            "--model.num_kv_heads",
            "2",
            "--model.embed_dim",
            "32",
            "--model.mlp_dim",
            "64",
            "--seq_len",
            "32",
            "--batch_size",
            "2",
            "--corpus_bytes",
            "400000",
            "--eval_tokens",
            "64",
            "--progress",
            "false",
            "--steps",
            "2",
            "--warmup_steps",
            "1",
            "--run_dir",
            str(run),
        ]
    )
    capsys.readouterr()
    sample.main(
        ["--checkpoint", str(run / "checkpoints"), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]
    )
    captured = capsys.readouterr()
    assert captured.out.startswith("def ")
    assert "step 2" in captured.err and "prefill 4 tokens" in captured.err and "decode 12 tokens" in captured.err
    assert captured.err.count("tokens/s") == 2
    model, _, _ = sample.load_model(run)
    greedy = model.generate(list(b"def "), 12, temperature=0.0)
    assert captured.out == "def " + bytes(greedy.tolist()).decode("utf-8", errors="replace") + "\n"
    eos = int(greedy[3])
    stop = greedy.tolist().index(eos) + 1
    greedy_args = ["--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]
    sample.main([*greedy_args, "--eos", str(eos)])
    assert capsys.readouterr().out == "def " + bytes(greedy[:stop].tolist()).decode("utf-8", errors="replace") + "\n"
    with pytest.raises(SystemExit):
        sample.main(["--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "40"])
    assert "at most 28" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_cached_logits_on_the_gpu_kernels(page_size):
    """bfloat16 with head_dim 64, as the GPU kernels serve it: a prefill, a chunk appended by `extend` and a
    speculative decode step (Tq = 3) over the cache (`flash_decode`'s "mosaic" kernel) give the full forward
    pass's logits."""
    config = GPTConfig(num_layers=2, num_heads=8, num_kv_heads=2, embed_dim=512, mlp_dim=512, dtype="bfloat16")
    model = GPT(config, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 700)).astype(np.int32)
    full = np.asarray(_full_forward(model)[0](nnx.split(model)[1], jnp.asarray(tokens)), np.float32)
    lengths, first = np.array([450, 517]), 400  # each prompt: `first` tokens prefilled, the rest extended
    prompts = np.where(np.arange(512)[None] < first, tokens[:, :512], 0)
    chunk = np.zeros((2, 128), np.int32)
    for b, n in enumerate(lengths):
        chunk[b, : n - first] = tokens[b, first:n]

    @nnx.jit
    def run(model, prompts, chunk, spec):
        cache = model.init_cache(2, 1024, page_size=page_size)
        _, cache = model.prefill(prompts, jnp.full((2,), first), cache)
        extend_logits, cache = model.extend(chunk, jnp.asarray(lengths - first), cache)
        spec_logits, cache = model.decode_step(spec, cache)
        return extend_logits, spec_logits, cache.lengths

    spec = np.stack([tokens[b, n : n + 3] for b, n in enumerate(lengths)])
    extend_logits, spec_logits, new_lengths = run(model, jnp.asarray(prompts), jnp.asarray(chunk), jnp.asarray(spec))
    np.testing.assert_array_equal(new_lengths, lengths + 3)
    q = jax.ShapeDtypeStruct((2, 3, config.num_heads, config.head_dim), jnp.bfloat16)
    call = decode.DecodeCall(q, q, page_size, decode.DecodeParams(scale=config.head_dim**-0.5))
    assert choose(decode.DECODE_REGISTRY, None, call, what="flash_decode ").name == "mosaic"
    want_last = np.stack([full[b, n - 1] for b, n in enumerate(lengths)])
    want_spec = np.stack([full[b, n : n + 3] for b, n in enumerate(lengths)])
    assert relative_error(np.asarray(extend_logits, np.float32), want_last) <= OUTPUT[jnp.bfloat16]
    assert relative_error(np.asarray(spec_logits, np.float32), want_spec) <= OUTPUT[jnp.bfloat16]


def test_decode_loop_casts_only_what_linear_layers_cast_anyway():
    """`generate.linear_weights_in`: the Linear kernels in the compute dtype, the embedding and norm scales in
    theirs; the model's logits are bitwise those of the uncast parameters."""
    config = dataclasses.replace(PRESETS["tiny"], dtype="bfloat16")
    model = GPT(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    cast = generate.linear_weights_in(jnp.bfloat16, state)
    dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(cast)}
    assert dtypes["['stack']['blocks'][0]['mlp']['up']['kernel'].value"] == jnp.bfloat16
    assert dtypes["['embed']['embedding'].value"] == jnp.float32
    assert dtypes["['norm']['scale'].value"] == jnp.float32
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    forward = jax.jit(lambda state: nnx.merge(graphdef, state)(tokens))
    np.testing.assert_array_equal(forward(cast), forward(state))


@pytest.mark.parametrize("page_size", [None, 8])
def test_cache_with_a_value_head_dim_of_its_own(page_size):
    """Value heads wider than the query/key heads (as MLA's differ): the cache holds them at their own width,
    and a prefill and a speculative decode step give the full forward pass's logits."""
    model = GPT(dataclasses.replace(PRESETS["tiny"], value_head_dim=32), rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(1).integers(0, 256, (2, 20)).astype(np.int32)
    full = _full_forward(model)[0](nnx.split(model)[1], jnp.asarray(tokens))

    @nnx.jit
    def run(model, prompts, chunk):
        cache = model.init_cache(2, 32, page_size=page_size)
        logits, cache = model.prefill(prompts, jnp.array([9, 14]), cache)
        chunk_logits, cache = model.decode_step(chunk, cache)
        return logits, chunk_logits, cache.layers[0].values.shape[-1]

    prompts = np.where(np.arange(16)[None] < np.array([[9], [14]]), tokens[:, :16], 0)
    chunk = np.stack([tokens[0, 9:12], tokens[1, 14:17]])
    logits, chunk_logits, value_width = run(model, jnp.asarray(prompts), jnp.asarray(chunk))
    assert value_width == 32
    assert relative_error(logits, np.stack([full[0, 8], full[1, 13]])) <= OUTPUT[jnp.float32]
    assert relative_error(chunk_logits, np.stack([full[0, 9:12], full[1, 14:17]])) <= OUTPUT[jnp.float32]
