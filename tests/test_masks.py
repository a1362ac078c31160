"""Segment ids, per-example lengths and local windows: their semantics in every implementation, forward and
backward, against the float32 reference given the same masks (and an independent oracle, jax.nn)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import device, masks
from tests.helpers import check_masked_against_reference, make_inputs, random_segment_ids
from tests.tolerances import assert_close


def _cases():
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    return {
        # packed sequences, self-attention
        "segments": dict(shape=(2, 70, 70, 4, 2, 32), kwargs=dict(segment_ids=random_segment_ids(k1, 2, 70, 4))),
        # q and kv ids differ; query segment 3 has no keys: fully masked rows
        "segments_cross": dict(
            shape=(2, 45, 61, 2, 1, 16),
            kwargs=dict(segment_ids=random_segment_ids(k2, 2, 45, 4), kv_segment_ids=random_segment_ids(k3, 2, 61, 3)),
        ),
        # per-example padding; example 1 has no keys at all
        "lengths": dict(
            shape=(2, 50, 70, 4, 2, 32),
            kwargs=dict(query_seq_lengths=jnp.array([37, 50]), key_value_seq_lengths=jnp.array([53, 0])),
        ),
        "window": dict(shape=(1, 90, 90, 2, 2, 16), kwargs=dict(local_window_size=(20, 9))),
        "window_left_only": dict(shape=(1, 70, 50, 2, 1, 16), kwargs=dict(local_window_size=(17, None))),
    }


CASES = _cases()
# (case, is_causal) of the portable kernels behind `slow`: each case runs there once, with the causality
# that adds the most (rows with no key appear either way).
PALLAS_SLOW = {
    ("segments", True),
    ("segments_cross", False),
    ("lengths", True),
    ("window", False),
    ("window_left_only", True),
}


def _grid():
    params = []
    for case in CASES:
        for is_causal in (False, True):
            for impl in ("pallas", "xla_chunked"):
                marks = [pytest.mark.slow] if impl == "pallas" and (case, is_causal) in PALLAS_SLOW else []
                params.append(pytest.param(case, is_causal, impl, marks=marks, id=f"{case}-{is_causal}-{impl}"))
    return params


@pytest.mark.parametrize("case, is_causal, impl", _grid())
def test_mask_feature_against_reference(case, is_causal, impl):
    shape, kwargs = CASES[case]["shape"], CASES[case]["kwargs"]
    empty = check_masked_against_reference(impl, shape, kwargs, is_causal)
    if case in ("segments_cross", "lengths"):
        assert empty.any(), "this case is meant to contain fully masked rows"


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [None, (6, 3), (4, 0)])
def test_mask_semantics_match_jax_nn(window, is_causal):
    """An independent oracle for the semantics: jax.nn.dot_product_attention with the same window and
    lengths (compared on rows that see at least one key; jax.nn does not zero the others)."""
    q, k, v, _ = make_inputs((2, 30, 30, 2, 2, 16), jnp.float32, seed=9)
    q_lengths, kv_lengths = jnp.array([30, 21], jnp.int32), jnp.array([25, 30], jnp.int32)
    ours = pf.flash_attention(
        q,
        k,
        v,
        is_causal=is_causal,
        local_window_size=window,
        query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths,
        implementation="xla",
    )
    theirs = jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=is_causal,
        local_window_size=window,
        query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths,
        implementation="xla",
    )
    left, right = (None, None) if window is None else window
    right = 0 if is_causal else right
    pos = np.arange(30)
    seen = pos[None, None, :] < np.asarray(kv_lengths)[:, None, None]  # [batch, q, k]
    if left is not None:
        seen = seen & (pos[None, None, :] >= pos[None, :, None] - left)
    if right is not None:
        seen = seen & (pos[None, None, :] <= pos[None, :, None] + right)
    valid = (pos[None, :] < np.asarray(q_lengths)[:, None]) & seen.any(axis=2)
    assert_close(np.asarray(ours)[valid], np.asarray(theirs)[valid], jnp.float32)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(segment_ids=jnp.zeros((2, 8), jnp.float32)), TypeError, "segment_ids must be an integer array"),
        (dict(segment_ids=jnp.zeros((2, 9), jnp.int32)), ValueError, r"segment_ids must have shape \(2, 8\)"),
        (dict(kv_segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, "needs segment_ids"),
        (dict(query_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError, r"query_seq_lengths must have shape \(2,\)"),
        (dict(local_window_size=(3, -1)), ValueError, "local_window_size must be"),
        (dict(local_window_size="wide"), ValueError, "local_window_size must be"),
    ],
)
def test_bad_mask_arguments_are_named(kwargs, error, words):
    q = jnp.ones((2, 8, 2, 16))
    with pytest.raises(error, match=words):
        pf.flash_attention(q, q, q, **kwargs)


def test_kv_segment_ids_required_for_cross_attention():
    q, k = jnp.ones((1, 8, 2, 16)), jnp.ones((1, 5, 2, 16))
    with pytest.raises(ValueError, match="kv_segment_ids is required"):
        pf.flash_attention(q, k, k, segment_ids=jnp.zeros((1, 8), jnp.int32))


# ---- the Hopper kernels ("mosaic"): dispatch on CPU, semantics on sm90 ----------------------------------------


def test_hopper_kernels_are_chosen_for_mask_features(monkeypatch):
    """Forcing "mosaic" with a window, segment ids and lengths reaches the Hopper kernels with the band and
    the folded ids (no refusal, no fallback). The GPU check and the kernels are faked: this is dispatch."""
    from pallas_flash.hopper import vjp as hopper_vjp

    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    calls = []

    def fake_hopper(query, key, value, **kwargs):  # traced: flash_attention compiles its call
        ids = {name: kwargs.pop(name) for name in ("q_segment_ids", "kv_segment_ids")}
        jax.debug.callback(lambda **ids: calls.append(dict(kwargs, **ids)), **ids)
        return jnp.zeros_like(query), jnp.zeros((query.shape[0], query.shape[2], query.shape[1]))

    monkeypatch.setattr(hopper_vjp, "flash_attention_hopper", fake_hopper)
    q = jnp.ones((2, 32, 2, 64), jnp.bfloat16)
    jax.block_until_ready(
        pf.flash_attention(
            q,
            q,
            q,
            implementation="mosaic",
            is_causal=True,
            local_window_size=(8, 4),
            segment_ids=jnp.zeros((2, 32), jnp.int32),
            key_value_seq_lengths=jnp.array([32, 20]),
        )
    )
    jax.effects_barrier()
    (call,) = calls
    assert call["band"] == masks.Band(8, 0)
    np.testing.assert_array_equal(call["kv_segment_ids"][1, 20:], masks.KEY_PADDING_ID)
    np.testing.assert_array_equal(call["kv_segment_ids"][:, :20], 0)
    np.testing.assert_array_equal(call["q_segment_ids"], 0)


def _gpu_cases():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(11), 4)
    return {
        # several packed sequences per example, across tile boundaries
        "segments": dict(shape=(2, 1000, 1000, 4, 2, 128), kwargs=dict(segment_ids=random_segment_ids(k1, 2, 1000, 5))),
        # q and kv ids differ; query segment 3 has no keys: fully masked rows
        "segments_cross": dict(
            shape=(2, 777, 1531, 4, 1, 64),
            kwargs=dict(
                segment_ids=random_segment_ids(k2, 2, 777, 4), kv_segment_ids=random_segment_ids(k3, 2, 1531, 3)
            ),
        ),
        # per-example padding; example 1 has no keys, example 2 no queries
        "lengths": dict(
            shape=(3, 1100, 1300, 4, 2, 64),
            kwargs=dict(query_seq_lengths=jnp.array([1100, 517, 0]), key_value_seq_lengths=jnp.array([1300, 0, 700])),
        ),
        # a window narrower than a tile: blocks outside it are skipped, both edges masked
        "window": dict(shape=(1, 1531, 1531, 4, 4, 128), kwargs=dict(local_window_size=(300, 77))),
        # rows past kv_len + 200 see no key: whole query tiles visit one fully masked block
        "window_left_only": dict(shape=(1, 2048, 1024, 4, 2, 64), kwargs=dict(local_window_size=(200, None))),
        "window_and_segments": dict(
            shape=(2, 1200, 1200, 4, 2, 128),
            kwargs=dict(local_window_size=(256, 0), segment_ids=random_segment_ids(k4, 2, 1200, 3)),
        ),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    "case", ["segments", "segments_cross", "lengths", "window", "window_left_only", "window_and_segments"]
)
def test_hopper_mask_feature_against_reference(case, is_causal):
    """The Hopper forward and backward (`implementation="mosaic"`, default tiles: those of an unmasked call
    of the shape, the overlap at head_dim 128) with each mask feature: outputs, LSE and gradients against the
    float32 reference; rows that see nothing give zeros and lse = -inf."""
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    shape, kwargs = (_gpu_cases()[case][name] for name in ("shape", "kwargs"))
    dtype = jnp.float16 if case == "lengths" else jnp.bfloat16
    empty = check_masked_against_reference("mosaic", shape, kwargs, is_causal, dtype=dtype, config=None, seed=12)
    if case in ("segments_cross", "lengths", "window_left_only"):
        assert empty.any(), "this case is meant to contain fully masked rows"
