"""score_mod, mask_mod and sinks through `flash_attention` on the XLA paths (the semantics every implementation
shares), against dense float32 oracles written here without `pallas_flash.mods` (each built-in's formula by hand),
gradients included (closed-over arrays and sinks); the staging the kernels use; errors; compiles per new values.
The kernels' own tests: tests/hopper/test_mods_*.py, tests/portable/test_mods.py."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import mods
from tests.helpers import normal
from tests.tolerances import GRADIENT, assert_close

IMPLEMENTATIONS = ["xla_chunked", "xla"]
SMALL = pf.KernelConfig(xla_block_kv=16)  # several key chunks at these lengths


def dense(q, k, v, *, logits=None, visible=None, sinks=None):
    """Softmax attention in float32 with the logits modified by `logits(s, b, h, qi, ki)` and hidden where
    `visible(b, h, qi, ki)` is False (both on broadcast [B, H, Tq, Tk] index grids); `sinks` join the denominator.
    A row that sees nothing (and has no sink) gets zeros."""
    batch, q_len, heads, dim = q.shape
    group = heads // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision="highest") / np.sqrt(dim)
    b = jnp.arange(batch)[:, None, None, None]
    h = jnp.arange(heads)[None, :, None, None]
    qi = jnp.arange(q_len)[None, None, :, None]
    ki = jnp.arange(k.shape[1])[None, None, None, :]
    if logits is not None:
        s = logits(s, b, h, qi, ki)
    if visible is not None:
        s = jnp.where(visible(b, h, qi, ki), s, -jnp.inf)
    if sinks is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(s - m)
    p = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1e-30)
    if sinks is not None:
        p = p[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")


def _docs(batch, length, starts):
    ids = np.zeros((batch, length), np.int32)
    for row, row_starts in enumerate(starts):
        for s in row_starts:
            ids[row, s:] += 1
    return jnp.asarray(ids)


SHAPE = (2, 40, 4, 16)  # [batch, seq, heads, head_dim]: 40 is not a multiple of the 16-key chunks
DOCS = _docs(2, 40, [(9, 30), (33,)])
SLOPES = jnp.asarray([0.5, 0.25, 0.125, 0.0625])


def case(name):
    """(flash_attention kwargs, dense kwargs) of one named case, for SHAPE."""
    table = normal(7, (SHAPE[2], SHAPE[1]))
    cases = {
        "soft_cap": (dict(score_mod=mods.soft_cap(2.0)), dict(logits=lambda s, b, h, q, k: 2.0 * jnp.tanh(s / 2.0))),
        "alibi": (
            dict(score_mod=mods.alibi(SLOPES)),
            dict(logits=lambda s, b, h, q, k: s - SLOPES[h] * jnp.abs(k - q)),
        ),
        "key_bias_table": (
            dict(score_mod=lambda s, b, h, q, k: s + table[h, k]),
            dict(logits=lambda s, b, h, q, k: s + table[h, k]),
        ),
        "relative_position_bias": (
            dict(score_mod=mods.relative_position_bias(table[:, :9])),
            dict(logits=lambda s, b, h, q, k: s + table[:, :9][h, jnp.clip(k - q, -4, 4) + 4]),
        ),
        "causal": (dict(mask_mod=mods.causal()), dict(visible=lambda b, h, q, k: k <= q)),
        "sliding_window": (
            dict(mask_mod=mods.sliding_window(5, 2)),
            dict(visible=lambda b, h, q, k: (k >= q - 5) & (k <= q + 2)),
        ),
        "document_causal": (
            dict(mask_mod=mods.and_masks(mods.document(DOCS), mods.causal())),
            dict(visible=lambda b, h, q, k: (DOCS[b, q] == DOCS[b, k]) & (k <= q)),
        ),
        "prefix_lm": (
            dict(mask_mod=mods.prefix_lm(jnp.asarray([7, 0]))),
            dict(visible=lambda b, h, q, k: (k <= q) | (k < jnp.asarray([7, 0])[b])),
        ),
        "per_head_mask": (  # head 3 sees nothing: fully masked rows
            dict(mask_mod=lambda b, h, q, k: (h < 3) & (k <= q + h)),
            dict(visible=lambda b, h, q, k: (h < 3) & (k <= q + h)),
        ),
    }
    return cases[name]


CASES = [
    "soft_cap",
    "alibi",
    "key_bias_table",
    "relative_position_bias",
    "causal",
    "sliding_window",
    "document_causal",
    "prefix_lm",
    "per_head_mask",
]


def _check(impl, shape, kwargs, dense_kwargs, *, kv_heads=None, kv_len=None, sinks=None, seed=0):
    batch, q_len, heads, dim = shape
    kv_heads, kv_len = kv_heads or heads, kv_len or q_len
    q = normal(seed, shape)
    k, v = normal(seed + 1, (batch, kv_len, kv_heads, dim)), normal(seed + 2, (batch, kv_len, kv_heads, dim))
    w = normal(seed + 3, shape)
    config = SMALL if impl == "xla_chunked" else None

    def ours(q, k, v, sinks):
        return pf.flash_attention(q, k, v, sinks=sinks, implementation=impl, config=config, **kwargs)

    def ref(q, k, v, sinks):
        return dense(q, k, v, sinks=sinks, **dense_kwargs)

    args = (q, k, v, sinks)
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    assert_close(ours(*args), ref(*args), jnp.float32)
    grads = jax.grad(lambda *a: jnp.sum(ours(*a) * w), argnums)(*args)
    ref_grads = jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums)(*args)
    for name, g, r in zip("q k v sinks".split(), grads, ref_grads):
        assert_close(g, r, jnp.float32, table=GRADIENT, what=f"d{name}")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", CASES)
def test_builtin_mods_against_dense(impl, name):
    _check(impl, SHAPE, *case(name))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_combined_mods_gqa_and_unequal_lengths(impl):
    """A score_mod chain and a mask_mod together, with the older keyword arguments (soft cap, a key-padding
    bias), GQA and q_len != kv_len (positions from each sequence's start)."""
    batch, q_len, heads, dim, kv_len = 2, 24, 4, 16, 37
    bias = normal(11, (batch, 1, 1, kv_len))
    slopes = jnp.asarray([0.3, 0.2, 0.1, 0.05])
    kwargs = dict(
        score_mod=mods.chain(mods.alibi(slopes), lambda s, b, h, q, k: s * 0.5),
        mask_mod=mods.sliding_window(6, 3),
        logits_soft_cap=3.0,
        bias=bias,
    )

    def logits(s, b, h, q, k):
        s = 3.0 * jnp.tanh(s / 3.0) + bias[:, :, 0][..., None, :][b[:, 0, 0, 0]]
        return (s - slopes[h] * jnp.abs(k - q)) * 0.5

    dense_kwargs = dict(logits=logits, visible=lambda b, h, q, k: (k >= q - 6) & (k <= q + 3))
    _check(impl, (batch, q_len, heads, dim), kwargs, dense_kwargs, kv_heads=2, kv_len=kv_len)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_sinks_with_a_mask_and_empty_rows(impl):
    """Sinks join each row's denominator; rows that see nothing give zeros (their weight all goes to the sink);
    gradients reach the sinks."""
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
    kwargs, dense_kwargs = case("per_head_mask")
    _check(impl, SHAPE, kwargs, dense_kwargs, sinks=sinks)
    out = pf.flash_attention(*(normal(i, SHAPE) for i in range(3)), sinks=sinks, implementation=impl, **kwargs)
    assert np.all(np.asarray(out[:, :, 3]) == 0.0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_gradient_reaches_closed_over_arrays(impl):
    """jax.grad through a score_mod into the arrays it closes over (ALiBi slopes, a per-key bias table) equals the
    dense oracle's."""
    q, k, v = (normal(i, SHAPE) for i in range(3))
    w = normal(5, SHAPE)
    table = normal(6, (SHAPE[2], SHAPE[1]))
    config = SMALL if impl == "xla_chunked" else None

    def ours(slopes, table):
        score_mod = mods.chain(mods.alibi(slopes), lambda s, b, h, qi, ki: s + table[h, ki])
        return pf.flash_attention(q, k, v, score_mod=score_mod, mask_mod=mods.causal(), implementation=impl,
                                  config=config)  # fmt: skip

    def ref(slopes, table):
        return dense(
            q,
            k,
            v,
            logits=lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(ki - qi) + table[h, ki],
            visible=lambda b, h, qi, ki: ki <= qi,
        )

    grads = jax.grad(lambda *a: jnp.sum(ours(*a) * w), (0, 1))(SLOPES, table)
    ref_grads = jax.grad(lambda *a: jnp.sum(ref(*a) * w), (0, 1))(SLOPES, table)
    for name, g, r in zip(("slopes", "table"), grads, ref_grads):
        assert float(jnp.abs(r).max()) > 1e-3, "the oracle's gradient must not be trivially zero"
        assert_close(g, r, jnp.float32, table=GRADIENT, what=f"d{name}")


def test_new_values_of_closed_over_arrays_do_not_recompile():
    """Under jit and eagerly, a mask_mod closing over new document ids (same shape) reuses the compile; the result
    follows the new values."""
    q, k, v = (normal(i, SHAPE) for i in range(3))
    other = _docs(2, 40, [(20,), (5, 10)])
    traces = []

    @jax.jit
    def run(ids):
        traces.append(1)
        return pf.flash_attention(q, k, v, mask_mod=mods.document(ids), implementation="xla_chunked")

    for ids in (DOCS, other):
        want = dense(q, k, v, visible=lambda b, h, qi, ki, ids=ids: ids[b, qi] == ids[b, ki])
        assert_close(run(ids), want, jnp.float32)
    assert len(traces) == 1
    before = pf.api._attention._cache_size()
    for ids in (DOCS, other, DOCS):
        pf.flash_attention(q, k, v, mask_mod=mods.document(ids), implementation="xla_chunked")
    assert pf.api._attention._cache_size() - before == 1


def test_staging_splits_rows_columns_and_the_joint_part():
    """The kernels' form of a program: per-query and per-key values computed in XLA, an elementwise rest on tiles,
    equal to the program itself; a gather by both positions cannot be staged (with the reason)."""
    program, consts = mods.trace(mods.and_masks(mods.document(DOCS), mods.causal()), "mask")
    staged, why = mods.stage(program)
    assert why is None
    assert [(s.side, s.kind, s.batch, s.head) for s in staged.staged] == [("row", "int", True, False),
                                                                         ("col", "int", True, False)]  # fmt: skip
    rows_int, rows_float, cols_int, cols_float = staged.stacks(consts, 2, 4, 40, 40)
    assert rows_float is None and cols_float is None and rows_int.shape == cols_int.shape == (2, 1, 1, 40)
    q, k = jnp.arange(40)[:, None], jnp.arange(40)[None, :]
    for b in range(2):
        tile = staged.joint(None, jnp.int32(b), jnp.int32(0), q + 0 * k, k + 0 * q,
                            [jnp.broadcast_to(rows_int[b, 0, 0][:, None], (40, 40))], [],
                            [jnp.broadcast_to(cols_int[b, 0, 0][None, :], (40, 40))], [])  # fmt: skip
        np.testing.assert_array_equal(tile, program.apply(consts, b, 0, q, k))
    program, _ = mods.trace(mods.relative_position_bias(jnp.ones((4, 9))), "score")
    staged, why = mods.stage(program)
    assert staged is None and "both q_idx and kv_idx" in why


INTERVAL_CASES = {
    "causal": mods.causal(),
    "window": mods.sliding_window(17, 5),
    "document_causal": mods.and_masks(mods.document(DOCS), mods.causal()),
    "prefix_lm": mods.prefix_lm(jnp.asarray([13, 0])),
    "or_per_head": mods.or_masks(mods.sliding_window(3, 3), lambda b, h, q, k: (k < 10) & (h < 2)),
    "scaled_positions": lambda b, h, q, k: (2 * k - 3) // 4 <= q * 1,
    "float_threshold": lambda b, h, q, k: jnp.tanh(q.astype(jnp.float32) / 9.0) > jnp.abs(k - 20) / 30.0,
    "remainder": lambda b, h, q, k: (q % 7) == (k % 7),  # no interval rule: evaluated at every position
}


@pytest.mark.parametrize("name", INTERVAL_CASES)
@pytest.mark.parametrize("blocks", [(8, 16), pytest.param((16, 8), marks=pytest.mark.slow)])  # slow: CI's time
def test_block_classes_by_intervals_are_sound_and_exact_for_builtins(name, blocks):
    """Interval arithmetic over each block's ranges never calls a block empty or full that is not (against the
    evaluation at every position), and is exact for the built-in masks."""
    program, consts = mods.trace(INTERVAL_CASES[name], "mask")
    shape = dict(batch=2, heads=4, q_len=40, kv_len=37, block_q=blocks[0], block_kv=blocks[1])
    got = [np.broadcast_to(np.asarray(x), (2, 4) + x.shape[2:]) for x in mods.block_classes(program, consts, **shape)]
    want = [
        np.broadcast_to(np.asarray(x), (2, 4) + x.shape[2:])
        for x in mods._dense_block_classes(program, consts, *shape.values())
    ]
    assert (got[0] >= want[0]).all() and (got[1] <= want[1]).all(), "unsound"
    if name not in ("scaled_positions", "float_threshold"):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("chunk", [1 << 26, 700])
@pytest.mark.parametrize("stageable", [True, False])
def test_block_classes_of_a_document_mask(chunk, stageable, monkeypatch):
    """Exact classes, in one chunk or several (700 elements: one query block of 8 x 40 keys x 2 batches per
    chunk), staged or vmapped (a mask indexed by both positions)."""
    monkeypatch.setattr(mods, "BLOCK_CLASS_CHUNK", chunk)
    table = np.asarray(normal(3, (40, 40))) > 0.5
    extra = (lambda b, h, q, k: jnp.asarray(table)[q, k] | (k == q)) if not stageable else mods.causal()
    program, consts = mods.trace(mods.and_masks(mods.document(DOCS), extra), "mask")
    anything, everything = mods.block_classes(program, consts, batch=2, heads=4, q_len=40, kv_len=40, block_q=8,
                                              block_kv=8)  # fmt: skip
    assert anything.shape == everything.shape == (2, 1, 5, 5)
    tokens = np.asarray(program.apply(consts, jnp.arange(2)[:, None, None], 0, jnp.arange(40)[:, None],
                                      jnp.arange(40)[None, :]))  # fmt: skip
    blocks = tokens.reshape(2, 5, 8, 5, 8)
    np.testing.assert_array_equal(anything[:, 0], blocks.any(axis=(2, 4)))
    np.testing.assert_array_equal(everything[:, 0], blocks.all(axis=(2, 4)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(score_mod=lambda s, b, h, q: s), "score_mod must be a function"),
        (dict(mask_mod=lambda s, b, h, q, k: True), "mask_mod must be a function"),
        (dict(score_mod=lambda s, b, h, q, k: jnp.ones(2) * s), "score_mod must return one scalar"),
        (dict(score_mod=lambda s, b, h, q, k: q > k), "score_mod must return a float scalar"),
        (dict(mask_mod=lambda b, h, q, k: q - k), "mask_mod must return a bool scalar"),
        (dict(mask_mod=3), "mask_mod must be callable"),
        (dict(sinks=jnp.zeros(3)), "sinks must have shape"),
        (dict(sinks=jnp.zeros(4, jnp.int32)), "sinks must be a float array"),
    ],
)
def test_bad_mods_are_refused(kwargs, message):
    q = jnp.zeros(SHAPE)
    with pytest.raises((TypeError, ValueError), match=message):
        pf.flash_attention(q, q, q, **kwargs)


def test_a_mod_the_kernels_cannot_stage_runs_elsewhere_and_says_why(caplog):
    """On CPU the XLA chunked path runs anyway; the log names the implementation for any program."""
    q = normal(0, SHAPE)
    with caplog.at_level(logging.DEBUG, logger="pallas_flash"):
        pf.api._logged.clear()
        pf.flash_attention(q, q, q, score_mod=mods.relative_position_bias(jnp.zeros((4, 9))))
    assert "xla_chunked" in caplog.text


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(logits_soft_cap=2.0, alibi=True),
        dict(bias_shape=(2, 1, 1, 40), mask_shape=(2, 1, 40, 1)),
        dict(bias_shape=(1, 4, 40, 1), alibi=True, score_mod=True, mask_mod=True),
    ],
    ids=["cap_alibi", "key_bias_query_mask", "query_bias_alibi_user_mods"],
)
def test_modifiers_fold_into_programs_for_the_hopper_kernels(kwargs):
    """The Hopper kernels take soft cap, ALiBi, and a bias or mask over queries or keys as programs
    (`api._hopper_programs`): the folded call equals the original on the XLA chunked path, gradients (dbias in the
    bias's own shape) included."""
    from pallas_flash import api, masks, xla_chunked

    q, k, v = (normal(i, SHAPE) for i in range(3))
    bias = normal(4, kwargs["bias_shape"]) if "bias_shape" in kwargs else None
    mask = normal(5, kwargs["mask_shape"]) > -0.5 if "mask_shape" in kwargs else None
    slopes = jnp.broadcast_to(SLOPES, (2, 4)) if kwargs.get("alibi") else None
    score_program = mods.trace(lambda s, b, h, qi, ki: s * 0.7, "score") if kwargs.get("score_mod") else (None, ())
    mask_program = mods.trace(mods.document(DOCS), "mask") if kwargs.get("mask_mod") else (None, ())
    dims = lambda x: None if x is None else tuple(n != 1 for n in x.shape)
    score_mods = masks.ScoreMods(bias_dims=dims(bias), mask_dims=dims(mask), alibi=slopes is not None,
                                 soft_cap=kwargs.get("logits_soft_cap"), score_mod=score_program[0],
                                 mask_mod=mask_program[0])  # fmt: skip
    band = masks.Band.of(True)

    def run(bias, folded):
        arrays = masks.ModArrays(bias=bias, mask=mask, alibi_slopes=slopes, score_consts=score_program[1],
                                 mask_consts=mask_program[1])  # fmt: skip
        m, a = api._hopper_programs(score_mods, arrays) if folded else (score_mods, arrays)
        if folded:
            assert m.bias_dims is None and m.mask_dims is None and not m.alibi and m.soft_cap is None
        out, _ = xla_chunked.attention_chunked(q, k, v, scale=0.25, band=band, block_kv=16, mods=m, mod_arrays=a)
        return out

    for folded in (False, True):
        out = run(bias, folded)
        if not folded:
            want = out
    assert_close(out, want, jnp.float32)
    if bias is not None:
        w = normal(6, SHAPE)
        grads = [jax.grad(lambda b: jnp.sum(run(b, f) * w))(bias) for f in (False, True)]
        assert grads[1].shape == bias.shape
        assert_close(grads[1], grads[0], jnp.float32, table=GRADIENT, what="dbias")


# Programs for the kernels' vector form of `Staged.joint`, each with its constant d score / d score_in (None: not
# a constant). Tiles of 24 queries by 40 keys, 2 examples, 3 heads.
VECTOR_SHAPE = (2, 3, 24, 40)  # batch, heads, q_len, kv_len
GAINS = normal(11, (24,)) + 1.5
KEY_BIAS = normal(12, (3, 40))
VECTOR_DOCS = _docs(2, 40, [(9, 30), (33,)])
VECTOR_SCORES = {
    "soft_cap": (mods.soft_cap(2.0), None),
    "alibi": (mods.alibi(SLOPES[:3]), 1.0),
    "key_bias": (lambda s, b, h, q, k: s + KEY_BIAS[h, k], 1.0),
    "cap_alibi_bias": (
        mods.chain(mods.soft_cap(3.0), mods.alibi(SLOPES[:3]), lambda s, b, h, q, k: s + KEY_BIAS[h, k]),
        None,
    ),  # fmt: skip
    "row_gain_times_key_bias": (lambda s, b, h, q, k: -2.0 * s + GAINS[q] * KEY_BIAS[h, k], -2.0),
    "head_times_distance": (lambda s, b, h, q, k: s + ((k - q) * h).astype(jnp.float32) * 1e-2, 1.0),
    "leaky_select": (lambda s, b, h, q, k: jnp.where(s > 0, s, 0.1 * s) / 3.0, None),
    "squared_distance": (
        lambda s, b, h, q, k: (
            s - 0.01 * ((k - q) * (k - q)).astype(jnp.float32) + jnp.maximum(k - 2 * q, -5).astype(jnp.float32)
        ),
        1.0,
    ),
    "constant": (lambda s, b, h, q, k: jnp.float32(1.5), 0.0),
    # a select on positions whose predicate reads a staged value: the conversion moves onto its cases only
    "select_distance": (
        lambda s, b, h, q, k: s + 0.1 * jnp.where(KEY_BIAS[h, k] > 0, k - q, q - k).astype(jnp.float32),
        1.0,
    ),
}
VECTOR_MASKS = {
    "document_causal": mods.and_masks(mods.document(VECTOR_DOCS[:, :24], VECTOR_DOCS), mods.causal()),
    "sliding_window": mods.sliding_window(5, 2),
    "prefix_lm": mods.prefix_lm(jnp.asarray([7, 0])),
    "per_head": lambda b, h, q, k: (h < 2) & (k <= q + h),
}


def _vector_args(staged, consts, b, h):
    """The staged values of (b, h) as `Staged.joint` takes them in its vector form: four lists of vectors."""
    stacks = staged.stacks(consts, *VECTOR_SHAPE)

    def vectors(stack):
        if stack is None:
            return []
        return list(stack[b if stack.shape[0] > 1 else 0, h if stack.shape[1] > 1 else 0])

    return [vectors(s) for s in stacks]


@pytest.mark.parametrize("q_axis", [0, 1])
@pytest.mark.parametrize("name", [*VECTOR_SCORES, *VECTOR_MASKS])
def test_joint_on_vectors_equals_the_program(name, q_axis):
    """`Staged.joint` in the kernels' form (positions and staged values as vectors of the tile's queries and keys,
    queries along either axis, the score's scale folded in, conversions moved onto the positions; the score
    split into a tile and a constant factor or not) equals the program on every position; so does the tile
    form."""
    kind = "score" if name in VECTOR_SCORES else "mask"
    fn = VECTOR_SCORES[name][0] if kind == "score" else VECTOR_MASKS[name]
    program, consts = mods.trace(fn, kind)
    staged, why = mods.stage(program)
    assert why is None
    batch, heads, q_len, kv_len = VECTOR_SHAPE
    scale = 0.3
    s = normal(13, (q_len, kv_len), 3.0)
    q, k = jnp.arange(q_len, dtype=jnp.int32), jnp.arange(kv_len, dtype=jnp.int32)
    for b in range(batch):
        for h in range(heads):
            score_in = (scale * s,) if kind == "score" else ()
            want = program.apply(consts, *score_in, b, h, q[:, None], k[None, :])
            values = _vector_args(staged, consts, b, h)
            score = None if kind == "mask" else (s if q_axis == 0 else s.T)
            args = (score, jnp.int32(b), jnp.int32(h), q, k, *values)
            for split in (False, True) if kind == "score" else (False,):
                out = staged.joint(*args, q_axis=q_axis, scale=scale, max_position=kv_len, split=split)
                if split:
                    out = out[0] * out[1]
                out = out if q_axis == 0 else out.T
                if kind == "mask":
                    np.testing.assert_array_equal(out, want)
                else:
                    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
            tile = lambda x, axis: jnp.broadcast_to(jnp.expand_dims(x, 1 - axis), (q_len, kv_len))  # noqa: E731
            tiles = [[tile(x, 0 if i < 2 else 1) for x in group] for i, group in enumerate(values)]
            out = staged.joint(*(score_in or (None,)), jnp.int32(b), jnp.int32(h), tile(q, 0), tile(k, 1), *tiles)
            if kind == "mask":
                np.testing.assert_array_equal(out, want)
            else:
                np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


OFFSET_SCORES = {
    **{name: VECTOR_SCORES[name][0] for name in ("alibi", "key_bias", "head_times_distance", "squared_distance")},
    "scaled_bias_and_query_term": lambda s, b, h, q, k: (s + 1.0) * 0.5 - 0.25 * q.astype(jnp.float32) + KEY_BIAS[h, k],
    "query_term_only": lambda s, b, h, q, k: 3.0 * s + GAINS[q],
    # positions read otherwise than as their difference: the origin must not reach them
    "position_sum": lambda s, b, h, q, k: s + 0.01 * (q + k - 1).astype(jnp.float32),
    # value slope 2 (a stop_gradient passes the score on), derivative 1
    "stop_gradient_sum": lambda s, b, h, q, k: s + jax.lax.stop_gradient(s) + KEY_BIAS[h, k],
}


@pytest.mark.parametrize("origin", [None, 16])
@pytest.mark.parametrize("key_before_query", [False, True])
@pytest.mark.parametrize("q_axis", [0, 1])
@pytest.mark.parametrize("name", OFFSET_SCORES)
def test_offsets_and_the_score_make_the_program(name, q_axis, key_before_query, origin):
    """`Staged.offsets` of a program linear in the score (`score_slope` a > 0): a * scale * (s + offset) + row
    equals the program on scale * s at every position (under `key_before_query`, where the key is at or before the
    query; with positions counted from an origin, which only a program that reads their difference takes); a
    per-query term goes to the row whole, and with no term beside the score's, the offset is None."""
    program, consts = mods.trace(OFFSET_SCORES[name], "score")
    staged, _ = mods.stage(program)
    slope = staged.score_slope
    assert slope > 0
    batch, heads, q_len, kv_len = VECTOR_SHAPE
    scale, b, h = 0.3, 1, 2
    s = normal(13, (q_len, kv_len), 3.0)
    q, k = jnp.arange(q_len, dtype=jnp.int32), jnp.arange(kv_len, dtype=jnp.int32)
    want = program.apply(consts, scale * s, b, h, q[:, None], k[None, :])
    shape = (q_len, kv_len) if q_axis == 0 else (kv_len, q_len)
    offset, row = staged.offsets(jnp.int32(b), jnp.int32(h), q, k, *_vector_args(staged, consts, b, h), q_axis=q_axis,
                                 tile_shape=shape, scale=scale, max_position=kv_len,
                                 key_before_query=key_before_query, origin=origin)  # fmt: skip
    assert (offset is None) == (name == "query_term_only")
    offset = 0.0 if offset is None else (offset if q_axis == 0 else offset.T)
    out = slope * scale * (s + offset) + (0.0 if row is None else row[:, None])
    seen = k[None, :] <= q[:, None] if key_before_query else np.ones(out.shape, bool)
    np.testing.assert_allclose(np.where(seen, out, 0.0), np.where(seen, want, 0.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "fn",
    [
        lambda s, b, h, q, k: s + jnp.where(s > 0, 0.5, 0.0),  # a branch on the score
        lambda s, b, h, q, k: s.astype(jnp.bfloat16).astype(jnp.float32),  # rounded
        lambda s, b, h, q, k: s.astype(jnp.int32).astype(jnp.float32) + KEY_BIAS[h, k],  # truncated
    ],
)
def test_score_slope_refuses_what_is_not_linear_in_the_score(fn):
    """`Staged.score_slope` is None where the result is not a * score + g, even where autodiff's derivative is a
    constant: the kernels' offsets would compute another function."""
    program, consts = mods.trace(fn, "score")
    staged, _ = mods.stage(program)
    assert staged.score_derivative is not None and staged.score_slope is None
    q = jnp.arange(VECTOR_SHAPE[2], dtype=jnp.int32)
    with pytest.raises(ValueError, match="positive constant slope"):
        staged.offsets(jnp.int32(0), jnp.int32(0), q, q, *_vector_args(staged, consts, 0, 0), q_axis=0,
                       tile_shape=(q.size, q.size), scale=1.0)  # fmt: skip


@pytest.mark.parametrize("name", VECTOR_SCORES)
def test_score_derivative_is_the_constant_slope(name):
    """`Staged.score_derivative`: d result / d score where the score passes through linear steps only, else None."""
    fn, slope = VECTOR_SCORES[name]
    staged, _ = mods.stage(mods.trace(fn, "score")[0])
    assert staged.score_derivative == slope


def _tile_equations(fn, kind, max_position):
    """(the tile-shaped equations of `Staged.joint`'s vector form on a 64 x 128 tile, broadcasts left out; the
    constant factor of the split score)."""
    program, consts = mods.trace(fn, kind)
    staged, _ = mods.stage(program)
    values = _vector_args(staged, consts, 0, 0)
    sizes = [64, 64, 128, 128]
    values = [[jnp.zeros((size,), x.dtype) for x in group] for size, group in zip(sizes, values)]
    q, k = jnp.zeros((64,), jnp.int32), jnp.zeros((128,), jnp.int32)
    score = jnp.zeros((64, 128)) if kind == "score" else None
    factor = []

    def run(score, q, k, values):
        out = staged.joint(score, jnp.int32(0), jnp.int32(0), q, k, *values, q_axis=0, scale=0.125,
                           max_position=max_position, split=kind == "score")  # fmt: skip
        if kind == "score":
            factor.append(out[1])
            return out[0]
        return out

    jaxpr = jax.make_jaxpr(run)(score, q, k, values)
    eqns = [e.primitive.name for e in jaxpr.eqns if e.outvars[0].aval.shape == (64, 128)]
    return [e for e in eqns if e != "broadcast_in_dim"], factor and factor[0]


def test_joint_folds_constants_and_keeps_vectors_until_they_meet():
    """Per logit, the vector form pays only for what meets the tile: a soft cap is one multiply (scale / cap) and
    a tanh, its cap left as the split factor; ALiBi converts the position vectors, not the tile (a subtract, an
    abs, a multiply-add with the slope pre-scaled on its vector); a per-key bias one multiply-add; a causal
    mask one compare. A conversion stays on the tile where float32 might not be exact (positions up to 2**24)."""
    assert _tile_equations(mods.soft_cap(4.0), "score", 1024) == (["mul", "tanh"], 4.0)
    assert _tile_equations(mods.alibi(SLOPES), "score", 1024) == (["sub", "abs", "mul", "add"], 0.125)
    bias = lambda s, b, h, q, k: s + KEY_BIAS[0, k % 40]  # noqa: E731
    assert _tile_equations(bias, "score", 1024) == (["mul", "add"], 1.0)
    assert _tile_equations(mods.causal(), "mask", 1024)[0] == ["le"]
    inexact = _tile_equations(lambda s, b, h, q, k: s + (k + q).astype(jnp.float32), "score", 1 << 24)[0]
    assert "convert_element_type" in inexact


@pytest.mark.parametrize("max_position", [(1 << 22) - 1, 1 << 22, 1 << 23])
def test_position_conversions_are_exact(max_position):
    """Position vectors become float32 exactly wherever float32 holds them: below 2**22 by an integer add and a
    float subtract (no conversion instruction beside the softmax's exp2), above it by a conversion."""
    fn = lambda s, b, h, q, k: s + (k - q).astype(jnp.float32) + (k + q).astype(jnp.float32)  # noqa: E731
    staged, _ = mods.stage(mods.trace(fn, "score")[0])
    top = max_position - 1
    q = jnp.asarray([0, 1, top // 2 + 1, top - 1, top], jnp.int32)
    k = jnp.asarray([top, top - 3, 7, 0, 1 << 21, top // 3, 2], jnp.int32)
    s = jnp.zeros((q.size, k.size), jnp.float32)

    def run(q, k):
        return staged.joint(s, jnp.int32(0), jnp.int32(0), q, k, q_axis=0, max_position=max_position)

    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    want = (k64[None, :] - q64[:, None]) + (k64[None, :] + q64[:, None])
    np.testing.assert_array_equal(np.asarray(run(q, k), np.float64), want)
    primitives = {e.primitive.name for e in jax.make_jaxpr(run)(q, k).eqns}
    biased = max_position < 1 << 22
    assert ("bitcast_convert_type" in primitives) == biased
    assert ("convert_element_type" in primitives) != biased


@pytest.mark.parametrize(
    "mask_mod, band",
    [
        (mods.causal(), dict(is_causal=True)),
        (mods.sliding_window(5, 3), dict(local_window_size=(5, 3))),
        (mods.sliding_window(6, None), dict(local_window_size=(6, None))),
        (mods.and_masks(mods.sliding_window(6, None), mods.causal()), dict(local_window_size=(6, 0))),
        (mods.and_masks(mods.sliding_window(9, 2), mods.sliding_window(4, 7)), dict(local_window_size=(4, 2))),
        (mods.sliding_window(None, None), dict()),
    ],
)
def test_band_mods_run_as_the_built_in_band(mask_mod, band):
    """The built-in band mask_mods (and their and_masks) run as the built-in band: the same traced computation as
    is_causal / local_window_size, forward and backward (no mask program reaches a kernel)."""
    q, k, v = (normal(i, (1, 40, 2, 16)) for i in range(3))

    def run(**kwargs):
        return lambda q, k, v: pf.flash_attention(q, k, v, implementation="xla_chunked", config=SMALL, **kwargs).sum()

    for fn in (lambda f: f, lambda f: jax.grad(f, (0, 1, 2))):
        assert str(jax.make_jaxpr(fn(run(mask_mod=mask_mod)))(q, k, v)) == str(jax.make_jaxpr(fn(run(**band)))(q, k, v))


def test_band_mods_intersect_the_band_given_and_others_stay_programs():
    """A band mask_mod with is_causal or a window given keeps the keys both allow; a band ANDed with a document mask
    (or a user's own window function) stays a mask program, with the same output as the band's."""
    q, k, v = (normal(i, (1, 40, 2, 16)) for i in range(3))
    attend = lambda **kw: pf.flash_attention(q, k, v, implementation="xla_chunked", config=SMALL, **kw)
    np.testing.assert_array_equal(
        attend(mask_mod=mods.sliding_window(6, 4), is_causal=True), attend(local_window_size=(6, 0))
    )
    np.testing.assert_array_equal(
        attend(mask_mod=mods.sliding_window(6, 4), local_window_size=(3, 9)), attend(local_window_size=(3, 4))
    )
    ids = jnp.asarray(np.repeat([[0, 1]], 20, axis=1), jnp.int32)
    assert not hasattr(mods.and_masks(mods.causal(), mods.document(ids)), "band")
    user_window = lambda b, h, qi, ki: (ki >= qi - 6) & (ki <= qi)
    assert_close(attend(mask_mod=user_window), attend(local_window_size=(6, 0)), jnp.float32)


@pytest.mark.parametrize(
    "fn, invariant",
    [
        (lambda s, b, h, q, k: s - 0.1 * jnp.abs(k - q).astype(jnp.float32), True),
        (lambda s, b, h, q, k: s + 0.1 * (q - k).astype(jnp.float32), True),
        (lambda s, b, h, q, k: s * 2.0, True),  # no position at all
        (lambda s, b, h, q, k: s + 0.01 * (k - 1).astype(jnp.float32), False),
        (lambda s, b, h, q, k: s - jnp.abs(q - 3).astype(jnp.float32), False),
        (lambda s, b, h, q, k: s + (q + k).astype(jnp.float32), False),
        (lambda s, b, h, q, k: s + jnp.where(k <= q, 0.0, -1.0), False),
    ],
)
def test_translation_invariant_programs_read_positions_only_as_their_difference(fn, invariant):
    """`Staged.translation_invariant`: true only where every use of q_idx or kv_idx is their difference (the
    kernels may then count both from any origin); a position beside a literal or alone is not."""
    staged, why = mods.stage(mods.trace(fn, "score")[0])
    assert why is None
    assert staged.translation_invariant == invariant
