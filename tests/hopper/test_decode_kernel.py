"""The Hopper flash-decoding kernel (pallas_flash/hopper/decode.py, flash_decode's "mosaic" implementation):
in the Mosaic GPU interpreter with race detection against the dense float32 `decode_reference`, lowered for
CUDA on the CPU, and on an H100 through `flash_decode` (`gpu`); its split heuristic and what it declines."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import _compat, decode, device
from pallas_flash.hopper import decode as hopper_decode
from pallas_flash.hopper.decode import DecodeConfig
from tests.helpers import MOSAIC_CALL, lower_for_cuda
from tests.test_decode import _inputs, _paged
from tests.tolerances import assert_close


def _cache(k, v, lengths, page_size):
    """(key_cache, value_cache, block_table): the logical cache itself, or shuffled pages and a table."""
    if page_size is None:
        return k, v, None
    key_pages, table = _paged(k, page_size, lengths, seed=1)
    value_pages, _ = _paged(v, page_size, lengths, seed=1)
    return key_pages, value_pages, table


def _check(out, lse, ref_out, ref_lse, dtype):
    """out/lse against the reference's: the output within the dtype's tolerance, -inf exactly where the
    reference has it (zeros there), finite LSEs within float32's."""
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert_close(out, ref_out, dtype)
    assert_close(np.where(finite, lse, 0.0), np.where(finite, ref_lse, 0.0), jnp.float32, what="lse")
    np.testing.assert_array_equal(np.asarray(out, np.float32)[~finite.transpose(0, 2, 1)], 0)


def _reference(q, k_cache, v_cache, lengths, table, params):
    up = (x.astype(jnp.float32) for x in (q, k_cache, v_cache))
    return decode.decode_reference(*up, jnp.asarray(lengths), table, params)


# ---- in the Mosaic GPU interpreter -------------------------------------------------------------------------


def interpret_params():
    params = _compat.mosaic_gpu_interpret_params(detect_races=True)
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    return params


def run_interpreted(q, k_cache, v_cache, lengths, table, params):
    """decode_hopper in the interpreter with race detection: (out, lse)."""
    out, lse = decode.decode_hopper(
        q, k_cache, v_cache, jnp.asarray(lengths), table, params, interpret=interpret_params()
    )
    assert not _compat.mosaic_gpu_races_found()
    return out, lse


# id -> (q_len, max_len, lengths, heads, kv_heads, head_dim, page_size, num_splits, window, soft cap). Blocks
# are 64 keys. Lengths run from 1 key (queries before the sequence see nothing)
# to the full cache; a max_len that is not a multiple of the block slides the last block back.
INTERPRETER_CASES = {
    "tq1-gqa4-contiguous-splits3": (1, 200, (1, 37, 200), 4, 1, 64, None, 3, None, None),
    "tq4-mha-page16-ring-wraps": (4, 384, (1, 100, 384), 2, 2, 128, 16, 1, None, None),  # 6 blocks, 4 slots
    "tq4-gqa4-page64-window-cap": (4, 256, (4, 130, 256), 4, 1, 128, 64, None, 20, 5.0),
    "tq9-gqa8-two-row-tiles": (9, 128, (9, 128), 8, 1, 64, None, 1, None, None),
}
SLOW_INTERPRETER_CASES = {"tq9-gqa8-two-row-tiles", "tq4-mha-page16-ring-wraps"}  # CI time; the GPU runs all


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, id=name, marks=pytest.mark.slow if name in SLOW_INTERPRETER_CASES else ())
        for name, case in INTERPRETER_CASES.items()
    ],
)
def test_kernel_in_mosaic_gpu_interpreter(case):
    """The kernel's barriers, TMA ring (more blocks in a split than ring slots), page loads
    through a shuffled table, split ranges, GQA packing and masks against the dense reference."""
    q_len, max_len, lengths, heads, kv_heads, head_dim, page_size, splits, window, cap = case
    q, k, v = _inputs(len(lengths), q_len, max_len, heads, kv_heads, head_dim, jnp.bfloat16, seed=sum(lengths))
    k_cache, v_cache, table = _cache(k, v, lengths, page_size)
    params = decode.DecodeParams(scale=head_dim**-0.5, window_left=window, logits_soft_cap=cap, num_splits=splits)
    out, lse = run_interpreted(q, k_cache, v_cache, lengths, table, params)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape and lse.shape == (len(lengths), heads, q_len)
    _check(out, lse, *_reference(q, k_cache, v_cache, lengths, table, params), jnp.bfloat16)


@pytest.mark.interpreter
def test_ragged_batch_in_more_than_one_wave(monkeypatch):
    """On a GPU of one SM every CTA past the first few waits for a slot: the kernel visits the sequences
    longest first (`order_ref`), and each still writes its own output."""
    monkeypatch.setattr(hopper_decode, "H100_SMS", 1)  # the interpreter's SM count
    lengths = (100, 1, 256, 37)
    q, k, v = _inputs(len(lengths), 1, 256, 4, 1, 64, jnp.bfloat16, seed=11)
    params = decode.DecodeParams(scale=0.125, num_splits=2)
    out, lse = run_interpreted(q, k, v, lengths, None, params)
    _check(out, lse, *_reference(q, k, v, lengths, None, params), jnp.bfloat16)


@pytest.mark.interpreter
@pytest.mark.slow  # CI's time: the interpreter grid checks every case's LSE against the reference
def test_lse_of_two_halves_merges_into_the_whole():
    """The kernel over the second half of each cache, merged through its LSE with dense attention over the
    first half (which every query sees whole), equals the kernel over the whole cache."""
    half, lengths = 128, np.array([130, 256], np.int32)
    q, k, v = _inputs(2, 2, 2 * half, 4, 1, 64, jnp.bfloat16, seed=3)
    params = decode.DecodeParams(scale=0.125, num_splits=2)
    whole, whole_lse = run_interpreted(q, k, v, lengths, None, params)
    second, second_lse = run_interpreted(q, k[:, half:], v[:, half:], lengths - half, None, params)
    first, first_lse = pf.attention_reference(
        *(x.astype(jnp.float32) for x in (q, k[:, :half], v[:, :half])), scale=0.125
    )
    out, lse = pf.merge_attention_states(
        [first, second.astype(jnp.float32)], jnp.swapaxes(jnp.stack([first_lse, second_lse]), -1, -2)
    )
    assert_close(out, whole, jnp.bfloat16)
    assert_close(jnp.swapaxes(lse, -1, -2), whole_lse, jnp.float32, what="lse")


# ---- lowered for CUDA --------------------------------------------------------------------------------------


@pytest.mark.lowering
@pytest.mark.parametrize(
    "q_len, heads, head_dim, page_size, window, cap",
    [
        (1, 32, 128, None, None, None),
        (16, 8, 64, None, 100, 30.0),
        (4, 32, 128, 16, None, None),
        (16, 64, 128, 256, 100, None),  # 128 rows: two row tiles
        pytest.param(1, 8, 64, 64, None, 30.0, marks=pytest.mark.slow),
    ],
)
def test_kernel_lowers_for_gpu(q_len, heads, head_dim, page_size, window, cap):
    """The kernel goes through Mosaic GPU's lowering (register layouts, wgmma, TMA from the cache or its pages)
    under the name a profile shows, one kernel per call."""
    batch, kv_heads, max_len = 2, 8, 1000 if page_size is None else 1024
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    if page_size is None:
        cache, table = jax.ShapeDtypeStruct((batch, max_len, kv_heads, head_dim), jnp.bfloat16), None
    else:
        cache = jax.ShapeDtypeStruct((batch * max_len // page_size, page_size, kv_heads, head_dim), jnp.bfloat16)
        table = jax.ShapeDtypeStruct((batch, max_len // page_size), jnp.int32)
    params = decode.DecodeParams(scale=0.1, window_left=window, logits_soft_cap=cap)
    with _compat.lowering_gpu():
        text = lower_for_cuda(lambda *a: decode.decode_hopper(*a, params), q, cache, cache, lengths, table)
    assert text.count(MOSAIC_CALL) == 1
    assert "flash_decode_sm90" in text


# ---- what it serves, and its splits ------------------------------------------------------------------------


def test_declines_what_it_cannot_serve_with_a_reason():
    assert hopper_decode.unsupported_reason(jnp.bfloat16, 128, None) is None
    assert hopper_decode.unsupported_reason(jnp.float16, 64, 16) is None
    assert hopper_decode.unsupported_reason(jnp.bfloat16, 128, 256) is None
    assert "dtype float32" in hopper_decode.unsupported_reason(jnp.float32, 128, None)
    assert "head_dim 96" in hopper_decode.unsupported_reason(jnp.bfloat16, 96, None)
    assert "page_size 24" in hopper_decode.unsupported_reason(jnp.bfloat16, 128, 24)
    assert "page_size 96" in hopper_decode.unsupported_reason(jnp.bfloat16, 128, 96)
    too_deep = DecodeConfig(block_kv=256, num_stages=4)  # 512 KiB of ring
    assert "shared memory" in hopper_decode.unsupported_reason(jnp.bfloat16, 128, None, too_deep)
    if not device.on_hopper_gpu():  # on CPU the kernel never serves: None keeps choosing "xla"
        q, k, v = _inputs(1, 1, 64, 4, 1, 64, jnp.bfloat16, seed=0)
        with pytest.raises(ValueError, match="implementation='mosaic' cannot serve.*no Hopper"):
            pf.flash_decode(q, k, v, lengths=jnp.array([64]), implementation="mosaic")
        assert pf.DECODE_IMPLEMENTATIONS[0] == "mosaic"


def test_default_splits_fill_the_sms():
    """The inference shapes the kernel is measured at (kv_heads 8, 64-key blocks): a large batch needs no split,
    a small one a few, one long sequence about one CTA per SM; short caches keep >= MIN_BLOCKS_PER_SPLIT
    blocks per split."""
    splits = hopper_decode.default_num_splits
    assert splits(32 * 8, 8192 // 64, num_sms=132) == 1
    assert splits(8 * 8, 65536 // 64, num_sms=132) == 2
    one_sequence = splits(8, 65536 // 64, num_sms=132)
    assert 8 * one_sequence <= 132 and 8 * one_sequence >= 0.9 * 132
    assert splits(1, 4 * hopper_decode.MIN_BLOCKS_PER_SPLIT, num_sms=132) == 4
    assert splits(1, 1, num_sms=132) == 1


@pytest.mark.parametrize("kwargs", [dict(block_kv=96), dict(block_kv=512), dict(num_stages=1)])
def test_config_rejects_bad_tiles(kwargs):
    with pytest.raises(ValueError, match="DecodeConfig"):
        DecodeConfig(**kwargs)


# ---- on the H100 -------------------------------------------------------------------------------------------


def _on_gpu(
    q_len, batch, max_len, lengths, heads, kv_heads, page_size, window=None, cap=None, splits=None, head_dim=128, seed=0
):
    if not device.on_hopper_gpu():
        pytest.skip("needs a Hopper GPU")
    q, k, v = _inputs(batch, q_len, max_len, heads, kv_heads, head_dim, jnp.bfloat16, seed=seed)
    k_cache, v_cache, table = _cache(k, v, lengths, page_size)
    out, lse = pf.flash_decode(
        q,
        k_cache,
        v_cache,
        lengths=jnp.asarray(lengths, jnp.int32),
        block_table=table,
        local_window_size=window,
        logits_soft_cap=cap,
        num_splits=splits,
        return_lse=True,
        implementation="mosaic",
    )
    params = decode.DecodeParams(scale=head_dim**-0.5, window_left=window, logits_soft_cap=cap)
    _check(out, lse, *_reference(q, k_cache, v_cache, lengths, table, params), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len, group", [(1, 1), (1, 4), (2, 8), (4, 4), (9, 8), (16, 4), (16, 8)])
@pytest.mark.parametrize("page_size", [None, 16, 64, 256])
def test_matches_the_reference_on_gpu(q_len, group, page_size):
    """Ragged lengths from q_len to the full 2k cache; Tq * G = 72 and 128 rows take two row tiles."""
    lengths = np.array([q_len, 77, 1000, 2048], np.int32)
    _on_gpu(q_len, 4, 2048, lengths, 4 * group, 4, page_size, seed=q_len + group)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window, cap, splits", [(100, None, None), (None, 30.0, 7), (500, 30.0, 1)])
def test_window_soft_cap_and_splits_on_gpu(page_size, head_dim, window, cap, splits):
    lengths = np.array([4, 300, 3000, 4096], np.int32)
    _on_gpu(4, 4, 4096, lengths, 32, 8, page_size, window=window, cap=cap, splits=splits, head_dim=head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch, max_len, page_size", [(32, 8192, None), (32, 8192, 64), (8, 65536, None), (8, 65536, 256)]
)
def test_inference_shapes_on_gpu(batch, max_len, page_size):
    """The shapes the kernel is measured at (GQA 32/8, head_dim 128, bf16), full and ragged caches."""
    lengths = np.full((batch,), max_len, np.int32)
    lengths[::2] = np.random.default_rng(0).integers(1, max_len, batch // 2)
    _on_gpu(1, batch, max_len, lengths, 32, 8, page_size)
