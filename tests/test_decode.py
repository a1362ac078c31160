"""flash_decode against a float64 NumPy oracle written from the definition (query t of sequence b at position
lengths[b] - Tq + t sees keys 0 .. that position), against flash_attention's bottom rows, and across splits
merged by merge_attention_states; merge_attention_states' -inf handling and gradient; bad inputs named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import decode
from tests.helpers import all_eqns
from tests.tolerances import GRADIENT, OUTPUT, assert_close


def _oracle(q, k, v, lengths, *, scale=None, window=None, cap=None):
    """float64 out [B, Tq, H, D] and lse [B, H, Tq] from q [B, Tq, H, D], logical caches k, v [B, S, Hkv, D]."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    batch, q_len, heads, dim = q.shape
    group = heads // k.shape[2]
    scale = 1 / np.sqrt(dim) if scale is None else scale
    out, lse = np.zeros(q.shape), np.full((batch, heads, q_len), -np.inf)
    for b in range(batch):
        n = int(lengths[b])
        kh, vh = np.repeat(k[b, :n], group, axis=1), np.repeat(v[b, :n], group, axis=1)  # [n, H, D]
        s = np.einsum("thd,khd->htk", q[b], kh) * scale
        if cap is not None:
            s = cap * np.tanh(s / cap)
        q_pos, k_pos = n - q_len + np.arange(q_len)[:, None], np.arange(n)[None, :]
        seen = (k_pos <= q_pos) & ((k_pos >= q_pos - window) if window is not None else True)
        s = np.where(seen[None], s, -np.inf)
        m = s.max(-1, keepdims=True, initial=-np.inf)
        p = np.exp(s - np.where(np.isinf(m), 0, m))
        total = p.sum(-1)
        out[b] = np.einsum("htk,khd->thd", p / np.where(total == 0, 1, total)[..., None], vh)
        lse[b] = np.where(total == 0, -np.inf, np.log(np.where(total == 0, 1, total)) + m[..., 0])
    return out, lse


def _inputs(batch, q_len, kv_len, heads, kv_heads, dim, dtype, seed):
    """Unit-normal q, k, v drawn on the host (no JAX op to compile) and cast to `dtype`."""
    rng = np.random.default_rng(seed)
    shapes = ((batch, q_len, heads, dim), (batch, kv_len, kv_heads, dim), (batch, kv_len, kv_heads, dim))
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype)) for shape in shapes)


def _paged(cache, page_size, lengths, seed):
    """The logical cache [B, S, ...] as shuffled pages [B * S / page_size + 3, page_size, ...] and a block table
    whose entries past each sequence's used pages are -1 (never read)."""
    batch, kv_len = cache.shape[:2]
    per_seq = kv_len // page_size
    perm = np.random.default_rng(seed).permutation(batch * per_seq + 3)  # 3 spare pages hold garbage
    pages = np.random.default_rng(seed + 99).standard_normal((len(perm), page_size, *cache.shape[2:]), np.float32)
    table = np.full((batch, per_seq), -1, np.int32)
    logical = np.asarray(cache, np.float32).reshape(batch, per_seq, page_size, *cache.shape[2:])
    for b in range(batch):
        for i in range(-(-int(lengths[b]) // page_size)):
            table[b, i] = perm[b * per_seq + i]
            pages[perm[b * per_seq + i]] = logical[b, i]
    return jnp.asarray(pages.astype(cache.dtype)), jnp.asarray(table)


CASES = {  # id -> (q_len, max_len, lengths, heads, kv_heads, dtype, page_size, num_splits, window, soft cap)
    "tq1-gqa4-f32": (1, 100, (1, 17, 100, 64), 8, 2, jnp.float32, None, None, None, None),
    "tq3-mha-bf16-splits3": (3, 100, (3, 17, 100, 50), 2, 2, jnp.bfloat16, None, 3, None, None),
    "tq16-gqa4-page16-splits3": (16, 128, (16, 17, 100, 128), 8, 2, jnp.float32, 16, 3, None, None),
    "tq1-mha-page64-fp16": (1, 256, (1, 17, 100, 256), 2, 2, jnp.float16, 64, 2, None, None),
    "tq3-gqa4-window-cap-splits4": (3, 100, (3, 17, 100, 70), 8, 2, jnp.float32, None, 4, 20, 5.0),
    "tq16-gqa4-page16-window-cap": (16, 128, (16, 17, 100, 128), 4, 1, jnp.bfloat16, 16, 5, 7, 2.0),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_the_oracle(case):
    q_len, max_len, lengths, heads, kv_heads, dtype, page_size, splits, window, cap = case
    q, k, v = _inputs(len(lengths), q_len, max_len, heads, kv_heads, 16, dtype, seed=sum(lengths) + q_len)
    lengths = np.array(lengths, np.int32)
    ref_out, ref_lse = _oracle(q, k, v, lengths, window=window, cap=cap)
    k_cache, v_cache, table = k, v, None
    if page_size:
        k_cache, table = _paged(k, page_size, lengths, seed=1)
        v_cache, _ = _paged(v, page_size, lengths, seed=1)
    for implementation in ("xla", "reference"):
        out, lse = pf.flash_decode(
            q,
            k_cache,
            v_cache,
            lengths=jnp.asarray(lengths),
            block_table=table,
            local_window_size=window,
            logits_soft_cap=cap,
            num_splits=splits,
            return_lse=True,
            implementation=implementation,
        )
        assert out.dtype == dtype and out.shape == q.shape and lse.shape == (len(lengths), heads, q_len)
        assert lse.dtype == jnp.float32
        assert_close(out, ref_out, dtype, what=f"{implementation} output")
        assert_close(lse, ref_lse, dtype, what=f"{implementation} lse")


def test_equals_the_bottom_rows_of_causal_flash_attention():
    """Every sequence full: flash_decode's Tq queries are flash_attention's last Tq rows (bottom-right causal),
    window and soft cap as flash_attention defines them."""
    q_all, k, v = _inputs(2, 48, 48, 4, 2, 16, jnp.float32, seed=3)
    for window, cap in ((None, None), (9, 3.0)):
        want, want_lse = pf.flash_attention(
            q_all,
            k,
            v,
            is_causal=True,
            local_window_size=window,
            logits_soft_cap=cap,
            return_lse=True,
            implementation="xla",
        )
        out, lse = pf.flash_decode(
            q_all[:, -5:],
            k,
            v,
            lengths=jnp.array([48, 48]),
            local_window_size=window,
            logits_soft_cap=cap,
            num_splits=3,
            return_lse=True,
        )
        assert_close(out, want[:, -5:], jnp.float32)
        assert_close(lse, want_lse[:, :, -5:], jnp.float32, what="lse")


def test_lse_of_two_halves_merges_into_the_whole():
    """The first half of the cache (seen whole by every query) through flash_attention, the second half through
    flash_decode: merge_attention_states of the two equals flash_decode over the whole cache."""
    q, k, v = _inputs(3, 3, 64, 8, 2, 16, jnp.float32, seed=4)
    lengths = jnp.array([35, 64, 50])
    whole, whole_lse = pf.flash_decode(q, k, v, lengths=lengths, return_lse=True)
    first, first_lse = pf.flash_attention(q, k[:, :32], v[:, :32], return_lse=True)
    second, second_lse = pf.flash_decode(q, k[:, 32:], v[:, 32:], lengths=lengths - 32, return_lse=True)
    out, lse = pf.merge_attention_states(
        jnp.stack([first, second]), jnp.swapaxes(jnp.stack([first_lse, second_lse]), -1, -2)
    )
    assert_close(out, whole, jnp.float32)
    assert_close(jnp.swapaxes(lse, -1, -2), whole_lse, jnp.float32, what="lse")


def test_traced_lengths_are_unchecked_and_a_short_sequence_gets_zeros():
    q, k, v = _inputs(2, 3, 32, 2, 2, 16, jnp.float32, seed=5)
    run = jax.jit(lambda q, k, v, n: pf.flash_decode(q, k, v, lengths=n, return_lse=True, num_splits=2))
    lengths = jnp.array([1, 20])  # sequence 0 holds 1 key: its first 2 queries (positions -2, -1) see nothing
    out, lse = run(q, k, v, lengths)
    ref_out, ref_lse = _oracle(q, k, v, np.asarray(lengths))
    assert np.all(np.asarray(out[0, :2]) == 0) and np.all(np.isneginf(np.asarray(lse[0, :, :2])))
    assert_close(out, ref_out, jnp.float32)
    np.testing.assert_allclose(np.asarray(lse[0, :, 2]), ref_lse[0, :, 2], rtol=1e-5)
    eager = pf.flash_decode(q, k, v, lengths=jnp.array([3, 20]), num_splits=2)
    assert_close(run(q, k, v, jnp.array([3, 20]))[0], eager, jnp.float32)


def test_scale_static_or_traced():
    q, k, v = _inputs(2, 2, 40, 4, 2, 16, jnp.float32, seed=6)
    lengths = np.array([2, 40])
    ref, _ = _oracle(q, k, v, lengths, scale=0.3)
    assert_close(pf.flash_decode(q, k, v, lengths=lengths, scale=0.3), ref, jnp.float32)
    traced = jax.jit(lambda s: pf.flash_decode(q, k, v, lengths=jnp.asarray(lengths), scale=s))(jnp.float32(0.3))
    assert_close(traced, ref, jnp.float32)


@pytest.mark.parametrize("page_size", [None, 16])
def test_never_holds_logits_or_keys_for_the_whole_cache(page_size):
    batch, q_len, kv_len, heads, kv_heads, dim = 2, 2, 256, 4, 2, 32
    q, k, v = _inputs(batch, q_len, kv_len, heads, kv_heads, dim, jnp.float32, seed=7)
    table = None
    if page_size:
        k, table = _paged(k, page_size, [kv_len] * batch, seed=2)
        v, _ = _paged(v, page_size, [kv_len] * batch, seed=2)
    jaxpr = jax.make_jaxpr(lambda q, k, v, n, t: pf.flash_decode(q, k, v, lengths=n, block_table=t, num_splits=4))(
        q, k, v, jnp.array([kv_len] * batch), table
    )
    shapes = {tuple(var.aval.shape) for eqn in all_eqns(jaxpr.jaxpr) for var in eqn.outvars}
    assert (batch, kv_heads, heads // kv_heads, q_len, kv_len // 4) in shapes  # one split's logits
    assert not any(len(s) >= 2 and s[-1] == kv_len and s != (kv_len,) for s in shapes), "whole-cache logits"
    assert (batch, kv_len, kv_heads, dim) not in shapes or page_size is None, "the whole paged cache gathered"


def test_default_num_splits_follows_the_work():
    assert decode.xla_default_num_splits(1, 8, 1, 1000) == 1
    assert decode.xla_default_num_splits(1, 8, 1, 100_000) == -(-100_000 // decode.XLA_MAX_SPLIT_KEYS)
    assert decode.xla_default_num_splits(64, 32, 16, 8192) == 8192 // decode.XLA_MIN_SPLIT_KEYS


# ---- merge_attention_states ----------------------------------------------------------------------------------


def _normal(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def test_merge_handles_minus_infinity_without_nan():
    outs = _normal(0, 3, 4, 8).astype(jnp.bfloat16)
    lses = jnp.array([[-np.inf, 1.0, 1.0, 0.5], [-np.inf, -np.inf, 2.0, 0.5], [-np.inf, 1.0, 3.0, -np.inf]])
    lses = lses.at[:, 2].set(-np.inf)  # rows 0 and 2: every part empty
    out, lse = jax.jit(pf.merge_attention_states)(outs, lses)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32 and out.shape == (4, 8)
    assert np.all(np.asarray(out[0], np.float32) == 0) and np.all(np.asarray(out[2], np.float32) == 0)
    assert np.isneginf(lse[0]) and np.isneginf(lse[2])
    np.testing.assert_allclose(
        np.asarray(out[1], np.float32), np.asarray(outs[0, 1] + outs[2, 1], np.float32) / 2, rtol=2e-2, atol=2e-2
    )
    np.testing.assert_allclose(float(lse[1]), 1.0 + np.log(2.0), rtol=1e-6)
    seq_out, seq_lse = jax.jit(lambda o, x: pf.merge_attention_states(list(o), list(x)))(outs, lses)
    np.testing.assert_array_equal(np.asarray(seq_out, np.float32), np.asarray(out, np.float32))

    def loss(o, x):
        merged, merged_lse = pf.merge_attention_states(o, x)
        return jnp.sum(merged) + jnp.sum(jnp.where(jnp.isneginf(merged_lse), 0.0, merged_lse))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(outs.astype(jnp.float32), lses)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    assert np.all(np.asarray(grads[0])[:, 0] == 0) and np.all(np.asarray(grads[1])[:, 0] == 0)


def test_merge_gradient_matches_a_dense_softmax_combine():
    outs, lses, probe = _normal(1, 3, 2, 5, 16), 3 * _normal(2, 3, 2, 5), _normal(3, 2, 5, 16)

    def loss(merge):
        return lambda o, x: jnp.sum(merge(o, x)[0] * probe) + jnp.sum(jnp.sin(merge(o, x)[1]))

    def dense(o, x):
        return jnp.einsum("n...,n...d->...d", jax.nn.softmax(x, axis=0), o), jax.nn.logsumexp(x, axis=0)

    ours = jax.jit(jax.grad(loss(pf.merge_attention_states), argnums=(0, 1)))(outs, lses)
    want = jax.jit(jax.grad(loss(dense), argnums=(0, 1)))(outs, lses)
    for a, b in zip(ours, want):
        assert_close(a, b, jnp.float32, table=GRADIENT, what="gradient")


def test_merged_halves_have_the_gradient_of_whole_attention():
    """Dense attention over two key halves, merged, against dense attention over all keys: same gradient
    for q, k and v."""
    q, k, v = _inputs(1, 6, 24, 2, 2, 16, jnp.float32, seed=8)
    probe = _normal(9, *q.shape)

    def attend(q, k, v):
        return pf.attention_reference(q, k, v, scale=0.25)

    def split(q, k, v):
        (o1, l1), (o2, l2) = attend(q, k[:, :10], v[:, :10]), attend(q, k[:, 10:], v[:, 10:])
        out, _ = pf.merge_attention_states([o1, o2], jnp.swapaxes(jnp.stack([l1, l2]), -1, -2))
        return jnp.sum(out * probe)

    ours = jax.jit(jax.grad(split, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)[0] * probe), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(ours, want):
        assert_close(a, b, jnp.float32, table=GRADIENT, what="gradient")


def test_merge_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="lses must have the shape of outputs without its last"):
        pf.merge_attention_states(jnp.zeros((2, 3, 4, 8)), jnp.zeros((2, 4, 3)))


# ---- bad inputs ----------------------------------------------------------------------------------------------


def _bad(change):
    q, k, v = (jnp.zeros(s, jnp.float32) for s in ((2, 3, 4, 16), (2, 32, 2, 16), (2, 32, 2, 16)))
    pages = jnp.zeros((6, 16, 2, 16), jnp.float32)
    args = dict(query=q, key_cache=k, value_cache=v, lengths=jnp.array([3, 32]))
    paged = dict(args, key_cache=pages, value_cache=pages, block_table=jnp.array([[0, 1], [2, 3]]))
    return change(args, paged)


BAD = {  # id -> (arguments from (contiguous, paged), error, message)
    "length-beyond-cache": (lambda a, p: dict(a, lengths=jnp.array([3, 33])), ValueError, r"lengths\[1\] = 33"),
    "length-below-q_len": (lambda a, p: dict(a, lengths=np.array([2, 32])), ValueError, r"lengths\[0\] = 2"),
    "paged-length-beyond": (lambda a, p: dict(p, lengths=jnp.array([3, 33])), ValueError, r"\[3, 32\]"),
    "page-outside": (
        lambda a, p: dict(p, block_table=jnp.array([[0, 1], [6, 3]])),
        ValueError,
        r"block_table\[1, 0\] = 6 is outside the cache's pages \[0, 6\)",
    ),
    "page-negative": (
        lambda a, p: dict(p, block_table=jnp.array([[0, 1], [2, -1]])),
        ValueError,
        r"block_table\[1, 1\] = -1",
    ),
    "q_len-17": (lambda a, p: dict(a, query=jnp.zeros((2, 17, 4, 16))), ValueError, "q_len 17.*1 to 16"),
    "dtype-mismatch": (
        lambda a, p: dict(a, query=a["query"].astype(jnp.bfloat16)),
        TypeError,
        "key_cache has dtype float32 but query has bfloat16",
    ),
    "int-query": (lambda a, p: dict(a, query=jnp.zeros((2, 3, 4, 16), jnp.int32)), TypeError, "query has dtype"),
    "query-rank": (lambda a, p: dict(a, query=jnp.zeros((2, 4, 16))), ValueError, "query must have rank 4"),
    "cache-rank": (lambda a, p: dict(a, value_cache=jnp.zeros((2, 32, 32))), ValueError, "value_cache must have rank"),
    "kv-shapes": (lambda a, p: dict(a, value_cache=jnp.zeros((2, 31, 2, 16))), ValueError, "same shape"),
    "heads": (lambda a, p: dict(a, query=jnp.zeros((2, 3, 3, 16))), ValueError, "positive multiple"),
    "head_dim": (lambda a, p: dict(a, query=jnp.zeros((2, 3, 4, 8))), ValueError, "head_dim 16; query has head_dim 8"),
    "batch": (
        lambda a, p: dict(a, query=jnp.zeros((3, 3, 4, 16)), lengths=jnp.array([3, 3, 3])),
        ValueError,
        "key_cache has batch 2",
    ),
    "lengths-shape": (lambda a, p: dict(a, lengths=jnp.array([3])), ValueError, r"lengths must have shape \(2,\)"),
    "lengths-float": (lambda a, p: dict(a, lengths=jnp.array([3.0, 4.0])), TypeError, "lengths must be an integer"),
    "table-shape": (lambda a, p: dict(p, block_table=jnp.array([0, 1])), ValueError, "block_table must have shape"),
    "window-right": (lambda a, p: dict(a, local_window_size=(4, 2)), ValueError, "local_window_size"),
    "soft-cap": (lambda a, p: dict(a, logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    "num_splits": (lambda a, p: dict(a, num_splits=0), ValueError, "num_splits"),
    "implementation": (lambda a, p: dict(a, implementation="cuda"), ValueError, "implementation must be"),
}


@pytest.mark.parametrize("change, error, message", BAD.values(), ids=BAD.keys())
def test_bad_inputs_are_named(change, error, message):
    kwargs = _bad(change)
    with pytest.raises(error, match=message):
        pf.flash_decode(kwargs.pop("query"), kwargs.pop("key_cache"), kwargs.pop("value_cache"), **kwargs)


def test_unused_block_table_entries_are_ignored():
    """Entries past a sequence's used pages may hold anything (-1, out of range): not checked, never read."""
    args = _bad(lambda a, p: dict(p, block_table=jnp.array([[0, -1], [2, 99]]), lengths=jnp.array([3, 16])))
    out = pf.flash_decode(args.pop("query"), args.pop("key_cache"), args.pop("value_cache"), **args)
    assert np.all(np.isfinite(np.asarray(out)))


def test_outputs_keep_the_registry_contract():
    assert pf.DECODE_IMPLEMENTATIONS[-2:] == ("xla", "reference")
    assert decode.MAX_QUERY_LEN == 16
    q, k, v = _inputs(1, 1, 20, 2, 1, 16, jnp.float32, seed=10)
    np.testing.assert_array_equal(OUTPUT[jnp.float32] > 0, True)
    out = pf.flash_decode(q, k, v, lengths=jnp.array([20]), implementation=None)
    assert_close(out, _oracle(q, k, v, [20])[0], jnp.float32)
