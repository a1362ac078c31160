"""Generation with a KV cache: a jitted prefill, then the whole decode loop under one jit (`lax.while_loop`).

Shapes are bucketed so that neither a new prompt length nor a new `max_new_tokens` recompiles within a bucket:
prompts are padded to the next power of two (at least MIN_PROMPT_BUCKET, at most max_seq_len), the cache holds
the next power of two >= that bucket + max_new_tokens (at most max_seq_len), and the number of decode steps
and the temperature are traced. The prefill creates the cache; the decode loop takes it donated and updates it
in place (`models.kv_cache`).
"""

from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from models import kv_cache

MIN_PROMPT_BUCKET = 16
# How many times each jitted function below was traced (each trace is a compilation): tests count recompiles.
TRACES: collections.Counter = collections.Counter()


def bucket(n: int, cap: int, floor: int = 1) -> int:
    """The power of two >= max(n, floor), at most `cap`."""
    return min(cap, 1 << (max(n, floor) - 1).bit_length())


def pad_prompts(prompt_tokens, vocab_size: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(tokens int32 [batch, longest], lengths int32 [batch], single): prompts as one padded array.
    Accepts int [seq] (one prompt: single=True), [batch, seq] or a list of token lists (ragged)."""
    single = False
    if (
        isinstance(prompt_tokens, (list, tuple))
        and prompt_tokens
        and all(isinstance(p, (list, tuple, np.ndarray, jax.Array)) for p in prompt_tokens)
    ):
        rows = [np.asarray(p) for p in prompt_tokens]
    else:
        array = np.asarray(prompt_tokens)
        if array.ndim == 1:
            array, single = array[None], True
        if array.ndim != 2:
            raise ValueError(
                f"prompt_tokens must be [seq], [batch, seq] or a list of token lists, got shape {array.shape}"
            )
        rows = list(array)
    for b, row in enumerate(rows):
        if row.ndim != 1 or row.size == 0:
            raise ValueError(f"prompt {b} must be a non-empty list of tokens, got shape {row.shape}")
        if not np.issubdtype(row.dtype, np.integer):
            raise TypeError(f"prompt {b} must hold integer tokens, got {row.dtype}")
        if row.min() < 0 or row.max() >= vocab_size:
            raise ValueError(f"prompt {b} holds tokens outside [0, vocab_size={vocab_size})")
    lengths = np.array([row.size for row in rows], np.int32)
    tokens = np.zeros((len(rows), lengths.max()), np.int32)
    for b, row in enumerate(rows):
        tokens[b, : row.size] = row
    return tokens, lengths, single


def sample(logits, rng, temperature, *, greedy: bool, top_k: int | None):
    """Tokens int32 [batch] from logits [batch, vocab]: argmax if greedy, else a draw from
    softmax(logits / temperature) restricted to the top_k most likely tokens (None: all)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_len", "page_size", "num_pages"))
def prefill(
    graphdef,
    state,
    tokens,
    lengths,
    block_table=None,
    *,
    cache_len: int,
    page_size: int | None,
    num_pages: int | None = None,
):
    """A fresh cache of `cache_len` tokens per sequence (paged with `page_size`: pages as `block_table` and
    `num_pages` give them, by default cache_len's worth per sequence), filled with the prompts: (logits
    [batch, vocab] after each prompt's last token, cache)."""
    TRACES["prefill"] += 1
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(
        tokens.shape[0], cache_len, page_size=page_size, block_table=block_table, num_pages=num_pages
    )
    return model.prefill(tokens, lengths, cache)


def linear_weights_in(dtype, state):
    """`state` with its Linear layers' kernels cast to the compute `dtype`. nnx.Linear casts its kernel to
    that dtype on every call, so the result is the same; cast once before the decode loop rather than in every
    step (XLA leaves the casts inside the while loop: a fifth of a small-preset step). The embedding (which the
    tied head reads in float32) and the norm scales keep their dtype."""

    def cast(path, x):
        names = {getattr(key, "key", getattr(key, "name", None)) for key in path[-2:]}  # [..., "kernel", .value]
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return x.astype(dtype) if "kernel" in names and floating and x.dtype != dtype else x

    return jax.tree_util.tree_map_with_path(cast, state)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "top_k"), donate_argnames=("cache",))
def decode(
    graphdef,
    state,
    cache,
    logits,
    max_new_tokens,
    temperature,
    rng,
    eos_token=-1,
    *,
    greedy: bool,
    top_k: int | None,
):
    """The decode loop: samples a token from `logits`, feeds it back through `decode_step`, up to
    max_new_tokens times (traced), in one `lax.while_loop` carrying the cache. A sequence that samples
    `eos_token` (traced; -1: none) stops: its later tokens are eos_token, and the loop ends once every
    sequence has stopped. Returns (tokens int32 [batch, capacity], whose first max_new_tokens columns are the
    new tokens; lengths int32 [batch], the tokens each sequence generated, its eos_token included; the cache)."""
    TRACES["decode"] += 1
    dtype = jnp.dtype(nnx.merge(graphdef, state).config.dtype)
    model = nnx.merge(graphdef, linear_weights_in(dtype, state))
    pick = functools.partial(sample, temperature=temperature, greedy=greedy, top_k=top_k)
    token = pick(logits, jax.random.fold_in(rng, 0))
    out = jnp.zeros((logits.shape[0], cache.capacity), jnp.int32).at[:, 0].set(token)
    lengths = jnp.ones_like(token)

    def running(carry):
        i, _, token, _, _ = carry
        return jnp.logical_and(i < max_new_tokens, jnp.any(token != eos_token))

    def body(carry):
        i, cache, token, out, lengths = carry
        stopped = token == eos_token
        logits, cache = model.decode_step(token[:, None], cache)
        token = jnp.where(stopped, eos_token, pick(logits[:, 0], jax.random.fold_in(rng, i)))
        lengths = lengths + jnp.logical_not(stopped)
        return i + 1, cache, token, lax.dynamic_update_slice(out, token[:, None], (0, i)), lengths

    i, cache, _, out, lengths = lax.while_loop(running, body, (jnp.int32(1), cache, token, out, lengths))
    # Columns the loop did not reach (every sequence had stopped) are padding too.
    out = jnp.where(jnp.arange(out.shape[1])[None, :] < i, out, eos_token)
    return out, lengths, cache


def generate(
    model,
    prompt_tokens,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    rng=None,
    page_size: int | None = None,
    eos_token: int | None = None,
    stats: dict | None = None,
):
    """`GPT.generate`. With a `stats` dict, it also compiles ahead of time and fills in compile_s, prefill_s,
    decode_s (each waited for), prompt_tokens (real, unpadded) and new_tokens."""
    cfg = model.config
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float, np.floating))
        or not (np.isfinite(temperature) and temperature >= 0)
    ):
        raise ValueError(f"temperature must be a finite float >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= cfg.vocab_size
    ):
        raise ValueError(f"top_k must be None or an int in [1, vocab_size={cfg.vocab_size}], got {top_k!r}")
    if page_size is not None and (
        isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1
    ):
        raise ValueError(f"page_size must be None or an int >= 1, got {page_size!r}")
    if eos_token is not None and (
        isinstance(eos_token, bool)
        or not isinstance(eos_token, (int, np.integer))
        or not 0 <= eos_token < cfg.vocab_size
    ):
        raise ValueError(f"eos_token must be None or an int in [0, vocab_size={cfg.vocab_size}), got {eos_token!r}")
    tokens, lengths, single = pad_prompts(prompt_tokens, cfg.vocab_size)
    longest = int(lengths.max())
    if longest + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's max_seq_len {cfg.max_seq_len}: at most {cfg.max_seq_len - longest} new tokens"
        )
    prompt_len = bucket(longest, cfg.max_seq_len, MIN_PROMPT_BUCKET)
    cache_len = bucket(prompt_len + int(max_new_tokens), cfg.max_seq_len)
    tokens = np.pad(tokens, ((0, 0), (0, prompt_len - tokens.shape[1])))
    rng = jax.random.key(0) if rng is None else rng
    greedy = float(temperature) == 0.0
    graphdef, state = nnx.split(model)
    block_table, num_pages = None, None
    if page_size is not None:  # each sequence's pages: its prompt and max_new_tokens (see models.kv_cache)
        block_table, num_pages = kv_cache.allocate_pages(lengths + int(max_new_tokens), page_size, cache_len)
        block_table = jnp.asarray(block_table)
    prefill_args = (graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), block_table)
    prefill_static = dict(cache_len=cache_len, page_size=page_size, num_pages=num_pages)
    decode_static = dict(greedy=greedy, top_k=None if top_k is None else int(top_k))

    def decode_args(logits, cache):
        return (
            graphdef,
            state,
            cache,
            logits,
            jnp.int32(max_new_tokens),
            jnp.float32(1.0 if greedy else temperature),
            rng,
            jnp.int32(-1 if eos_token is None else eos_token),
        )

    if stats is None:
        logits, cache = prefill(*prefill_args, **prefill_static)
        out, generated, _ = decode(*decode_args(logits, cache), **decode_static)
    else:  # compile first, then time each phase to completion
        start = time.perf_counter()
        run_prefill = prefill.lower(*prefill_args, **prefill_static).compile()
        abstract = jax.eval_shape(lambda *args: prefill(graphdef, *args, **prefill_static), *prefill_args[1:])
        run_decode = decode.lower(*decode_args(*abstract), **decode_static).compile()
        stats["compile_s"] = time.perf_counter() - start
        start = time.perf_counter()
        logits, cache = jax.block_until_ready(run_prefill(*prefill_args[1:]))
        stats["prefill_s"] = time.perf_counter() - start
        start = time.perf_counter()
        out, generated, _ = jax.block_until_ready(run_decode(*decode_args(logits, cache)[1:]))
        stats["decode_s"] = time.perf_counter() - start
        stats["prompt_tokens"], stats["new_tokens"] = int(lengths.sum()), int(np.asarray(generated).sum())
    out, generated = np.asarray(out[:, :max_new_tokens]), np.asarray(generated)
    if eos_token is None:
        return out[0] if single else out
    return (out[0], generated[0]) if single else (out, generated)
