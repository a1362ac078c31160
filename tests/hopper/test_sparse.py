"""Block skipping for a dense mask and the `BlockMask` in the Hopper kernels: the kernels in JAX's Mosaic GPU
interpreter (race detection on) against the float32 reference, the block classes and the rule that says whether a
block mask's ranges alone serve it, their lowering for CUDA, and on an H100 the public API and its gradients.

Interpreter tiles are the smallest the kernels take: 128 query rows (two consumers of 64) and 64-key blocks in the
forward and the dQ pass, 128 keys and 64-query blocks in the dK/dV pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, device, masks, reference
from pallas_flash.block_sparse import BlockMask, exact_by_ranges, tile_classes
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper import vjp as hopper_vjp
from pallas_flash.hopper.common import mask_block_ranges, narrow_to_mask_ranges
from pallas_flash.hopper.config import HopperBwdConfig, HopperConfig
from tests.helpers import (
    MOSAIC_CALL,
    abstract_inputs,
    assert_gradients_close,
    interpreted_hopper_backward,
    lower_for_cuda,
    make_backward_inputs,
    make_inputs,
    packed_ids,
)
from tests.tolerances import GRADIENT, assert_close

SCALE = 0.125


def _interpreter(detect_races: bool = True):
    return _compat.mosaic_gpu_interpret_params(detect_races=detect_races) or pytest.skip("no interpreter")


# ---- a dense mask: its blocks skipped -----------------------------------------------------------------------------


def _document_mask(q_len: int, kv_len: int, *, doc: int, keys_seen: int):
    """bool [1, 1, q_len, kv_len]: documents of `doc` tokens, keys from `keys_seen` on hidden from every query (so
    queries of the documents past them see no key at all), and query 5 sees none."""
    q, k = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    mask = (q // doc == k // doc) & (k < keys_seen)
    mask[5] = False
    return jnp.asarray(mask[None, None])


def _poisoned(x, hidden):
    """x [batch, kv_len, kv_heads, d] with NaN at the key positions `hidden` (bool [kv_len]): a kernel that loads
    any of them poisons what it computes, even where it masks them (0 * NaN)."""
    return jnp.where(jnp.asarray(hidden)[None, :, None, None], jnp.nan, x).astype(x.dtype)


def _check_poisoned_keys(shape, mask, hidden, *, seed: int):
    """Forward and both backward passes (interpreter, race detection on) with NaN keys and values at `hidden` (bool
    [kv_len]) under a dense `mask` that hides them from every query, against the reference on finite keys: the
    outputs and gradients match only if no kernel loaded a block of theirs. Returns (lse, the reference's lse)."""
    q, k, v, d_out, d_lse = make_backward_inputs(shape, jnp.bfloat16, seed=seed)
    params = _interpreter()
    out, lse = hopper_fwd.hopper_forward(
        q, _poisoned(k, hidden), _poisoned(v, hidden), scale=SCALE, config=HopperConfig(64, 64), mask=mask,
        interpret=params,
    )  # fmt: skip
    assert not _compat.mosaic_gpu_races_found()
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (ref_out, ref_lse), vjp = jax.vjp(lambda q, k, v: reference.attention_reference(q, k, v, scale=SCALE, mask=mask),
                                      *f32)  # fmt: skip
    assert_close(out, ref_out, jnp.bfloat16)
    empty = np.isneginf(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.asarray(out, np.float32)[empty.transpose(0, 2, 1)], 0)
    dq, dk, dv, _, _ = interpreted_hopper_backward(
        q, _poisoned(k, hidden), _poisoned(v, hidden), ref_out.astype(q.dtype), ref_lse, d_out, d_lse,
        scale=SCALE, config=HopperBwdConfig(), mask=mask, interpret=params,
    )  # fmt: skip
    assert_gradients_close((dq, dk, dv), vjp((d_out.astype(jnp.float32), d_lse)))
    return lse, ref_lse


@pytest.mark.interpreter
def test_dense_mask_skips_the_blocks_it_hides():
    """A document mask given as a dense mask: keys 128.. are hidden from every query, so no forward or dQ tile
    visits their key blocks and no dK/dV tile their query blocks; they hold NaN keys and values, which poison any
    result a kernel computes after loading them. Forward and gradients match the reference (computed on finite
    keys) with GQA, ragged query rows and rows that see no key (zeros, lse = -inf, finite gradients)."""
    mask = _document_mask(250, 250, doc=50, keys_seen=128)
    lse, ref_lse = _check_poisoned_keys((1, 250, 250, 2, 1, 64), mask, np.arange(250) >= 128, seed=41)
    empty = np.isneginf(np.asarray(ref_lse))
    assert empty[:, :, 5].all() and empty[:, :, 150:].all()
    np.testing.assert_array_equal(np.isneginf(lse), empty)


def test_dense_mask_ranges_leave_out_the_hidden_blocks():
    """The forward's block ranges of a dense document mask: each 128-row query tile visits only the 64-key blocks
    of its documents, and those wholly inside one document need no mask tile."""
    mask = _document_mask(256, 256, doc=128, keys_seen=256)
    (_, _, ranges) = hopper_fwd.sparse_operands(
        (None, None, None), mask, None, HopperConfig(64, 64), q_len=256, kv_len=256, q_pad=256, kv_pad=256
    )
    # tile 0 holds query 5 (sees nothing): its blocks are visited, but not wholly visible
    np.testing.assert_array_equal(np.asarray(ranges)[0, 0], [[0, 2, 0, 0, 0, 0], [2, 4, 2, 4, 0, 0]])


def _global_and_recent_mask(q_len: int, kv_len: int, *, global_keys: int, recent_from: int):
    """bool [1, 1, q_len, kv_len]: every query sees the first `global_keys` keys and those from `recent_from` on."""
    k = np.arange(kv_len)[None, :]
    mask = np.broadcast_to((k < global_keys) | (k >= recent_from), (q_len, kv_len))
    return jnp.asarray(mask[None, None])


@pytest.mark.interpreter
def test_dense_mask_gap_is_never_loaded():
    """Global keys and recent keys (a gap of hidden key blocks between them in every query tile's range): the
    forward and the dQ pass step over the gap, so its NaN keys and values (which poison anything a kernel computes
    after loading them, even masked) leave outputs and gradients equal to the reference's; ragged query rows and
    a ragged last key block."""
    mask = _global_and_recent_mask(200, 500, global_keys=16, recent_from=384)
    (_, _, ranges) = hopper_fwd.sparse_operands(
        (None, None, None), mask, None, HopperConfig(64, 64), q_len=200, kv_len=500, q_pad=256, kv_pad=512
    )
    # blocks 1-5 hold no visible key: the gap; 6-7 are wholly visible (the ragged tail's padding counts as such)
    np.testing.assert_array_equal(np.asarray(ranges)[0, 0], [[0, 8, 6, 8, 1, 6]] * 2)
    hidden = (np.arange(500) >= 128) & (np.arange(500) < 384)  # the dK/dV pass's key tiles 1-2 see nothing
    lse, ref_lse = _check_poisoned_keys((1, 200, 500, 1, 1, 64), mask, hidden, seed=43)
    assert_close(lse, ref_lse, jnp.float32, what="lse")


def test_block_ranges_gap_is_the_longest_hidden_run():
    """`mask_block_ranges` names the longest run of wholly visible blocks (unmasked) and the longest run of blocks
    with nothing visible strictly inside a tile's range (none where there is no such run), and
    `narrow_to_mask_ranges` keeps the latter inside the range a band or segments narrow it to, narrowing the range
    instead where the gap reaches one of its edges."""
    rows = np.array(
        [
            [1, 0, 0, 1, 1, 0, 1, 0],  # runs [1, 3) and [5, 6): the first
            [0, 1, 0, 1, 0, 0, 0, 1],  # runs [2, 3) and [4, 7)
            [0, 1, 1, 1, 0, 0, 0, 0],  # nothing hidden between visible blocks
            [0, 0, 0, 0, 0, 0, 0, 0],  # nothing visible
        ],
        bool,
    )[None, None]
    everything = np.zeros_like(rows)
    everything[0, 0, 0] = rows[0, 0, 0]  # wholly visible: [0, 1), [3, 5) and [6, 7)
    ranges = mask_block_ranges(jnp.asarray(rows), jnp.asarray(everything))
    np.testing.assert_array_equal(np.asarray(ranges)[0, 0, :, 2:4], [[3, 5], [0, 0], [0, 0], [0, 0]])  # the longest
    np.testing.assert_array_equal(
        np.asarray(ranges)[0, 0, :, [0, 1, 4, 5]].T, [[0, 7, 1, 3], [1, 8, 4, 7], [1, 4, 0, 0], [0, 0, 0, 0]]
    )

    def narrowed(tile, lo, hi):
        lo, hi, _, gap = narrow_to_mask_ranges(lo, hi, None, ranges, batch=0, head=0, tile=tile, num_kv_blocks=8)
        return [int(x) for x in (lo, hi, gap.start, gap.length)] if gap.length else [int(lo), int(hi)]

    assert narrowed(1, 0, 8) == [1, 8, 4, 3]
    assert narrowed(1, 0, 6) == [1, 4]  # the band ends inside the gap: the range ends where it starts
    assert narrowed(1, 5, 8) == [7, 8]  # the band starts inside it: the range starts where it ends
    assert narrowed(0, 2, 5) == [3, 5]


# ---- a BlockMask ------------------------------------------------------------------------------------------------


def _brute_classes(block_mask, q_len, kv_len, block_q, block_kv):
    tokens = block_mask.expand(q_len, kv_len)
    rows, cols = -(-q_len // block_q), -(-kv_len // block_kv)
    anything = np.zeros(tokens.shape[:2] + (rows, cols), bool)
    everything = np.ones_like(anything)
    for i in range(rows):
        for j in range(cols):
            tile = tokens[:, :, i * block_q : (i + 1) * block_q, j * block_kv : (j + 1) * block_kv]
            anything[:, :, i, j], everything[:, :, i, j] = tile.any((2, 3)), tile.all((2, 3))
    return anything, everything


@pytest.mark.parametrize("block_q, block_kv", [(64, 64), (128, 64), (32, 48), (80, 112)])
def test_tile_classes_match_the_expanded_mask(block_q, block_kv):
    """A block mask's classes at kernel tiles (larger, smaller or straddling its blocks; ragged lengths) are those
    of its token-level expansion."""
    rng = np.random.default_rng(5)
    block_mask = BlockMask(rng.uniform(size=(2, 3, 5, 4)) > 0.4, block_q=48, block_kv=64)
    q_len, kv_len = 230, 250
    q_pad, kv_pad = -(-q_len // block_q) * block_q, -(-kv_len // block_kv) * block_kv
    got = tile_classes(block_mask, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv, q_pad=q_pad,
                       kv_pad=kv_pad)  # fmt: skip
    for ours, want in zip(got, _brute_classes(block_mask, q_len, kv_len, block_q, block_kv)):
        np.testing.assert_array_equal(ours, want)


@pytest.mark.parametrize(
    "pattern, words",
    [
        ("local", None),
        ("causal", None),
        ("strided", "form 3 runs"),
        ("global_local", None),
        ("global_local_beside_a_mask", "form 2 runs"),
        ("local_64", "straddles"),
    ],
)
def test_which_block_masks_the_ranges_alone_serve(pattern, words):
    """Ranges serve a block mask exactly where each kernel tile's kept blocks form at most two runs of wholly kept
    tiles (local windows, causal, global + local), one beside another mask; strided patterns, or mask blocks
    smaller than a kernel tile with a ragged edge inside it, are not (the API expands those into the dense mask)."""
    n = 1024
    block_mask = {
        "local": lambda: BlockMask.local(n, n, 1, block_q=128, block_kv=128),
        "causal": lambda: BlockMask.causal(n, n, block_q=128, block_kv=128),
        "strided": lambda: BlockMask.strided(n, n, 3, block_q=128, block_kv=128),
        "global_local": lambda: BlockMask.global_local(n, n, 1, 1, block_q=128, block_kv=128),
        "global_local_beside_a_mask": lambda: BlockMask.global_local(n, n, 1, 1, block_q=128, block_kv=128),
        "local_64": lambda: BlockMask.local(n, n, 1, block_q=64, block_kv=64),
    }[pattern]()
    tiles = dict(query_tiles=((128, 64), (128, 128)), key_tiles=((128, 64),))
    beside = pattern.endswith("_beside_a_mask")
    reason = exact_by_ranges(block_mask, q_len=n, kv_len=n, kv_heads=1, **tiles, beside_other_masks=beside)
    assert reason is None if words is None else words in reason, reason


def _serve_on_fake_hopper(monkeypatch, params):
    """flash_attention(implementation="mosaic") on a faked sm90, both kernels in the interpreter."""
    monkeypatch.setattr(device, "on_hopper_gpu", lambda: True)
    for module, name in ((hopper_vjp.hopper_fwd, "hopper_forward"), (hopper_vjp.hopper_bwd, "hopper_backward")):
        monkeypatch.setattr(module, name, functools.partial(getattr(module, name), interpret=params))


# name: (shape, block mask, flash_attention options, whether the ranges alone serve it)
API_CASES = {
    # a causal local window of 128-key blocks with causal and segment ids, ragged: the ranges alone
    "local_causal_segments": (
        (1, 250, 250, 2, 2, 64),
        BlockMask.local(250, 250, (1, 0), block_q=128, block_kv=128),
        dict(is_causal=True, segments=(90,)),
        True,
    ),
    # a strided pattern with GQA: not one run per tile, so expanded into the dense mask, ANDed with a dense mask
    "strided_gqa_mask": ((1, 192, 200, 2, 1, 64), BlockMask.strided(192, 200, 2, block_q=64, block_kv=64), {}, False),
    # global + local with GQA, causal, ragged: two runs per tile, the ranges and their gaps alone
    "global_local_causal_gqa": (
        (1, 450, 450, 4, 2, 64),
        BlockMask.global_local(450, 450, 1, (1, 0), block_q=128, block_kv=128),
        dict(is_causal=True),
        True,
    ),
}


@pytest.mark.interpreter
@pytest.mark.parametrize(  # the ranges-alone case is `slow` (CI's time): the dense-mask test covers those ranges
    "case", [pytest.param(c, marks=pytest.mark.slow if API_CASES[c][3] else ()) for c in API_CASES]
)
def test_flash_attention_serves_a_block_mask_on_hopper(case, monkeypatch):
    """On sm90 (faked), flash_attention runs the Hopper kernels on a block mask, by its block ranges or expanded into
    the dense mask: out and gradients against the reference (implementation="xla")."""
    shape, block_mask, options, by_ranges = API_CASES[case]
    batch, q_len, kv_len = shape[:3]
    q, k, v, d_out = make_inputs(shape, jnp.bfloat16, seed=42)
    options = dict(options, scale=SCALE, block_mask=block_mask)
    if "segments" in options:
        starts = options.pop("segments")
        options["segment_ids"] = jnp.asarray(np.stack([packed_ids(q_len, *starts)] * batch))
    if case.endswith("_mask"):
        options["mask"] = jnp.asarray(np.random.default_rng(3).uniform(size=(1, 1, q_len, kv_len)) > 0.2)
    reason = hopper_vjp._ranges_reason(
        block_mask, q, k, shape[5], band=masks.Band.of(options.get("is_causal", False), None),
        config=pf.KernelConfig.default(shape[5]), mods=masks.ScoreMods(),
    )  # fmt: skip
    assert (reason is None) == by_ranges, reason
    _serve_on_fake_hopper(monkeypatch, _interpreter(detect_races=False))
    out, vjp = jax.vjp(lambda *x: pf.flash_attention(*x, implementation="mosaic", **options), q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_out, ref_vjp = jax.vjp(lambda *x: pf.flash_attention(*x, implementation="xla", **options), *f32)
    assert_close(out, ref_out, jnp.bfloat16)
    for name, got, ref in zip(("dq", "dk", "dv"), vjp(d_out), ref_vjp(d_out.astype(jnp.float32))):
        assert_close(got, ref, jnp.bfloat16, table=GRADIENT, what=name)


@pytest.mark.interpreter
def test_block_mask_gaps_are_never_loaded():
    """A global + local block mask (global block 0 both ways, each block seeing itself) served by its ranges alone:
    the last query tile keeps key blocks 0 and 3, the last key tile query blocks 0 and 3, and each kernel steps
    over blocks 1-2 between them. NaN keys and values there leave the last query tile's output and lse equal to
    the reference's, NaN queries and output cotangents there the last key tile's dK and dV; ragged lengths (the
    tiles that load those blocks do differ)."""
    params = _interpreter()
    n = 500
    block_mask = BlockMask.global_local(n, n, 1, 0, block_q=128, block_kv=128)
    assert exact_by_ranges(block_mask, q_len=n, kv_len=n, kv_heads=1, query_tiles=((128, 64),),
                           key_tiles=((128, 64),)) is None  # fmt: skip
    q, k, v, d_out, d_lse = make_backward_inputs((1, n, n, 1, 1, 64), jnp.bfloat16, seed=45)
    hidden = jnp.asarray((np.arange(n) >= 128) & (np.arange(n) < 384))
    poison = lambda x: jnp.where(hidden[None, :, None, None], jnp.nan, x).astype(x.dtype)  # noqa: E731
    mask = jnp.asarray(block_mask.expand(n, n))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (ref_out, ref_lse), vjp = jax.vjp(lambda q, k, v: reference.attention_reference(q, k, v, scale=SCALE, mask=mask),
                                      *f32)  # fmt: skip
    _, want_dk, want_dv = vjp((d_out.astype(jnp.float32), d_lse))
    out, lse = hopper_fwd.hopper_forward(
        q, poison(k), poison(v), scale=SCALE, config=HopperConfig(64, 64), block_mask=block_mask, interpret=params
    )
    assert not _compat.mosaic_gpu_races_found()
    last = slice(384, n)
    assert_close(out[:, last], ref_out[:, last], jnp.bfloat16)
    assert_close(lse[:, :, last], ref_lse[:, :, last], jnp.float32, what="lse")
    assert np.isnan(np.asarray(out[:, 128:384], np.float32)).all()
    _, dk, dv, _, _ = interpreted_hopper_backward(
        poison(q), k, v, ref_out.astype(q.dtype), ref_lse, poison(d_out), d_lse, scale=SCALE,
        config=HopperBwdConfig(), block_mask=block_mask, interpret=params,
    )  # fmt: skip
    assert_gradients_close((dk[:, last], dv[:, last]), (want_dk[:, last], want_dv[:, last]), names=("dk", "dv"))
    assert np.isnan(np.asarray(dk[:, 128:384], np.float32)).all()


def test_kernels_refuse_a_block_mask_their_ranges_cannot_serve():
    """The kernels' entry points take a block mask only where its ranges alone serve it (strided with stride 2: four
    runs in the last query tile), and say to pass it as a dense mask otherwise."""
    q, k, lse, _ = abstract_inputs((1, 1024, 1024, 2, 2, 64), False)
    strided = BlockMask.strided(1024, 1024, 2, block_q=128, block_kv=128)
    with pytest.raises(ValueError, match="form 4 runs.*mask="):
        forward = functools.partial(hopper_fwd.hopper_forward, config=HopperConfig(64, 128), block_mask=strided)
        jax.eval_shape(functools.partial(forward, scale=0.1), q, k, k)
    with pytest.raises(ValueError, match="form 4 runs.*mask="):
        jax.eval_shape(
            functools.partial(hopper_bwd.hopper_backward, scale=0.1, block_mask=strided), q, k, k, q, lse, q, None
        )
    # two runs (global + local) only where no other mask's gap may take the ranges' one
    global_local = BlockMask.global_local(1024, 1024, 1, 1, block_q=128, block_kv=128)
    dense = jax.ShapeDtypeStruct((1, 1, 1024, 1024), jnp.bool_)
    with pytest.raises(ValueError, match="form 2 runs.*mask="):
        forward = functools.partial(hopper_fwd.hopper_forward, config=HopperConfig(64, 128), block_mask=global_local)
        jax.eval_shape(functools.partial(forward, scale=0.1, mask=dense), q, k, k)
    reason = functools.partial(
        hopper_vjp._ranges_reason, global_local, q, k, 64, band=masks.Band.of(False, None),
        config=pf.KernelConfig.default(64)
    )  # fmt: skip
    assert reason(mods=masks.ScoreMods()) is None
    assert "form 2 runs" in reason(mods=masks.ScoreMods(mask_dims=(False, False, True, True)))


# ---- lowering -----------------------------------------------------------------------------------------------


LOWERING_SHAPE = (2, 600, 640, 4, 2, 64)


def _sparse_abstract(which):
    """(mask, block_mask) of a lowering case: a dense mask per head, or a causal local block mask."""
    batch, q_len, kv_len, heads = LOWERING_SHAPE[:4]
    if which == "mask":
        return jax.ShapeDtypeStruct((1, heads, q_len, kv_len), jnp.bool_), None
    return None, BlockMask.local(q_len, kv_len, (1, 0), block_q=128, block_kv=128)


@pytest.mark.lowering
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("which", ["mask", "block_mask"])
def test_sparse_forward_lowers_for_gpu(which, overlap):
    """The forward narrowed to a dense mask's or a block mask's ranges (a dense mask read on masked blocks only,
    the block mask's hull hiding the rest) goes through Mosaic GPU's lowering, with and without the overlapped
    loop, persistent or not, ragged, GQA, segment ids."""
    q, k, _, ids = abstract_inputs(LOWERING_SHAPE, True)
    mask, block_mask = _sparse_abstract(which)
    config = HopperConfig(64, 64, 2, persistent=not overlap, overlap=overlap)

    def forward(q, k, v, q_ids, kv_ids, mask):
        return hopper_fwd.hopper_forward(
            q, k, v, scale=0.1, is_causal=True, config=config, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
            mask=mask, block_mask=block_mask,
        )  # fmt: skip

    text = lower_for_cuda(forward, q, k, k, *ids, mask)
    assert text.count(MOSAIC_CALL) == 1


@pytest.mark.lowering
@pytest.mark.parametrize("variant", ["plain", "overlap"])
@pytest.mark.parametrize("which", ["mask", "block_mask"])
def test_sparse_backward_lowers_for_gpu(which, variant):
    """Both passes narrowed to a dense mask's or a block mask's ranges go through Mosaic GPU's lowering, with the
    plain steps and with both overlapped loops, ragged and GQA."""
    q, k, lse, _ = abstract_inputs(LOWERING_SHAPE, False)
    mask, block_mask = _sparse_abstract(which)
    config = HopperBwdConfig()
    if variant == "overlap":
        config = HopperBwdConfig(num_stages_dkv=3, num_stages_dq=3, dq_overlap=True, dkv_overlap=True)

    def backward(q, k, v, out, lse, d_out, mask):
        return hopper_bwd.hopper_backward(
            q, k, v, out, lse, d_out, None, scale=0.1, is_causal=True, config=config, mask=mask,
            block_mask=block_mask,
        )  # fmt: skip

    text = lower_for_cuda(backward, q, k, k, q, lse, q, mask)
    assert text.count(MOSAIC_CALL) == 2


# ---- on an H100 ---------------------------------------------------------------------------------------------


GPU_CASES = {
    "local_causal": (BlockMask.local(1000, 1000, (2, 0), block_q=128, block_kv=128), dict(is_causal=True)),
    "strided_document_mask": (BlockMask.strided(1000, 1000, 3, block_q=128, block_kv=128), dict(mask="document")),
    "global_local_segments": (
        BlockMask.global_local(1000, 1000, 1, 1, block_q=256, block_kv=128),
        dict(segments=(300, 700)),
    ),
    "global_local_causal": (BlockMask.global_local(1000, 1000, 1, 2, block_q=128, block_kv=128), dict(is_causal=True)),
    "local_window_gqa": (BlockMask.local(1000, 1000, 1, block_q=256, block_kv=256), dict(local_window_size=200)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", GPU_CASES)
def test_block_mask_flash_attention_on_hopper(case, head_dim):
    """On sm90, flash_attention(implementation="mosaic") with a block mask (served by its ranges or as a dense
    mask), with causal, windows, segment ids and a dense document mask, GQA, ragged: out, lse and gradients against
    the reference."""
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    block_mask, options = GPU_CASES[case]
    shape = (2, 1000, 1000, 4, 2, head_dim)
    q, k, v, d_out = make_inputs(shape, jnp.bfloat16, seed=43)
    options = dict(options, scale=SCALE, block_mask=block_mask)
    if options.get("mask") == "document":
        pos = np.arange(1000)
        options["mask"] = jnp.asarray(((pos[:, None] // 300) == (pos[None, :] // 300))[None, None])
    if "segments" in options:
        ids = jnp.asarray(np.stack([packed_ids(1000, *options.pop("segments"))] * 2))
        options["segment_ids"] = ids

    def run(implementation, *x):
        return pf.flash_attention(*x, implementation=implementation, return_lse=True, **options)

    (out, lse), vjp = jax.vjp(functools.partial(run, "mosaic"), q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (ref_out, ref_lse), ref_vjp = jax.vjp(functools.partial(run, "xla"), *f32)
    assert_close(out, ref_out, jnp.bfloat16)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    d_lse = jnp.zeros_like(lse)
    for name, got, ref in zip(("dq", "dk", "dv"), vjp((d_out, d_lse)), ref_vjp((d_out.astype(jnp.float32), d_lse))):
        assert_close(got, ref, jnp.bfloat16, table=GRADIENT, what=name)
