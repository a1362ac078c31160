"""Block-sparse attention: the BlockMask builders, the visit tables, and its semantics in every implementation
against the float32 reference (outputs, LSE, gradients), alone and combined with causal, windows, segments and
lengths. What only the portable kernels do with a block mask is in tests/portable/test_block_sparse.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import block_sparse, blocks, masks
from tests.helpers import SMALL_BLOCKS, check_masked_against_reference, make_inputs, random_blocks, random_segment_ids
from tests.tolerances import assert_close


def _token_any(q_len, kv_len, block_q, block_kv, visible):
    """Brute force: block (i, j) holds some pair (query, key) with visible(query, key)."""
    q, k = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    tokens = visible(q, k)
    nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
    out = np.zeros((nq, nk), bool)
    for i in range(nq):
        for j in range(nk):
            out[i, j] = tokens[i * block_q : (i + 1) * block_q, j * block_kv : (j + 1) * block_kv].any()
    return out


# ------------------------------------------------------------------------------------------------ builders


@pytest.mark.parametrize("q_len, kv_len, block_q, block_kv", [(70, 50, 16, 16), (128, 256, 32, 16), (33, 100, 16, 48)])
def test_causal_builder_is_the_blocks_a_causal_mask_touches(q_len, kv_len, block_q, block_kv):
    mask = pf.BlockMask.causal(q_len, kv_len, block_q=block_q, block_kv=block_kv)
    assert mask.shape == (1, 1, -(-q_len // block_q), -(-kv_len // block_kv))
    want = _token_any(q_len, kv_len, block_q, block_kv, lambda q, k: k <= q)
    np.testing.assert_array_equal(mask.mask[0, 0], want)


def test_square_builders_and_density():
    n = 8  # blocks
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    local = pf.BlockMask.local(n * 16, n * 16, 1, block_q=16, block_kv=16)
    np.testing.assert_array_equal(local.mask[0, 0], np.abs(i - j) <= 1)
    causal_local = pf.BlockMask.local(n * 16, n * 16, (2, 5), causal=True, block_q=16, block_kv=16)
    np.testing.assert_array_equal(causal_local.mask[0, 0], (j <= i) & (j >= i - 2))
    strided = pf.BlockMask.strided(n * 16, n * 16, 4, block_q=16, block_kv=16)
    np.testing.assert_array_equal(strided.mask[0, 0], (i - j) % 4 == 0)
    assert strided.density() == 0.25
    strided_causal = pf.BlockMask.strided(n * 16, n * 16, 4, causal=True, block_q=16, block_kv=16)
    np.testing.assert_array_equal(strided_causal.mask[0, 0], ((i - j) % 4 == 0) & (j <= i))
    bigbird = pf.BlockMask.global_local(n * 16, n * 16, 2, 1, block_q=16, block_kv=16)
    np.testing.assert_array_equal(bigbird.mask[0, 0], (np.abs(i - j) <= 1) | (i < 2) | (j < 2))
    assert pf.BlockMask.full(100, 40, block_q=32, block_kv=16).density() == 1.0
    assert local.density() == pytest.approx((3 * n - 2) / n**2)


def test_local_builder_follows_positions_when_blocks_differ():
    """Query blocks twice the key blocks: the window is counted from the key blocks the query block covers."""
    mask = pf.BlockMask.local(128, 128, 1, block_q=32, block_kv=16).mask[0, 0]
    want = _token_any(128, 128, 32, 16, lambda q, k: np.abs(q // 16 - k // 16) <= 1)
    np.testing.assert_array_equal(mask, want)


def test_expand_is_the_token_level_mask():
    mask = pf.BlockMask(random_blocks(0, (2, 1, 3, 4)), block_q=16, block_kv=32)
    dense = mask.expand(40, 100)
    assert dense.shape == (2, 1, 40, 100) and dense.dtype == bool
    q, k = np.meshgrid(np.arange(40), np.arange(100), indexing="ij")
    np.testing.assert_array_equal(dense, mask.mask[:, :, q // 16, k // 32])


def test_block_mask_is_frozen_hashable_and_compared_by_value():
    a = pf.BlockMask(random_blocks(1, (4, 4)), block_q=16, block_kv=16)
    b = pf.BlockMask(a.mask.copy(), block_q=16, block_kv=16)
    assert a == b and hash(a) == hash(b) and a != pf.BlockMask(a.mask, block_q=32, block_kv=16)
    with pytest.raises(ValueError):
        a.mask[0, 0, 0, 0] = True  # read-only: the visit tables are cached by value
    with pytest.raises(AttributeError):
        a.block_q = 32


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: pf.BlockMask(np.ones((2, 2), np.int32)), TypeError, "dtype bool"),
        (lambda: pf.BlockMask(np.ones((2, 2, 2), bool)), ValueError, "must be"),
        (lambda: pf.BlockMask(np.ones((0, 2), bool)), ValueError, "no empty axis"),
        (lambda: pf.BlockMask(np.ones((2, 2), bool), block_q=24), ValueError, "multiple of 16"),
        (lambda: pf.BlockMask(np.ones((2, 2), bool), block_kv=0), ValueError, "positive int"),
        (lambda: pf.BlockMask.local(64, 64, -1, block_q=16, block_kv=16), ValueError, "window"),
        (lambda: pf.BlockMask.strided(64, 64, 0), ValueError, "stride"),
        (lambda: pf.BlockMask.global_local(64, 64, -2, 1), ValueError, "num_global"),
        (lambda: pf.BlockMask.causal(0, 64), ValueError, "q_len"),
    ],
)
def test_bad_block_masks_are_named(make, error, words):
    with pytest.raises(error, match=words):
        make()


@pytest.mark.parametrize(
    "block_mask, error, words",
    [
        (np.ones((4, 4), bool), TypeError, "must be a pallas_flash.BlockMask"),
        (pf.BlockMask(np.ones((3, 4), bool), 16, 16), ValueError, r"need 4 x 4 blocks|4 x 4"),
        (pf.BlockMask(np.ones((3, 1, 4, 4), bool), 16, 16), ValueError, "batch 3"),
        (pf.BlockMask(np.ones((1, 3, 4, 4), bool), 16, 16), ValueError, "heads 3"),
    ],
)
def test_bad_block_mask_arguments_are_named(block_mask, error, words):
    q = jnp.ones((2, 64, 4, 16))
    with pytest.raises(error, match=words):
        pf.flash_attention(q, q, q, block_mask=block_mask)


def test_block_mask_must_be_concrete():
    @jax.jit
    def build(x):
        return pf.BlockMask(x > 0, 16, 16)

    with pytest.raises(TypeError, match="concrete"):
        build(jnp.ones((2, 2)))


# ------------------------------------------------------------------------------------------- visit tables


def test_visit_tables_list_visible_tiles_full_ones_first():
    mask = pf.BlockMask(np.array([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]], bool), block_q=32, block_kv=32)
    band = masks.Band.of(True)
    by_query, by_key = block_sparse.visit_tables(
        mask, block_q=16, block_kv=32, q_pad=96, kv_pad=128, kv_len=120, band=band, always_mask=False
    )
    assert by_query.shape[:3] == (1, 1, 6) and by_key.shape[:3] == (1, 1, 4)
    for table in (by_query, by_key):
        assert table.shape[-1] & (table.shape[-1] - 1) == 0  # a power of two
    rows = {r: list(by_query[0, 0, r, 2 : 2 + by_query[0, 0, r, 1]]) for r in range(6)}
    # Query rows 0-15 (mask row 0): key block 0 only, on the causal diagonal (partial).
    assert rows[0] == [0] and by_query[0, 0, 0, 0] == 0
    assert rows[2] == rows[3] == []  # mask row 1 is empty
    # Rows 80-95 (mask row 2): blocks 0, 1 fully visible, block 2 (keys 64-95) on the diagonal.
    assert rows[5] == [0, 1, 2] and by_query[0, 0, 5, 0] == 2
    # Key block 3 (keys 96-119 and the padded tail) is seen by no query under causal.
    assert by_key[0, 0, 3, 1] == 0
    assert list(by_key[0, 0, 0, 2 : 2 + by_key[0, 0, 0, 1]]) == [4, 5, 0, 1]  # full ones first


def test_visit_tables_of_a_full_mask_match_the_band_ranges():
    """A full block mask under a causal window visits exactly the blocks the band-only kernels visit."""
    band = masks.Band.of(True, (40, 0))
    q_pad, kv_pad, kv_len, block_q, block_kv = 160, 128, 121, 32, 16
    mask = pf.BlockMask.full(q_pad, kv_pad, block_q=32, block_kv=32)
    by_query, by_key = block_sparse.visit_tables(
        mask,
        block_q=block_q,
        block_kv=block_kv,
        q_pad=q_pad,
        kv_pad=kv_pad,
        kv_len=kv_len,
        band=band,
        always_mask=False,
    )
    for r in range(q_pad // block_q):
        lo, ulo, uhi, hi = (
            int(x)
            for x in blocks.kv_block_range(
                r,
                block_q=block_q,
                block_kv=block_kv,
                num_kv_blocks=kv_pad // block_kv,
                kv_len=kv_len,
                band=band,
                always_mask=False,
            )
        )
        row = by_query[0, 0, r]
        assert sorted(row[2 : 2 + row[1]]) == list(range(lo, hi))
        assert list(row[2 : 2 + row[0]]) == list(range(ulo, uhi))
    for c in range(kv_pad // block_kv):
        lo, _, _, hi = (
            int(x)
            for x in blocks.q_block_range(
                c,
                block_q=block_q,
                block_kv=block_kv,
                num_q_blocks=q_pad // block_q,
                kv_len=kv_len,
                band=band,
                always_mask=False,
            )
        )
        row = by_key[0, 0, c]
        assert sorted(row[2 : 2 + row[1]]) == list(range(lo, hi))


def test_kernel_blocks_divide_the_mask_blocks():
    assert block_sparse.kernel_block(128, 64) == 64
    assert block_sparse.kernel_block(64, 48) == 16
    assert block_sparse.kernel_block(32, 256) == 32


# --------------------------------------------------------------------------- against the reference


def _cases():
    k1, _ = jax.random.split(jax.random.key(11))
    return {
        # a random mask; ragged lengths, q_len != kv_len, GQA
        "random": dict(shape=(2, 70, 50, 4, 2, 32), mask=lambda: pf.BlockMask(random_blocks(0, (5, 4)), 16, 16)),
        "local": dict(shape=(1, 90, 90, 2, 2, 16), mask=lambda: pf.BlockMask.local(90, 90, 1, block_q=16, block_kv=16)),
        # MQA; mask blocks of 32 over kernel tiles of 16 and 32
        "strided": dict(
            shape=(1, 96, 96, 2, 1, 16), mask=lambda: pf.BlockMask.strided(96, 96, 3, block_q=32, block_kv=32)
        ),
        "global_local": dict(
            shape=(1, 100, 100, 2, 2, 16),
            mask=lambda: pf.BlockMask.global_local(100, 100, 1, 1, block_q=16, block_kv=16),
        ),
        # per example and per query head, GQA
        "per_head": dict(
            shape=(2, 50, 70, 4, 2, 32), mask=lambda: pf.BlockMask(random_blocks(1, (2, 4, 4, 5)), 16, 16)
        ),
        # whole query blocks and key blocks masked: rows that see nothing, keys that nobody sees
        "empty_blocks": dict(
            shape=(1, 64, 48, 2, 2, 16),
            mask=lambda: pf.BlockMask(np.array([[1, 0, 1], [0, 0, 0], [1, 0, 0], [0, 0, 1]], bool), 16, 16),
        ),
        # non-power-of-two mask blocks (kernel tiles shrink to 16) and lengths that are not block multiples
        "blocks_48x64": dict(
            shape=(1, 130, 100, 2, 2, 32),
            mask=lambda: pf.BlockMask(random_blocks(2, (3, 2), 0.7), block_q=48, block_kv=64),
        ),
        # with segment ids and lengths (every visited tile masked) and a window
        "segments": dict(
            shape=(2, 70, 70, 2, 2, 16),
            mask=lambda: pf.BlockMask(random_blocks(3, (5, 5), 0.6), 16, 16),
            kwargs=dict(segment_ids=random_segment_ids(k1, 2, 70, 3), key_value_seq_lengths=jnp.array([70, 41])),
        ),
        "window": dict(
            shape=(1, 80, 80, 2, 2, 16),
            mask=lambda: pf.BlockMask.strided(80, 80, 2, block_q=16, block_kv=16),
            kwargs=dict(local_window_size=(30, 10)),
        ),
    }


CASES = _cases()
# One causal setting per case (the grid's time goes to compiles); the random mask runs non-causal in the
# bfloat16 test below.
CAUSAL = {
    "random": [True],
    "local": [True],
    "strided": [False],
    "global_local": [True],
    "per_head": [False],
    "empty_blocks": [False],
    "blocks_48x64": [True],
    "segments": [True],
    "window": [False],
}
# The portable kernels' cases outside `slow`: one per way their visit tables differ from the dense band
# ranges (tests/portable/test_block_sparse.py adds the kernel-only checks).
PALLAS_CASES = {"random", "per_head", "empty_blocks", "blocks_48x64", "segments", "window"}


def check_case(case, is_causal, impl, dtype=jnp.float32):
    shape, kwargs = CASES[case]["shape"], CASES[case].get("kwargs", {})
    empty = check_masked_against_reference(
        impl, shape, kwargs, is_causal, dtype=dtype, seed=12, block_mask=CASES[case]["mask"]()
    )
    if case == "empty_blocks":
        assert empty.any(), "this case is meant to contain rows that see no key"


def _grid():
    params = []
    for case in CASES:
        for is_causal in CAUSAL[case]:
            for impl in ("pallas", "xla_chunked"):
                marks = [pytest.mark.slow] if impl == "pallas" and case not in PALLAS_CASES else []
                params.append(pytest.param(case, is_causal, impl, marks=marks, id=f"{case}-{is_causal}-{impl}"))
    return params


@pytest.mark.parametrize("case, is_causal, impl", _grid())
def test_block_sparse_against_reference(case, is_causal, impl):
    check_case(case, is_causal, impl)


@pytest.mark.parametrize("impl", ["pallas", "xla_chunked"])
def test_block_sparse_bfloat16(impl):
    check_case("random", False, impl, jnp.bfloat16)


def test_block_mask_under_jit_as_a_static_argument():
    q, k, v, _ = make_inputs((1, 48, 48, 2, 2, 16), jnp.float32, seed=14)
    attend = jax.jit(pf.flash_attention, static_argnames=("block_mask", "implementation", "config"))
    block_mask = pf.BlockMask.local(48, 48, 1, block_q=16, block_kv=16)
    out = attend(q, k, v, block_mask=block_mask, implementation="xla_chunked", config=SMALL_BLOCKS)
    ref = pf.attention_reference(q, k, v, scale=16**-0.5, block_mask=block_mask)[0]
    assert_close(out, ref, jnp.float32)
