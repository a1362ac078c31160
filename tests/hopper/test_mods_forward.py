"""score_mod and mask_mod in the Hopper forward: the kernel in JAX's Mosaic GPU interpreter (race detection on)
against the float32 reference with the same programs, its lowering for CUDA, the vjp wiring's checks, and on an
H100 the public API against the reference.

Tiles are 128 query rows (two consumers of 64) and 64-key blocks: every case has several query tiles and key
blocks, ragged lengths (a padded key tail, padded query rows) and blocks the mask program leaves partly,
wholly and not at all visible."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, masks, mods, reference
from pallas_flash.config import KernelConfig
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper import vjp as hopper_vjp
from pallas_flash.hopper.config import HopperConfig
from tests.helpers import abstract_inputs, lower_for_cuda, make_inputs, packed_ids, shape_id
from tests.hopper.test_interpreter import interpret_params
from tests.tolerances import assert_close

SCALE = 0.125


def _slopes(heads):
    return jnp.asarray(np.linspace(0.05, 0.4, heads), jnp.float32)


def _gains(length):
    """A closed-over float array per position (a row or column value of a score program)."""
    return jnp.asarray(np.random.default_rng(5).uniform(0.5, 1.5, length), jnp.float32)


def _no_key_ids():
    """Query document 9 has no keys: rows 80-89 of tile 0 and all of tile 1 see nothing."""
    q_ids = packed_ids(256, 40, 100)
    q_ids[80:90] = q_ids[128:] = 9
    return jnp.asarray(q_ids[None]), jnp.asarray(packed_ids(130, 40, 100)[None])


# name: (shape (batch, q_len, kv_len, heads, kv_heads, head_dim), score_mod, mask_mod, is_causal, config); the
# programs are built from the shape.
CASES = {
    # a score program alone (tanh, a per-head row value, |kv_idx - q_idx|), GQA, q_len < kv_len, persistent
    "softcap_alibi_gqa": (
        (1, 130, 200, 2, 1, 64),
        lambda s: mods.chain(mods.soft_cap(2.0), mods.alibi(_slopes(s[3]))),
        None,
        False,
        HopperConfig(64, 64, 2, persistent=True),
    ),
    # ALiBi under a causal band: |kv_idx - q_idx| read as q_idx - kv_idx, its per-query term in the row's shift
    "alibi_causal": (
        (1, 130, 200, 2, 1, 64),
        lambda s: mods.alibi(_slopes(s[3])),
        None,
        True,
        HopperConfig(64, 64, 2),
    ),
    # a per-query bias (a float row value added to the score): kept out of the logits, in the row's shift
    "query_bias": (
        (1, 130, 200, 1, 1, 64),
        lambda s: lambda x, b, h, q, k: x + 2.0 * _gains(s[1])[q],
        None,
        False,
        HopperConfig(64, 64, 2),
    ),
    # a score program linear in the score, slope 2 (its per-key and |kv_idx - q_idx| terms start S's
    # accumulator); the overlapped loop
    "key_bias_overlap": (
        (1, 130, 200, 2, 1, 64),
        lambda s: lambda x, b, h, q, k: 2.0 * x + _gains(s[2])[k] - 0.05 * jnp.abs(k - q).astype(jnp.float32),
        None,
        False,
        HopperConfig(64, 64, 2, overlap=True),
    ),
    # documents (row and column int values) and causal as one mask program; the overlapped loop
    "document_causal": (
        (1, 150, 150, 2, 1, 64),
        None,
        lambda s: mods.and_masks(mods.document(jnp.asarray(packed_ids(s[1], 20, 37, 90, 101)[None])), mods.causal()),
        False,
        HopperConfig(64, 64, 2, overlap=True),
    ),
    # rows and a whole tile that see no key: zeros and lse = -inf
    "no_key_rows": (
        (1, 256, 130, 1, 1, 64),
        None,
        lambda s: mods.document(*_no_key_ids()),
        False,
        HopperConfig(64, 64),
    ),
    # both programs, the score's closed-over float arrays as row and column values, under a causal band
    # (and, in tile 1, a key block wholly in its one document: unmasked)
    "floats_and_mask_causal": (
        (1, 256, 230, 2, 1, 64),
        lambda s: lambda x, b, h, q, k: x * _gains(s[1])[q] + _gains(s[2])[k],
        lambda s: mods.document(*(jnp.asarray(packed_ids(n, 40)[None]) for n in s[1:3])),
        True,
        HopperConfig(64, 64, 3, persistent=True),
    ),
    # a window as a mask program: skipped blocks on both sides, both edges masked; one CTA per tile
    "sliding_window": (
        (1, 150, 200, 1, 1, 64),
        None,
        lambda s: mods.sliding_window(40, 10),
        False,
        HopperConfig(64, 64),
    ),
    # a bidirectional prefix per example: block ranges that vary with the batch; q_len > kv_len
    "prefix_lm": (
        (2, 200, 130, 2, 2, 64),
        None,
        lambda s: mods.prefix_lm(jnp.asarray([5, 70], jnp.int32)),
        False,
        HopperConfig(64, 64, 2, persistent=True, overlap=True),
    ),
    # 16 global keys and a 40-key window under a causal band: tiles past the window's reach step over the hidden
    # blocks between them (`Gap`); persistent, overlapped
    "global_window_gap": (
        (1, 400, 400, 1, 1, 64),
        None,
        lambda s: mods.or_masks(lambda b, h, q, k: k < 16, mods.sliding_window(40, 0)),
        True,
        HopperConfig(64, 64, 2, persistent=True, overlap=True),
    ),
}
# Covered on the GPU (global_window_gap also by test_sparse's gap test); no_key_rows's tiles that visit no block also
# run in test_interpreter's no_key case.
SLOW = {"sliding_window", "prefix_lm", "document_causal", "softcap_alibi_gqa", "no_key_rows", "global_window_gap"}


def program_args(shape, score_fn, mask_fn, config):
    """(hopper_forward's program arguments, the reference's) for these functions at this shape."""
    batch, q_len, kv_len, heads = shape[:4]
    kernel, ref = {}, {}
    if score_fn is not None:
        program, consts = mods.trace(score_fn, "score")
        staged, why = mods.stage(program)
        assert staged is not None, why
        kernel.update(score_mod=staged, score_stacks=staged.stacks(consts, batch, heads, q_len, kv_len))
        ref.update(score_mod=program, score_consts=consts)
    if mask_fn is not None:
        program, consts = mods.trace(mask_fn, "mask")
        staged, why = mods.stage(program)
        assert staged is not None, why
        ranges = hopper_fwd.mask_ranges(
            staged, consts, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, config=config
        )
        kernel.update(
            mask_mod=staged, mask_stacks=staged.stacks(consts, batch, heads, q_len, kv_len), mask_ranges=ranges
        )
        ref.update(mask_mod=program, mask_consts=consts)
    return kernel, ref


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow if c in SLOW else ()) for c in CASES])
def test_mods_forward_in_mosaic_gpu_interpreter(case):
    """The forward with a score program on every visited block and a mask program on the blocks it does not
    leave wholly visible (block ranges from `mask_ranges`, values riding the K ring and loaded per tile)
    matches the reference; rows that see no key get zeros and lse = -inf, never NaN."""
    shape, score, mask, is_causal, config = CASES[case]
    kernel_args, ref_args = program_args(shape, score and score(shape), mask and mask(shape), config)
    q, k, v, _ = make_inputs(shape, jnp.bfloat16, seed=21)
    out, lse = hopper_fwd.hopper_forward(
        q,
        k,
        v,
        scale=SCALE,
        is_causal=is_causal,
        config=config,
        interpret=interpret_params(detect_races=True),
        **kernel_args,
    )
    assert not _compat.mosaic_gpu_races_found()
    ref_out, ref_lse = reference.attention_reference(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=SCALE, band=masks.Band.of(is_causal, None), **ref_args
    )
    assert_close(out, ref_out, jnp.bfloat16)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(np.asarray(ref_lse))
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")
    np.testing.assert_array_equal(np.asarray(out)[~finite.transpose(0, 2, 1)], 0)
    if case == "no_key_rows":
        assert (~finite).any(), "this case is meant to contain rows that see no key"


def _global_queries_forward(monkeypatch, deal=None):
    """(out, the reference's out, the call's deal) of the persistent forward (2 CTAs in the interpreter) on global
    queries beside a block diagonal: 24 tiles of 128 rows, the first seeing all 29 key blocks (dealt below
    DEAL_MIN_KV_BLOCKS here), each other one; with `deal`, a function of the real deal that replaces it in the
    kernel."""
    monkeypatch.setattr(hopper_fwd, "DEAL_MIN_KV_BLOCKS", 1)
    shape = (1, 3072, 3712, 1, 1, 64)
    program, consts = mods.trace(mods.or_masks(lambda b, h, q, k: q < 16, lambda b, h, q, k: q // 128 == k // 128),
                                 "mask")  # fmt: skip
    staged, _ = mods.stage(program)
    config = HopperConfig(64, 128, 2, persistent=True)
    ranges = hopper_fwd.mask_ranges(staged, consts, batch=1, heads=1, q_len=3072, kv_len=3712, config=config)
    dealt = hopper_fwd.long_rows_deal(ranges, batch=1, heads=1, num_q_tiles=24, band=masks.Band(), ctas=2, chunk=1)
    if deal is not None:
        monkeypatch.setattr(hopper_fwd, "long_rows_deal", lambda *args, **kwargs: deal(dealt))
    q, k, v, _ = make_inputs(shape, jnp.bfloat16, seed=22)
    out, _ = hopper_fwd.hopper_forward(
        q, k, v, scale=SCALE, config=config, mask_mod=staged, mask_stacks=staged.stacks(consts, 1, 1, 3072, 3712),
        mask_ranges=ranges, interpret=interpret_params(detect_races=deal is None),
    )  # fmt: skip
    ref, _ = reference.attention_reference(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=SCALE, mask_mod=program, mask_consts=consts
    )
    return out, ref, np.asarray(dealt)


@pytest.mark.interpreter
@pytest.mark.slow  # CI's time: the deal's tiling is tested on the CPU, the kernel's reading of it below, both on a GPU
def test_persistent_forward_deals_long_rows(monkeypatch):
    """Global queries (a mask program ORing in a query-only term): the persistent forward takes its tiles by the
    long-rows deal, the long unit on a CTA of its own while the other takes short units: the reference's output."""
    out, ref, dealt = _global_queries_forward(monkeypatch)
    assert list(dealt[:3]) == [1, 6, 12]  # one long unit (34 block-steps), 6 rounds of short ones (6 each), 12 units
    assert_close(out, ref, jnp.bfloat16)


@pytest.mark.interpreter
def test_persistent_forward_reads_the_deal(monkeypatch):
    """A long-rows deal whose order names only the last unit: that unit's rows are the reference's and every other
    tile stays unwritten (a kernel that ignored the deal would compute them)."""

    def only_last(dealt):
        units = dealt.shape[0] - 3
        return dealt.at[:3].set(jnp.asarray([0, 0, units])).at[3:].set(units - 1)

    out, ref, dealt = _global_queries_forward(monkeypatch, only_last)
    units = int(dealt[2])
    last = hopper_fwd.persistent_order(np.arange(2 * units - 2, 2 * units), pairs=1, chunk=1, num_q_tiles=24)[1]
    rows = np.concatenate([np.arange(128 * t, 128 * t + 128) for t in np.asarray(last)])
    assert_close(out[:, rows], ref[:, rows], jnp.bfloat16)
    others = np.setdiff1d(np.arange(3072), rows)
    assert not np.allclose(np.asarray(out[:, others], np.float32), np.asarray(ref[:, others]), atol=1e-2)


def test_mask_ranges_skip_and_unmask_blocks():
    """`mask_ranges` of a causal mask program: each 128-row tile visits the key blocks up to its diagonal,
    the ones below the diagonal unmasked."""
    config = HopperConfig(64, 64)
    program, consts = mods.trace(mods.causal(), "mask")
    staged, _ = mods.stage(program)
    ranges = hopper_fwd.mask_ranges(staged, consts, batch=1, heads=1, q_len=300, kv_len=300, config=config)
    # tiles of rows [0, 128), [128, 256), [256, 300); blocks of 64 keys, 5 of them
    np.testing.assert_array_equal(
        np.asarray(ranges)[0, 0], [[0, 2, 0, 0, 0, 0], [0, 4, 0, 2, 0, 0], [0, 5, 0, 4, 0, 0]]
    )


@pytest.mark.lowering
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("which", ["score", "linear_score", "mask", "both"])
def test_mods_forward_lowers_for_gpu(which, overlap):
    """The forward with a score program (soft cap, ALiBi, a closed-over column value, the head index; or, linear in
    the score, the same without the soft cap, whose score-free part starts S's accumulator), a mask program
    (documents and causal) or both goes through Mosaic GPU's lowering (the programs on WGMMA register tiles, the
    values' copies and barriers), ragged and GQA, with and without the overlapped loop."""
    shape = (2, 300, 333, 4, 2, 128)
    batch, q_len, kv_len, heads = shape[:4]
    q, k, _, _ = abstract_inputs(shape, False)
    config = HopperConfig(64, 128, 2, persistent=not overlap, overlap=overlap)
    bias = jnp.zeros((kv_len,), jnp.float32)
    # the last term reads the head index itself on the tile (a scalar broadcast to it), not as a row value
    score = mods.chain(
        *([] if which == "linear_score" else [mods.soft_cap(20.0)]),
        mods.alibi(_slopes(heads)),
        lambda s, b, h, q, k: s + bias[k] + ((k - q) * h).astype(jnp.float32) * 1e-3,
    )
    docs = jnp.zeros((batch, kv_len), jnp.int32)
    mask = mods.and_masks(mods.document(docs[:, :q_len], docs), mods.causal())
    args, _ = program_args(
        shape, score if which != "mask" else None, mask if which in ("mask", "both") else None, config
    )
    if which == "linear_score":
        assert args["score_mod"].score_slope == 1.0  # the offsets' path
    stacks = {name: args.pop(name) for name in ("score_stacks", "mask_stacks", "mask_ranges") if name in args}

    def forward(q, k, v, stacks):
        return hopper_fwd.hopper_forward(q, k, v, scale=0.1, config=config, **args, **stacks)

    text = lower_for_cuda(forward, q, k, k, stacks)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


def test_unstageable_program_is_refused():
    """A score program that indexes a closed-over array by both positions cannot run on register tiles: the
    Hopper entry point names the argument and the reason."""
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    program, consts = mods.trace(mods.relative_position_bias(jnp.zeros((2, 9))), "score")
    with pytest.raises(ValueError, match="score_mod: "):
        hopper_vjp.flash_attention_hopper(
            q,
            q,
            q,
            scale=SCALE,
            band=masks.Band(),
            config=KernelConfig(),
            mods=masks.ScoreMods(score_mod=program),
            mod_arrays=masks.ModArrays(score_consts=consts),
        )


GPU_SHAPES = [(2, 1000, 1000, 4, 2, 128), (1, 777, 1500, 2, 2, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=shape_id)
def test_mosaic_mods_forward_matches_reference(shape):
    """flash_attention(implementation="mosaic") with a score_mod (soft cap and ALiBi) and a mask_mod (documents
    and causal, with a prefix) against the reference: output and LSE."""
    batch, q_len, kv_len, heads = shape[:4]
    q, k, v, _ = make_inputs(shape, jnp.bfloat16, seed=8)
    score = mods.chain(mods.soft_cap(5.0), mods.alibi(_slopes(heads)))
    docs = jnp.asarray(np.stack([packed_ids(kv_len, 100, 400, 401, 900)] * batch))
    mask = mods.or_masks(
        mods.and_masks(mods.document(docs[:, :q_len], docs), mods.causal()), mods.prefix_lm(jnp.full((batch,), 30))
    )
    out, lse = pf.flash_attention(q, k, v, score_mod=score, mask_mod=mask, implementation="mosaic", return_lse=True)
    score_program, score_consts = mods.trace(score, "score")
    mask_program, mask_consts = mods.trace(mask, "mask")
    ref_out, ref_lse = reference.attention_reference(
        *(x.astype(jnp.float32) for x in (q, k, v)),
        scale=1.0 / np.sqrt(shape[-1]),
        score_mod=score_program,
        score_consts=score_consts,
        mask_mod=mask_program,
        mask_consts=mask_consts,
    )
    assert_close(out, ref_out, jnp.bfloat16)
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isneginf(lse), ~finite)
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")
    assert jax.numpy.isfinite(out.astype(jnp.float32)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mosaic_forward_with_global_tokens_matches_reference(head_dim):
    """Longformer's global tokens at 16k (64 tokens that see and are seen by all, a window of 256 each side): the
    persistent forward deals its long units to CTAs of their own (`long_rows_deal`): output and LSE against the
    reference."""
    shape = (1, 16384, 16384, 2, 2, head_dim)
    q, k, v, _ = make_inputs(shape, jnp.bfloat16, seed=9)
    mask = mods.or_masks(lambda b, h, q, k: (q < 64) | (k < 64), mods.sliding_window(256, 256))
    program, consts = mods.trace(mask, "mask")
    staged, _ = mods.stage(program)
    config = hopper_fwd.default_config(head_dim, 16384, masks.Band(), sparse=True)
    ranges = hopper_fwd.mask_ranges(staged, consts, batch=1, heads=2, q_len=16384, kv_len=16384, config=config)
    if config.persistent:
        deal = hopper_fwd.long_rows_deal(ranges, batch=1, heads=2, num_q_tiles=ranges.shape[2], band=masks.Band(),
                                         ctas=ranges.shape[2], chunk=1)  # fmt: skip
        assert int(deal[0]) == 2  # each head's first unit, dealt to a CTA of its own (one CTA per unit here)
    out, lse = pf.flash_attention(q, k, v, mask_mod=mask, implementation="mosaic", return_lse=True)
    ref_out, ref_lse = reference.attention_reference(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=1.0 / np.sqrt(head_dim), mask_mod=program,
        mask_consts=consts,
    )  # fmt: skip
    assert_close(out, ref_out, jnp.bfloat16)
    assert_close(lse, ref_lse, jnp.float32, what="lse")


@pytest.mark.lowering
def test_dealt_persistent_forward_lowers_for_gpu(monkeypatch):
    """The persistent forward on global queries, taking its tiles by the long-rows deal (scalars and the unit
    order read from global memory), goes through Mosaic GPU's lowering."""
    monkeypatch.setattr(hopper_fwd, "DEAL_MIN_KV_BLOCKS", 1)
    shape = (1, 1024, 1024, 2, 2, 128)
    q, k, _, _ = abstract_inputs(shape, False)
    program, consts = mods.trace(mods.or_masks(lambda b, h, q, k: q < 16, mods.sliding_window(64, 64)), "mask")
    staged, _ = mods.stage(program)
    config = HopperConfig(64, 128, 2, persistent=True, overlap=True)

    def forward(q, k, v):
        stacks = staged.stacks(consts, 1, 2, 1024, 1024)
        ranges = hopper_fwd.mask_ranges(staged, consts, batch=1, heads=2, q_len=1024, kv_len=1024, config=config)
        return hopper_fwd.hopper_forward(q, k, v, scale=0.1, config=config, mask_mod=staged, mask_stacks=stacks,
                                         mask_ranges=ranges)  # fmt: skip

    text = lower_for_cuda(forward, q, k, k)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


@pytest.mark.lowering
def test_hopper_entry_point_with_mods_lowers_for_gpu():
    """`flash_attention_hopper` stages the programs, computes their values and the mask's block ranges from the
    closed-over arrays in `mod_arrays` and runs the forward: one Mosaic GPU kernel."""
    shape = (2, 300, 333, 4, 2, 64)
    batch, q_len, kv_len, heads = shape[:4]
    q, k, _, _ = abstract_inputs(shape, False)
    score, score_consts = mods.trace(mods.alibi(_slopes(heads)), "score")
    docs = jnp.zeros((batch, kv_len), jnp.int32)
    mask, mask_consts = mods.trace(mods.and_masks(mods.document(docs[:, :q_len], docs), mods.causal()), "mask")

    def forward(q, k, v, score_consts, mask_consts):
        return hopper_vjp.flash_attention_hopper(
            q,
            k,
            v,
            scale=0.1,
            band=masks.Band(),
            config=KernelConfig.default(64),
            mods=masks.ScoreMods(score_mod=score, mask_mod=mask),
            mod_arrays=masks.ModArrays(score_consts=score_consts, mask_consts=mask_consts),
        )

    text = lower_for_cuda(forward, q, k, k, score_consts, mask_consts)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
