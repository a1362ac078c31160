"""The Hopper kernels in JAX's Mosaic GPU CPU interpreter with race detection, against the float32 reference.

The interpreter cannot run wgmma on a transposed shared-memory ref or a register operand, so there the matmuls
are plain dots on the same shared-memory tiles (`interpreting` in the kernels); everything else (barriers, TMA
rings, schedules, band and segment block ranges, masks) is the kernels that run on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, masks, reference
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper.config import HopperBwdConfig, HopperConfig
from tests.helpers import (
    assert_gradients_close,
    interpreted_hopper_backward,
    make_backward_inputs,
    make_inputs,
    packed_ids,
    packed_segment_ids,
)
from tests.tolerances import assert_close

pytestmark = pytest.mark.interpreter


def interpret_params(**kwargs):
    params = _compat.mosaic_gpu_interpret_params(**kwargs)
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    return params


# ---- forward --------------------------------------------------------------------------------------------------


def run_forward(
    shape, *, is_causal=False, window=None, num_stages=2, persistent=True, q_ids=None, kv_ids=None, overlap=False
):
    """The Hopper forward on bf16 inputs in the interpreter with race detection, checked against the reference
    (zeros and lse = -inf where a row sees no key). Returns whether each row's lse is finite."""
    params = interpret_params(detect_races=True)
    q, k, v, _ = make_inputs(shape, jnp.bfloat16, seed=14)
    ids = (
        {}
        if q_ids is None
        else dict(q_segment_ids=jnp.asarray(q_ids, jnp.int32), kv_segment_ids=jnp.asarray(kv_ids, jnp.int32))
    )
    out, lse = hopper_fwd.hopper_forward(
        q,
        k,
        v,
        scale=0.125,
        is_causal=is_causal,
        local_window_size=window,
        config=HopperConfig(64, 64, num_stages, persistent, overlap),
        interpret=params,
        **ids,
    )
    assert not _compat.mosaic_gpu_races_found()
    ref_out, ref_lse = pf.attention_reference(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=0.125, band=masks.Band.of(is_causal, window), **ids
    )
    assert_close(out, ref_out, jnp.bfloat16)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(np.asarray(ref_lse))
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")
    np.testing.assert_array_equal(np.asarray(out)[~finite.transpose(0, 2, 1)], 0)
    return finite


# (shape, is_causal, window, num_stages, persistent) of the band cases; tiles are 128 query rows, key blocks 64.
BAND_CASES = {
    "ragged": ((1, 200, 130, 2, 1, 64), False, None, 2, True),  # the masked tail block; 3 blocks a tile
    "causal": ((1, 130, 200, 2, 1, 64), True, None, 3, True),  # diagonal blocks, reversed tile order, 6 a CTA
    "causal_per_tile_ctas": ((1, 130, 200, 2, 1, 64), True, None, 2, False),  # the same, one CTA per tile
    "window": ((1, 150, 150, 1, 1, 64), False, (40, 10), 2, True),  # both band edges, skipped blocks
    "empty_tiles": ((1, 256, 64, 1, 1, 64), False, (20, None), 2, True),  # tiles past every key: a masked block
}


def _length_ids(lengths, length, padding_id):
    return masks.segments_from_lengths(None, jnp.asarray(lengths), length, padding_id)


def segment_case(name):
    """(shape, is_causal, q_ids, kv_ids) of the segment-id cases; tiles are 128 query rows, key blocks 64."""
    if name == "packed":  # example 0: five documents, several per tile; 1: one document over tile 0's
        ids = np.stack([packed_ids(150, 20, 37, 90, 101), packed_ids(150, 140)])  # keys 0-127 (unmasked run)
        return (2, 150, 150, 1, 1, 64), False, ids, ids
    if name == "lengths":  # per-example lengths as padding ids (as `api._segments` folds them); GQA
        return (
            (2, 100, 150, 2, 1, 64),
            False,
            _length_ids([100, 37], 100, masks.QUERY_PADDING_ID),
            _length_ids([60, 150], 150, masks.KEY_PADDING_ID),
        )
    if name == "no_key":  # document 9 has no keys: rows 80-89 of tile 0, and all of tile 1 (visits no block)
        q_ids = packed_ids(256, 40, 100)
        q_ids[80:90] = q_ids[128:] = 9
        return (1, 256, 130, 1, 1, 64), False, q_ids[None], packed_ids(130, 40, 100)[None]
    assert name == "causal"
    ids = packed_ids(200, 20, 137)[None]
    return (1, 200, 200, 2, 1, 64), True, ids, ids


# Outside `slow`, each feature runs once in one of the two forwards (a run takes 3-8 s of CPU): the plain
# forward takes packed segments (several per tile, a same-segment unmasked run, ragged lengths, persistent
# CTAs carrying ring slots over tiles), causal segments (GQA, a 3-stage ring) and tiles that see no key under
# a band (empty_tiles); the overlapped one a window's two edges, a tile that visits no block (no_key) and one
# CTA per tile (causal_per_tile_ctas).
FAST_PLAIN = {"empty_tiles"}  # and, in the segment test, packed and causal_segments
FAST_OVERLAP = {"window", "no_key", "causal_per_tile_ctas"}


def _params(cases, fast):
    return [pytest.param(case, marks=() if case in fast else pytest.mark.slow) for case in cases]


@pytest.mark.parametrize("case", _params(BAND_CASES, FAST_PLAIN))
def test_hopper_forward_in_mosaic_gpu_interpreter(case):
    """The Hopper forward (barriers, TMA rings, ping-pong schedule, band ranges, masks). Persistent: two CTAs,
    each running several query tiles, whose K/V ring slots and barrier phases carry over from one tile to the
    next (block counts per tile that are not multiples of the ring depth catch a ring that restarts per tile:
    it hangs or reads the wrong block). Segment ids: the sibling test below."""
    shape, is_causal, window, num_stages, persistent = BAND_CASES[case]
    finite = run_forward(shape, is_causal=is_causal, window=window, num_stages=num_stages, persistent=persistent)
    if case == "empty_tiles":
        assert (~finite).any(), "this case is meant to contain rows that see no key"


@pytest.mark.parametrize(
    "name, num_stages, persistent",
    [
        pytest.param("packed", 2, True, marks=pytest.mark.slow),  # CI's time: causal_segments stays
        pytest.param("lengths", 2, False, marks=pytest.mark.slow),
        pytest.param("no_key", 2, True, marks=pytest.mark.slow),
        pytest.param("causal", 3, True, id="causal_segments"),
    ],
)
def test_hopper_forward_segments_in_mosaic_gpu_interpreter(name, num_stages, persistent):
    """Segment ids: the tile's block range from `segment_block_ranges` (read as scalars from global memory),
    the key ids riding the K ring, the id mask, the unmasked same-segment run, rows and whole tiles that see no
    key (zeros, lse = -inf), and segments under a causal band."""
    shape, is_causal, q_ids, kv_ids = segment_case(name)
    finite = run_forward(
        shape, is_causal=is_causal, num_stages=num_stages, persistent=persistent, q_ids=q_ids, kv_ids=kv_ids
    )
    if name in ("lengths", "no_key"):
        assert (~finite).any(), "this case is meant to contain rows that see no key"


@pytest.mark.parametrize(
    "case",
    _params(["ragged", "causal", "causal_per_tile_ctas", "window", "empty_tiles", "packed", "no_key"], FAST_OVERLAP),
)
def test_overlapped_hopper_forward_in_mosaic_gpu_interpreter(case):
    """`HopperConfig.overlap` (S_j issued before P_{j-1} V_{j-1}, block j's softmax under that P V; the first
    block peeled off and masked; V slots released a step later) on the cases above."""
    if case in BAND_CASES:
        shape, is_causal, window, num_stages, persistent = BAND_CASES[case]
        run_forward(
            shape, is_causal=is_causal, window=window, num_stages=num_stages, persistent=persistent, overlap=True
        )
    else:
        shape, is_causal, q_ids, kv_ids = segment_case(case)
        run_forward(shape, is_causal=is_causal, q_ids=q_ids, kv_ids=kv_ids, overlap=True)


# ---- backward -------------------------------------------------------------------------------------------------

BACKWARD_CASES = {  # (shape, is_causal, window, segments)
    "ragged_gqa": ((1, 200, 150, 2, 1, 64), False, None, False),  # ragged, q_len > kv_len, GQA; both rings wrap
    "causal": ((1, 100, 150, 2, 1, 64), True, None, False),  # causal, q_len < kv_len: a dK/dV tile no query sees
    "window": ((1, 200, 120, 1, 1, 64), False, (40, 10), False),  # both band edges; rows 160.. see no key
    "segments": ((2, 130, 130, 1, 1, 64), True, None, True),  # segment ids: one example packed, one single
}
PIPELINING = {"plain": {}, "dq_overlap": dict(dq_overlap=True), "dkv_overlap": dict(dkv_overlap=True, num_stages_dkv=3)}
# Outside `slow` (a run takes 4-13 s of CPU): the plain passes on segments and dK/dV's pipelining on causal rows; the
# window's backward runs in test_dense_mods (through flash_attention, with a dense bias and mask), dQ's pipelining
# lowers in test_lowering and runs on the GPU.
FAST_BACKWARD = {("plain", "segments"), ("dkv_overlap", "causal")}


@pytest.mark.parametrize(
    "case, pipelining",
    [
        pytest.param(
            case,
            pipelining,
            id=f"{pipelining}-{case}",
            marks=() if (pipelining, case) in FAST_BACKWARD else pytest.mark.slow,
        )
        for pipelining in PIPELINING
        for case in BACKWARD_CASES
    ],
)
def test_backward_in_mosaic_gpu_interpreter(case, pipelining):
    """The dK/dV and dQ kernels (barriers, TMA rings, band and segment block ranges, masks, padded rows and
    keys, the GQA head loop) from the reference's residuals, against the reference's gradients. (The one-pass
    dq_atomic kernel cannot run there: no mutable-array argument, no TMA reduce-add.) dq_overlap: the dQ
    kernel's pipelined steps, with its peeled first block, the last product after the loop and key blocks
    released a step later; dkv_overlap: the dK/dV kernel's, with its zero first product, the last one after
    the loop (or none, for the causal case's tile that no query sees) and query blocks released a step later."""
    shape, is_causal, window, segments = BACKWARD_CASES[case]
    params = interpret_params(detect_races=True)
    q, k, v, d_out, d_lse = make_backward_inputs(shape, jnp.bfloat16, seed=3)
    batch, q_len, kv_len = shape[:3]
    ids = dict(q_segment_ids=None, kv_segment_ids=None)
    if segments:
        ids = dict(
            q_segment_ids=packed_segment_ids(batch, q_len, [[70], []]),
            kv_segment_ids=packed_segment_ids(batch, kv_len, [[60], []]),
        )
    scale = 0.125
    (out, lse), vjp = jax.vjp(
        lambda *x: reference.attention_reference(*x, scale=scale, band=masks.Band.of(is_causal, window), **ids),
        *(x.astype(jnp.float32) for x in (q, k, v)),
    )
    want = vjp((d_out.astype(jnp.float32), d_lse))
    grads = interpreted_hopper_backward(
        q, k, v, out.astype(q.dtype), lse, d_out, d_lse,
        scale=scale, is_causal=is_causal, local_window_size=window,
        config=HopperBwdConfig(**PIPELINING[pipelining]), interpret=params, **ids,
    )  # fmt: skip
    assert_gradients_close(grads, want, (q, k, v))
    if window is not None:
        assert np.isneginf(lse).any(), "this case is meant to contain rows that see no key"


def test_dq_atomic_is_refused_in_the_interpreter():
    params = interpret_params()
    x = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="dq_atomic"):
        hopper_bwd.hopper_backward(
            x,
            x,
            x,
            x,
            jnp.zeros((1, 1, 64)),
            x,
            None,
            scale=1.0,
            config=HopperBwdConfig(dq_atomic=True),
            interpret=params,
        )
