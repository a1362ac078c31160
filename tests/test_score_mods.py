"""Score modifiers (bias, mask, ALiBi, logit soft cap, dropout): their semantics in every implementation,
forward and backward, against the float32 dense reference given the same modifiers (and, for dropout, the same
keep mask), with independent oracles (jax.nn, the keep mask's statistics). The full modifier grid runs on the
XLA chunked path; the portable kernels run "everything" here and one case per kernel code path in
tests/portable/test_score_mods.py; the whole grid on every implementation is `slow`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import masks
from tests.helpers import (
    MODIFIER_CASES,
    MODIFIER_CASES_WITH_EMPTY_ROWS,
    MODIFIER_SHAPE,
    SMALL_BLOCKS,
    check_modifiers_against_reference,
    make_inputs,
    modifier_case,
    modifier_with_block_mask_case,
    normal,
    random_mask,
)
from tests.tolerances import assert_close

IMPLEMENTATIONS = ["pallas", "xla_chunked"]
# (case, is_causal) of the XLA chunked grid outside `slow`: every modifier, causal and not.
CAUSAL = {
    "bias_full": [False],
    "bias_heads_keys": [True],
    "bias_batch_queries": [False],
    "bias_rank2_bf16": [True],
    "bias_minus_inf_rows": [True],
    "mask_empty_rows": [True],
    "mask_keys": [False],
    "alibi": [False],
    "alibi_per_example_soft_cap": [True],
    "soft_cap": [False],
    "dropout": [False],
    "dropout_broadcast": [True],
    "everything": [False],
}  # causal: test_everything_at_once


@pytest.mark.parametrize("case, is_causal", [(c, causal) for c in MODIFIER_CASES for causal in CAUSAL[c]], ids=str)
def test_modifier_against_reference(case, is_causal):
    """Every modifier case on the XLA chunked path (the semantics every implementation shares)."""
    empty = check_modifiers_against_reference(
        "xla_chunked", MODIFIER_SHAPE, jnp.float32, is_causal, modifier_case(case, MODIFIER_SHAPE), SMALL_BLOCKS
    )
    if case in MODIFIER_CASES_WITH_EMPTY_ROWS:
        assert empty.any(), "this case is meant to contain fully masked rows"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_everything_at_once(impl):
    """Bias, mask (with a row that sees nothing), ALiBi, soft cap and dropout in one call, in every
    implementation: outputs, LSE, dq/dk/dv and dbias."""
    empty = check_modifiers_against_reference(
        impl, MODIFIER_SHAPE, jnp.float32, True, modifier_case("everything", MODIFIER_SHAPE), SMALL_BLOCKS
    )
    assert empty.any(), "this case is meant to contain fully masked rows"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_modifiers_low_precision(impl):
    kwargs = dict(
        bias=normal(40, (1, 4, 1, 45)),
        mask=random_mask(41, (2, 1, 37, 45), 0.2),
        logits_soft_cap=3.0,
        alibi_slopes=jnp.geomspace(0.3, 0.03, 4),
    )
    check_modifiers_against_reference(impl, MODIFIER_SHAPE, jnp.bfloat16, True, kwargs, SMALL_BLOCKS, seed=1)


@pytest.mark.parametrize(
    "case, is_causal", [("bias_heads_keys", True), ("mask", False), ("dropout_bias", False)], ids=str
)
def test_modifiers_with_block_mask(case, is_causal):
    """A BlockMask and score modifiers in one call on the XLA chunked path: outputs, LSE, dq/dk/dv and dbias
    against the reference given both (with dropout, the same keep mask). The portable kernels' runs are in
    tests/portable/test_score_mods.py."""
    empty = check_modifiers_against_reference(
        "xla_chunked",
        MODIFIER_SHAPE,
        jnp.float32,
        is_causal,
        modifier_with_block_mask_case(case, MODIFIER_SHAPE),
        SMALL_BLOCKS,
    )
    assert empty.any(), "the block mask hides a whole query block of head 0"


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", MODIFIER_CASES)
@pytest.mark.parametrize(
    "shape", [MODIFIER_SHAPE, (1, 50, 23, 3, 1, 32), (2, 1, 33, 2, 2, 16)], ids=lambda s: "x".join(map(str, s))
)
def test_modifier_grid(shape, case, is_causal, impl):
    check_modifiers_against_reference(impl, shape, jnp.float32, is_causal, modifier_case(case, shape), SMALL_BLOCKS)


def test_bias_and_mask_semantics_match_jax_nn():
    """An independent oracle for bias and mask: jax.nn.dot_product_attention (rows that see some key)."""
    q, k, v, _ = make_inputs((2, 20, 20, 4, 2, 16), jnp.float32, seed=42)
    bias, mask = normal(43, (1, 4, 20, 20)), random_mask(44, (2, 1, 20, 20))
    ours = pf.flash_attention(
        q, k, v, bias=bias, mask=mask, is_causal=True, implementation="xla_chunked", config=SMALL_BLOCKS
    )
    theirs = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=True, implementation="xla")
    seen = np.asarray(mask & jnp.tril(jnp.ones((20, 20), bool))).any(-1).transpose(0, 2, 1)  # [b, q, 1]
    rows = np.broadcast_to(seen, ours.shape[:3])
    assert_close(np.asarray(ours)[rows], np.asarray(theirs)[rows], jnp.float32)


# ---- dropout ------------------------------------------------------------------------------------------------


def _revealed_keep_mask(impl, config, rate, broadcast, rng):
    """Run attention on inputs that make the output the keep mask: all logits equal (q = 0), so
    p = 1 / kv_len, and v = identity rows, so out[b, i, h, j] = keep[b, h, i, j] / (1 - rate) / kv_len."""
    batch, q_len, heads, kv_len = 2, 20, 2, 32
    q = jnp.zeros((batch, q_len, heads, kv_len))
    v = jnp.broadcast_to(jnp.eye(kv_len)[None, :, None, :], (batch, kv_len, heads, kv_len))
    out = pf.flash_attention(
        q,
        q[:, :1].repeat(kv_len, 1),
        v,
        dropout_rate=rate,
        dropout_rng=rng,
        broadcast_dropout=broadcast,
        implementation=impl,
        config=config,
    )
    return np.asarray(out * (1 - rate) * kv_len).round().transpose(0, 2, 1, 3)  # [batch, heads, q, k]


@pytest.mark.parametrize("broadcast", [False, True])
def test_kernel_keep_mask_is_the_plain_jax_mask(broadcast):
    """Bit for bit, in the kernels with two tilings and in the XLA path."""
    rate, rng = 0.4, jax.random.key(50)
    b, h = (0, 0) if broadcast else (np.arange(2)[:, None, None, None], np.arange(2)[None, :, None, None])
    expected = masks.dropout_keep_mask(
        masks.dropout_seed(rng), b, h, np.arange(20)[:, None], np.arange(32)[None, :], rate
    )
    expected = np.broadcast_to(expected, (2, 2, 20, 32)).astype(np.float32)
    runs = [("pallas", SMALL_BLOCKS), ("pallas", pf.KernelConfig()), ("xla_chunked", SMALL_BLOCKS)]
    for impl, config in runs:
        np.testing.assert_array_equal(
            _revealed_keep_mask(impl, config, rate, broadcast, rng),
            expected,
            err_msg=f"{impl} {config.block_q}x{config.block_kv}",
        )
    if not broadcast:  # each (batch, head) draws its own mask
        assert not np.array_equal(expected[0, 0], expected[1, 1])


def test_keep_mask_properties():
    seed = masks.dropout_seed(jax.random.key(51))
    pos = np.arange(512)
    for rate in (0.1, 0.5, 0.9):
        keep = masks.dropout_keep_mask(seed, 0, 0, pos[:, None], pos[None, :], rate)
        assert abs(float(keep.mean()) - (1 - rate)) < 5e-3, rate
    keep = masks.dropout_keep_mask(seed, 0, 0, pos[:, None], pos[None, :], 0.5)
    # No visible structure: rows, columns and the two halves of the key axis are uncorrelated.
    assert abs(float(jnp.corrcoef(keep[:-1].ravel(), keep[1:].ravel())[0, 1])) < 0.02
    assert abs(float(jnp.corrcoef(keep[:, :-1].ravel(), keep[:, 1:].ravel())[0, 1])) < 0.02
    other = masks.dropout_keep_mask(masks.dropout_seed(jax.random.key(52)), 0, 0, pos[:, None], pos[None, :], 0.5)
    assert 0.45 < float(jnp.mean(keep == other)) < 0.55
    # Raw uint32 key data and the typed key give the same seed.
    np.testing.assert_array_equal(masks.dropout_seed(jax.random.PRNGKey(3)), masks.dropout_seed(jax.random.key(3)))


def test_dropout_expectation_is_no_dropout():
    """Averaged over seeds, dropout's output is the no-dropout output (kept weights are scaled by 1/(1-rate))."""
    q, k, v, _ = make_inputs((1, 24, 24, 2, 2, 16), jnp.float32, seed=53)
    attend = functools.partial(
        pf.flash_attention, q, k, v, is_causal=True, implementation="xla_chunked", config=SMALL_BLOCKS
    )
    plain = attend()
    seeds = jax.random.split(jax.random.key(54), 2000)
    mean = jnp.mean(jax.vmap(lambda rng: attend(dropout_rate=0.3, dropout_rng=rng))(seeds), axis=0)
    single = attend(dropout_rate=0.3, dropout_rng=seeds[0])
    # The mean of 2000 draws is ~45x closer than one draw (sqrt(2000)); ask for 10x.
    assert float(jnp.linalg.norm(mean - plain)) < 0.1 * float(jnp.linalg.norm(single - plain))


# ---- argument checking ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(bias=jnp.zeros((2, 2, 8, 7))), ValueError, r"bias has shape \(2, 2, 8, 7\); it must broadcast"),
        (dict(bias=jnp.zeros((1, 2, 2, 8, 8))), ValueError, "bias must have rank <= 4"),
        (dict(bias=jnp.zeros((8, 8), jnp.int32)), TypeError, "bias must be a float array"),
        (dict(mask=jnp.ones((8, 8), jnp.float32)), TypeError, "mask must be a bool array"),
        (dict(mask=jnp.ones((3, 1, 8, 8), bool)), ValueError, "mask has shape"),
        (dict(alibi_slopes=jnp.ones((3,))), ValueError, r"alibi_slopes must have shape \(2,\) or \(2, 2\)"),
        (dict(alibi_slopes=jnp.ones((2,), jnp.int32)), TypeError, "alibi_slopes must be a float array"),
        (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be"),
        (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap must be"),
        (dict(logits_soft_cap=np.float32(-2.0)), ValueError, "logits_soft_cap must be"),  # NumPy scalars are read
        (
            dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)),
            ValueError,
            r"dropout_rate must be a Python float in \[0, 1\)",
        ),
        (dict(dropout_rate=0.1), ValueError, "needs dropout_rng"),
        (dict(dropout_rate=0.1, dropout_rng=jnp.zeros((3,), jnp.uint32)), TypeError, "dropout_rng must be"),
        (dict(broadcast_dropout=1), TypeError, "broadcast_dropout must be a bool"),
    ],
)
def test_bad_modifier_arguments_are_named(kwargs, error, words):
    q = jnp.ones((2, 8, 2, 16))
    with pytest.raises(error, match=words):
        pf.flash_attention(q, q, q, **kwargs)
