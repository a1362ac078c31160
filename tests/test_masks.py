"""Segment ids, per-example lengths and local windows, in every implementation, forward and backward."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import masks
from tests.test_attention import SMALL_BLOCKS, make_inputs
from tests.tolerances import GRADIENT, assert_close

IMPLEMENTATIONS = ["pallas", "xla_chunked"]


def _segment_ids(key, batch, length, num_segments):
    """Sorted random segment ids (packed sequences) [batch, length]."""
    return jnp.sort(jax.random.randint(key, (batch, length), 0, num_segments), axis=1).astype(jnp.int32)


def _cases():
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    return {
        # packed sequences, self-attention
        "segments": dict(shape=(2, 70, 70, 4, 2, 32), kwargs=dict(segment_ids=_segment_ids(k1, 2, 70, 4))),
        # q and kv ids differ; query segment 3 has no keys: fully masked rows
        "segments_cross": dict(shape=(2, 45, 61, 2, 1, 16), kwargs=dict(
            segment_ids=_segment_ids(k2, 2, 45, 4), kv_segment_ids=_segment_ids(k3, 2, 61, 3))),
        # per-example padding; example 1 has no keys at all
        "lengths": dict(shape=(2, 50, 70, 4, 2, 32), kwargs=dict(
            query_seq_lengths=jnp.array([37, 50]), key_value_seq_lengths=jnp.array([53, 0]))),
        "window": dict(shape=(1, 90, 90, 2, 2, 16), kwargs=dict(local_window_size=(20, 9))),
        "window_left_only": dict(shape=(1, 70, 50, 2, 1, 16), kwargs=dict(local_window_size=(17, None))),
    }


CASES = _cases()


def _reference_mask_args(shape, kwargs, is_causal):
    """The reference's band and segment ids for a case, built through the public API's own folding."""
    q, k, _, _ = make_inputs(shape, jnp.float32, 0)
    from pallas_flash import api
    window = api._check_window(kwargs.get("local_window_size"))
    q_ids, kv_ids = api._segments(q, k, kwargs.get("segment_ids"), kwargs.get("kv_segment_ids"),
                                  kwargs.get("query_seq_lengths"), kwargs.get("key_value_seq_lengths"))
    return dict(band=masks.Band.of(is_causal, window), q_segment_ids=q_ids, kv_segment_ids=kv_ids)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_mask_feature_against_reference(case, is_causal, impl):
    shape, kwargs = CASES[case]["shape"], CASES[case]["kwargs"]
    q, k, v, cotangent = make_inputs(shape, jnp.float32, seed=8)
    ours = functools.partial(pf.flash_attention, is_causal=is_causal, implementation=impl, config=SMALL_BLOCKS,
                             return_lse=True, **kwargs)
    scale = shape[-1] ** -0.5
    ref = functools.partial(pf.attention_reference, scale=scale, **_reference_mask_args(shape, kwargs, is_causal))
    out, lse = ours(q, k, v)
    ref_out, ref_lse = ref(q, k, v)
    assert_close(out, ref_out, jnp.float32)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))  # the same rows see nothing
    finite = np.isfinite(np.asarray(ref_lse))
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")
    # Rows that see no key: exact zeros.
    empty = np.asarray(np.isneginf(ref_lse)).transpose(0, 2, 1)  # [batch, q_len, heads]
    assert np.all(np.asarray(out)[empty] == 0.0)
    if case in ("segments_cross", "lengths"):
        assert empty.any(), "this case is meant to contain fully masked rows"

    loss = lambda fn, q, k, v: jnp.sum(fn(q, k, v)[0] * cotangent)
    grads = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, jnp.float32, table=GRADIENT, what=f"d{name}")


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [None, (6, 3), (4, 0)])
def test_mask_semantics_match_jax_nn(window, is_causal):
    """An independent oracle for the semantics: jax.nn.dot_product_attention with the same window and
    lengths (compared on rows that see at least one key; jax.nn does not zero the others)."""
    q, k, v, _ = make_inputs((2, 30, 30, 2, 2, 16), jnp.float32, seed=9)
    q_lengths, kv_lengths = jnp.array([30, 21], jnp.int32), jnp.array([25, 30], jnp.int32)
    ours = pf.flash_attention(q, k, v, is_causal=is_causal, local_window_size=window, query_seq_lengths=q_lengths,
                              key_value_seq_lengths=kv_lengths, implementation="xla")
    theirs = jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, local_window_size=window,
                                          query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
                                          implementation="xla")
    left, right = (None, None) if window is None else window
    right = 0 if is_causal else right
    pos = np.arange(30)
    seen = (pos[None, None, :] < np.asarray(kv_lengths)[:, None, None])  # [batch, q, k]
    if left is not None:
        seen = seen & (pos[None, None, :] >= pos[None, :, None] - left)
    if right is not None:
        seen = seen & (pos[None, None, :] <= pos[None, :, None] + right)
    valid = (pos[None, :] < np.asarray(q_lengths)[:, None]) & seen.any(axis=2)
    assert_close(np.asarray(ours)[valid], np.asarray(theirs)[valid], jnp.float32)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(segment_ids=jnp.zeros((2, 8), jnp.float32)), TypeError, "segment_ids must be an integer array"),
    (dict(segment_ids=jnp.zeros((2, 9), jnp.int32)), ValueError, r"segment_ids must have shape \(2, 8\)"),
    (dict(kv_segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, "needs segment_ids"),
    (dict(query_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError, r"query_seq_lengths must have shape \(2,\)"),
    (dict(local_window_size=(3, -1)), ValueError, "local_window_size must be"),
    (dict(local_window_size="wide"), ValueError, "local_window_size must be"),
])
def test_bad_mask_arguments_are_named(kwargs, error, words):
    q = jnp.ones((2, 8, 2, 16))
    with pytest.raises(error, match=words):
        pf.flash_attention(q, q, q, **kwargs)


def test_kv_segment_ids_required_for_cross_attention():
    q, k = jnp.ones((1, 8, 2, 16)), jnp.ones((1, 5, 2, 16))
    with pytest.raises(ValueError, match="kv_segment_ids is required"):
        pf.flash_attention(q, k, k, segment_ids=jnp.zeros((1, 8), jnp.int32))


# ---- the Hopper kernels (sm90): window, segment ids and lengths, forward and backward ----------------------

def _gpu_cases():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(11), 4)
    return {
        # several packed sequences per example, across tile boundaries
        "segments": dict(shape=(2, 1000, 1000, 4, 2, 128), kwargs=dict(segment_ids=_segment_ids(k1, 2, 1000, 5))),
        # q and kv ids differ; query segment 3 has no keys: fully masked rows
        "segments_cross": dict(shape=(2, 777, 1531, 4, 1, 64), kwargs=dict(
            segment_ids=_segment_ids(k2, 2, 777, 4), kv_segment_ids=_segment_ids(k3, 2, 1531, 3))),
        # per-example padding; example 1 has no keys, example 2 no queries
        "lengths": dict(shape=(3, 1100, 1300, 4, 2, 64), kwargs=dict(
            query_seq_lengths=jnp.array([1100, 517, 0]), key_value_seq_lengths=jnp.array([1300, 0, 700]))),
        # a window narrower than a tile: blocks outside it are skipped, both edges masked
        "window": dict(shape=(1, 1531, 1531, 4, 4, 128), kwargs=dict(local_window_size=(300, 77))),
        # rows past kv_len + 200 see no key: whole query tiles visit one fully masked block
        "window_left_only": dict(shape=(1, 2048, 1024, 4, 2, 64), kwargs=dict(local_window_size=(200, None))),
        "window_and_segments": dict(shape=(2, 1200, 1200, 4, 2, 128), kwargs=dict(
            local_window_size=(256, 0), segment_ids=_segment_ids(k4, 2, 1200, 3))),
    }


GPU_CASES = _gpu_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_hopper_mask_feature_against_reference(case, is_causal):
    """The Hopper forward and backward (`implementation="mosaic"`, default tiles: those of an unmasked call
    of the shape, the overlap at head_dim 128) with each mask feature: outputs, LSE and gradients against the
    float32 reference; rows that see nothing give zeros and lse = -inf."""
    from pallas_flash.kernels import hopper
    if not hopper.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    shape, kwargs = GPU_CASES[case]["shape"], GPU_CASES[case]["kwargs"]
    dtype = jnp.float16 if case == "lengths" else jnp.bfloat16
    q, k, v, cotangent = make_inputs(shape, dtype, seed=12)
    ours = functools.partial(pf.flash_attention, is_causal=is_causal, implementation="mosaic", return_lse=True,
                             **kwargs)
    ref = functools.partial(pf.attention_reference, scale=shape[-1] ** -0.5,
                            **_reference_mask_args(shape, kwargs, is_causal))
    f32 = [x.astype(jnp.float32) for x in (q, k, v, cotangent)]
    out, lse = ours(q, k, v)
    ref_out, ref_lse = ref(*f32[:3])
    assert_close(out, ref_out, dtype)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))  # the same rows see nothing
    finite = np.isfinite(np.asarray(ref_lse))
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")
    empty = np.asarray(np.isneginf(ref_lse)).transpose(0, 2, 1)  # [batch, q_len, heads]
    assert np.all(np.asarray(out)[empty] == 0.0)
    if case in ("segments_cross", "lengths", "window_left_only"):
        assert empty.any(), "this case is meant to contain fully masked rows"

    loss = lambda fn, q, k, v: jnp.sum(fn(q, k, v)[0].astype(jnp.float32) * f32[3])
    grads = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(*f32[:3])
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, dtype, table=GRADIENT, what=f"d{name}")


def test_hopper_kernels_are_chosen_for_mask_features(monkeypatch):
    """Forcing "mosaic" with a window, segment ids and lengths reaches the Hopper kernels with the band and
    the folded ids (no refusal, no fallback). The GPU check and the kernels are faked: this is dispatch."""
    from pallas_flash.kernels import hopper
    monkeypatch.setattr(hopper, "on_hopper_gpu", lambda: True)
    calls = []

    def fake_hopper(query, key, value, **kwargs):
        calls.append(kwargs)
        return jnp.zeros_like(query), jnp.zeros((query.shape[0], query.shape[2], query.shape[1]))

    monkeypatch.setattr(hopper, "flash_attention_hopper", fake_hopper)
    q = jnp.ones((2, 32, 2, 64), jnp.bfloat16)
    pf.flash_attention(q, q, q, implementation="mosaic", is_causal=True, local_window_size=(8, 4),
                       segment_ids=jnp.zeros((2, 32), jnp.int32), key_value_seq_lengths=jnp.array([32, 20]))
    (call,) = calls
    assert call["band"] == masks.Band(8, 0)
    np.testing.assert_array_equal(call["kv_segment_ids"][1, 20:], masks.KEY_PADDING_ID)
    np.testing.assert_array_equal(call["q_segment_ids"], 0)


@pytest.mark.parametrize("sort", [True, False])
def test_segment_block_ranges_cover_every_meeting(sort):
    """The Hopper kernels visit only the key blocks `segment_block_ranges` names for a query tile: every
    (tile, block) pair that shares a segment id must be inside it, and for sorted ids (packed sequences,
    lengths) it must be exactly the first to the last such block. Blocks they visit unmasked (the
    same-segment run) must hold only the tile's one id, as the tile must; for sorted ids, all such blocks."""
    from pallas_flash.kernels import hopper_fwd
    rows, cols, tile, block = 96, 80, 16, 8
    k1, k2 = jax.random.split(jax.random.key(5))
    q_ids = jax.random.randint(k1, (3, rows), 0, 3 if sort else 6)
    kv_ids = jax.random.randint(k2, (3, cols), 1, 4 if sort else 7)
    if sort:
        q_ids, kv_ids = jnp.sort(q_ids, axis=1), jnp.sort(kv_ids, axis=1)
    # Padding past per-example lengths, as the kernels' wrappers pad.
    q_ids = jnp.where(jnp.arange(rows) < jnp.array([96, 40, 0])[:, None], q_ids, masks.QUERY_PADDING_ID)
    kv_ids = jnp.where(jnp.arange(cols) < jnp.array([80, 80, 30])[:, None], kv_ids, masks.KEY_PADDING_ID)
    ranges = np.asarray(hopper_fwd.segment_block_ranges(q_ids, kv_ids, rows_per_tile=tile, cols_per_block=block))
    assert ranges.shape == (3, rows // tile, 4)
    q_tiles = np.asarray(q_ids).reshape(3, rows // tile, tile)
    kv_blocks = np.asarray(kv_ids).reshape(3, cols // block, block)
    same_runs = 0
    for b in range(3):
        for t in range(rows // tile):
            same = [j for j in range(cols // block)
                    if len(set(q_tiles[b, t]) | set(kv_blocks[b, j])) == 1 and q_tiles[b, t, 0] >= 0]
            same_lo, same_hi = ranges[b, t, 2:]
            assert set(range(same_lo, same_hi)) <= set(same), (b, t)
            if sort:
                assert list(range(same_lo, same_hi)) == same, (b, t)
            same_runs += same_hi > same_lo
    if sort:
        assert same_runs, "the sorted case is meant to have same-segment blocks"
    meets = (np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :])  # [batch, rows, cols]
    meets = meets.reshape(3, rows // tile, tile, cols // block, block).any(axis=(2, 4))  # [batch, tiles, blocks]
    for b in range(3):
        for t in range(rows // tile):
            lo, hi = ranges[b, t, :2]
            hit = np.flatnonzero(meets[b, t])
            if sort:
                expected = (hit[0], hit[-1] + 1) if hit.size else (0, 0)
                assert (lo, hi) == expected, (b, t)
            else:
                assert all(lo <= j < hi for j in hit), (b, t)
    assert (ranges[2] == 0).all()  # example 2 has no queries
