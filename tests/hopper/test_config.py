"""The Hopper kernels' configs (`pallas_flash/hopper/config.py`): validation, the measured defaults, and
what fits an H100's shared memory."""

import dataclasses

import jax.numpy as jnp
import pytest

from pallas_flash import masks, mods
from pallas_flash.config import KernelConfig
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper import vjp as hopper_vjp
from pallas_flash.hopper.bwd_ordered import dq_split
from pallas_flash.hopper.config import H100_SHARED_MEMORY, HopperBwdConfig, HopperConfig

# ---- forward --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "head_dim, kv_len, is_causal, window, overlap, persistent",
    [
        (128, 2048, False, None, True, True),
        (128, 4096, True, None, True, True),
        (128, 8192, False, None, True, False),
        (128, 16384, True, None, True, False),
        (128, None, False, None, True, False),
        (128, 1024, False, None, False, True),  # short rows: no overlap (unmeasured with it)
        (128, 2048, False, (300, 77), True, True),  # a window's rows are as long as its size (377 keys), overlapped
        (128, 16384, True, (1024, None), True, True),  # a 1k causal window
        (128, 16384, True, (2048, None), True, True),  # 2k: long, but not past 4k
        (128, 16384, True, (8192, None), True, False),
        (128, 4096, False, (None, 0), True, True),  # causal: as unmasked calls
        (64, 8192, False, None, False, False),
        (64, 4096, False, None, False, True),
        (256, 4096, False, None, True, False),  # wider heads: always (64-key blocks)
        (192, 1024, True, None, True, True),
    ],
)
def test_hopper_default_overlaps_only_where_measured(head_dim, kv_len, is_causal, window, overlap, persistent):
    """The forward default turns FA3's overlap on at head_dim 128 past 1k keys and for windows of any span (whose
    rows count as long as the span), and at wider heads always; it keeps head_dim 64 (slower with it) on the
    ping-pong; rows up to 4k keys at head_dim 64 and 128 take persistent CTAs."""
    config = hopper_fwd.default_config(head_dim, kv_len, masks.Band.of(is_causal, window))
    assert (config.overlap, config.persistent) == (overlap, persistent)
    if overlap:
        assert config.block_kv == (128 if head_dim == 128 else 64)


def test_hopper_default_persists_rows_up_to_4k_at_head_dim_128():
    """Rows up to 4k keys at head_dim 128 take persistent CTAs with the overlap (non-causal 2k 5% faster than one
    CTA per tile, causal 4k 4%); longer ones one CTA per tile (a tie at 8k, causal 16k 6% slower)."""
    persistent = HopperConfig(64, 128, 2, persistent=True, overlap=True)
    for is_causal in (False, True):
        assert HopperConfig.default(128, 2048, is_causal) == persistent
        assert HopperConfig.default(128, 4096, is_causal) == persistent
        assert HopperConfig.default(128, 4097, is_causal) == HopperConfig(64, 128, 2, persistent=False, overlap=True)


def test_hopper_default_persists_sparse_rows_at_head_dim_128():
    """Rows that may visit only some key blocks (segment ids, a mask program, a dense or block mask) take
    persistent CTAs at head_dim 128 (8 documents in 8k keys: 9% faster, 16 causal ones in 16k: 17%), and the entry
    points tell the kernels' sparse calls from the rest."""
    persistent = HopperConfig(64, 128, 2, persistent=True, overlap=True)
    for is_causal in (False, True):
        assert HopperConfig.default(128, 16384, is_causal, sparse=True) == persistent
        assert HopperConfig.default(128, 16384, is_causal) == HopperConfig(64, 128, 2, overlap=True)
    assert HopperConfig.default(64, 8192, False, sparse=True) == HopperConfig.default(64, 8192, False)
    ids = jnp.zeros((1, 8), jnp.int32)
    assert hopper_vjp._sparse_rows(masks.ScoreMods(mask_mod=lambda b, h, q, k: q >= k), None)
    assert hopper_vjp._sparse_rows(masks.ScoreMods(), None, ids)
    assert not hopper_vjp._sparse_rows(masks.ScoreMods(score_mod=lambda s, b, h, q, k: s), None)
    full = hopper_fwd.default_config(128, 8192, masks.Band())
    assert hopper_fwd.default_config(128, 8192, masks.Band(), sparse=True) == dataclasses.replace(full, persistent=True)


def test_hopper_default_persists_causal_rows_up_to_8k_up_to_head_dim_192():
    """Causal rows up to 8k keys at head_dim 192 (and MLA's 192 with value 128) take persistent CTAs (4k: 0.458 ms
    against 0.509 with one CTA per tile); 16k rows and head_dim 256 (no gain) one CTA per tile."""
    persistent = HopperConfig(64, 64, 2, persistent=True, overlap=True)
    assert HopperConfig.default(192, 8192, True) == persistent
    assert HopperConfig.default(160, 2048, True) == persistent
    for args in ((192, 8193, True), (192, 4096, False), (256, 4096, True)):
        assert HopperConfig.default(*args) == HopperConfig(64, 64, 2, persistent=False, overlap=True), args
    config = hopper_fwd.default_config(192, 4096, masks.Band.of(True, None), head_dim_v=128)
    assert (config.persistent, config.overlap) == (True, True)


def test_hopper_default_tiles_at_head_dim_64():
    """head_dim 64: causal rows up to 1k on 128-key blocks, 3 stages, persistent; longer causal rows (2k
    measured 1.040x cuDNN on 256-key blocks against 0.989x on 128) on 256-key blocks, persistent up to 8k;
    non-causal rows persistent up to 4k (2k: 8% faster than one CTA per tile)."""
    assert HopperConfig.default(64, 1024, True) == HopperConfig(64, 128, 3, True)
    assert HopperConfig.default(64, 2048, True) == HopperConfig(64, 256, 2, True)
    assert HopperConfig.default(64, 8193, True) == HopperConfig(64, 256, 2, False)
    assert HopperConfig.default(64, 4096, False) == HopperConfig(64, 256, 2, True)
    assert HopperConfig.default(64, 4097, False) == HopperConfig(64, 256, 2, False)


# ---- backward -------------------------------------------------------------------------------------------------


def test_config_validation():
    assert HopperBwdConfig() == HopperBwdConfig(64, 64, 2, 64, 64, 2)
    for bad in (
        dict(block_q_dkv=32),
        dict(block_kv_dq=100),
        dict(block_kv_dkv=320),
        dict(num_stages_dq=1),
        dict(block_q_dq=64.0),
        dict(num_stages_dkv=True),
        dict(dq_atomic=1),
        dict(dq_overlap=1),
        dict(portable=1),
    ):
        with pytest.raises(ValueError):
            HopperBwdConfig(**bad)
    with pytest.raises(TypeError):
        KernelConfig(hopper_bwd=dict(block_q_dkv=64))
    assert KernelConfig(hopper_bwd=HopperBwdConfig()).hopper_bwd == HopperBwdConfig()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_tiles_fit_shared_memory(head_dim):
    config = HopperBwdConfig.default(head_dim)
    assert config.smem_bytes_dkv(head_dim) <= H100_SHARED_MEMORY
    assert config.smem_bytes_dq(head_dim) <= H100_SHARED_MEMORY
    hopper_bwd.check_config(config, head_dim)
    with pytest.raises(ValueError, match="shared memory"):
        hopper_bwd.check_config(dataclasses.replace(config, num_stages_dkv=8), head_dim)
    # The one pass's dS^T tile and dQ staging slots fit beside the default tiles, with a 2-stage ring (the
    # two-pass dkv_overlap default at head_dim 128 takes 4).
    one_pass = dataclasses.replace(config, dq_atomic=True, num_stages_dkv=2)
    hopper_bwd.check_config(one_pass, head_dim)
    with pytest.raises(ValueError, match="shared memory"):
        hopper_bwd.check_config(dataclasses.replace(one_pass, num_stages_dkv=3), head_dim)


def test_one_pass_needs_a_dq_split():
    """At head_dim 64 the consumers split dQ by query rows (half a head_dim is not a whole 64-column swizzle
    tile), which needs block_q_dkv >= 128."""
    assert dq_split(128, 64) == "columns" and dq_split(64, 128) == "rows"
    with pytest.raises(ValueError, match="block_q_dkv >= 128"):
        hopper_bwd.check_config(HopperBwdConfig(block_q_dkv=64, dq_atomic=True), 64)


def test_head_dim_256_splits_the_columns():
    """At head_dim 256 the default backward splits each pass's accumulator columns between the consumers (their
    own dK and dV would exceed shared memory and the register file); a config without it is refused."""
    config = HopperBwdConfig.default(256)
    assert config.split_columns and not config.dq_atomic
    hopper_bwd.check_config(config, 256)
    with pytest.raises(ValueError, match="split_columns"):
        hopper_bwd.check_config(HopperBwdConfig(), 256)


def test_split_products_need_split_columns_and_fit_at_256():
    """Each pass's split products split split_columns' work (not with that pass's overlap), and their shared
    tiles fit beside head_dim 256's (the dK/dV pass's P^T and dS^T: 16 KiB)."""
    for bad in (
        dict(dq_split_products=True),
        dict(dkv_split_products=True),
        dict(split_columns=True, dq_split_products=True, dq_overlap=True),
        dict(split_columns=True, dkv_split_products=True, dkv_overlap=True),
        dict(split_columns=True, dkv_split_products=1),
    ):
        with pytest.raises(ValueError, match="split_products"):
            HopperBwdConfig(**bad)
    both = HopperBwdConfig.default(256)
    hopper_bwd.check_config(both, 256)
    unshared = dataclasses.replace(both, dkv_split_products=False)
    assert both.smem_bytes_dkv(256) - unshared.smem_bytes_dkv(256) == 2 * 64 * 64 * 2


def test_dq_ordered_config():
    """dq_ordered is a bool, only with dq_atomic (the two-pass backward is deterministic already). The
    defaults are deterministic unless asked not to be: head_dim 64 runs the one pass, ordered by default,
    except deterministic causal rows up to 2k keys (the two passes); head_dim 128 the two passes either way,
    both kernels pipelined, causal or not."""
    assert HopperBwdConfig(dq_atomic=True, dq_ordered=True).dq_ordered
    for bad in (dict(dq_ordered=True), dict(dq_ordered=1, dq_atomic=True), dict(dq_ordered=None)):
        with pytest.raises(ValueError, match="dq_ordered"):
            HopperBwdConfig(**bad)
    for deterministic in (True, False):
        at_64, at_128 = HopperBwdConfig.default(64, deterministic), HopperBwdConfig.default(128, deterministic)
        assert at_64.dq_atomic and at_64.dq_ordered == deterministic
        assert not at_128.dq_atomic and not at_128.dq_ordered and at_128.dq_overlap and at_128.dkv_overlap
        assert HopperBwdConfig.default(128, deterministic, is_causal=True) == at_128
        for kv_len, is_causal in ((2048, False), (2049, True), (None, True)):
            assert HopperBwdConfig.default(64, deterministic, kv_len, is_causal) == at_64
    short_causal = HopperBwdConfig.default(64, True, kv_len=2048, is_causal=True)
    assert not short_causal.dq_atomic and not short_causal.dq_ordered
    assert HopperBwdConfig.default(64, False, kv_len=2048, is_causal=True).dq_atomic
    config = HopperBwdConfig(block_q_dkv=128, dq_atomic=True)  # same shared memory: the counters are global
    assert dataclasses.replace(config, dq_ordered=True).smem_bytes_dkv(64) == config.smem_bytes_dkv(64)


def test_backward_default_under_score_programs():
    """At head_dim 128 a score program's backward takes delta_in_dp, and a nonlinear one (a soft cap, whose
    derivative tile stays live) the passes without their overlaps; head_dim 64 and calls without one keep theirs.
    The entry point tells the kinds apart: biases and ALiBi are linear in the logit, a soft cap is not, and a soft
    cap the kernels apply themselves (before a dense bias) counts as nonlinear."""
    band = masks.Band()
    plain = hopper_bwd.default_config(128, 16384, band, True, programs=True)
    linear = hopper_bwd.default_config(128, 16384, band, True, programs=True, score="linear")
    nonlinear = hopper_bwd.default_config(128, 16384, band, True, programs=True, score="nonlinear")
    assert not plain.delta_in_dp and plain.dq_overlap and plain.dkv_overlap
    assert linear == dataclasses.replace(plain, delta_in_dp=True)
    assert nonlinear.delta_in_dp and not (nonlinear.dq_overlap or nonlinear.dkv_overlap)
    assert (nonlinear.num_stages_dq, nonlinear.num_stages_dkv) == (2, 2)
    assert hopper_bwd.default_config(64, 16384, band, True, programs=True, score="nonlinear") == (
        hopper_bwd.default_config(64, 16384, band, True, programs=True)
    )

    def kind(fn):
        return hopper_bwd.score_kind(mods.stage(mods.trace(fn, "score")[0])[0])

    assert kind(mods.alibi(jnp.ones(2))) == "linear"
    assert kind(lambda s, b, h, q, k: s + jnp.ones(8)[k]) == "linear"
    assert kind(mods.soft_cap(30.0)) == "nonlinear"
    assert hopper_bwd.score_kind(None) is None
    assert hopper_bwd.score_kind(None, 30.0) == "nonlinear"
    config = KernelConfig.default(128)
    capped = hopper_vjp._backward_config(config, 128, 16384, band, True, masks.ScoreMods(soft_cap=30.0))
    assert capped == nonlinear


def test_delta_in_dp_config():
    """delta_in_dp (dP^T's accumulator starting at -delta) is a bool, on by default at head_dim 64 (the one pass,
    ordered or free, and the two passes of causal rows up to 2k keys) and for head_dim 128's causal rows up to 8k
    keys; off for head_dim 128's other rows."""
    for deterministic in (True, False):
        for kv_len, is_causal in ((None, False), (2048, True), (16384, True), (2048, False)):
            assert HopperBwdConfig.default(64, deterministic, kv_len=kv_len, is_causal=is_causal).delta_in_dp
        assert not HopperBwdConfig.default(128, deterministic).delta_in_dp
        assert not HopperBwdConfig.default(128, deterministic, kv_len=2048, is_causal=False).delta_in_dp
        assert not HopperBwdConfig.default(128, deterministic, kv_len=16384, is_causal=True).delta_in_dp
        for kv_len in (1, 2048, 8192):
            assert HopperBwdConfig.default(128, deterministic, kv_len=kv_len, is_causal=True).delta_in_dp
    two_passes = HopperBwdConfig.default(64, True, kv_len=2048, is_causal=True)
    assert not two_passes.dq_atomic and two_passes.delta_in_dp
    assert not HopperBwdConfig().delta_in_dp
    with pytest.raises(ValueError, match="delta_in_dp"):
        HopperBwdConfig(delta_in_dp=1)


def test_backward_after_the_hopper_forward():
    """Which backward runs after the Hopper forward: the Hopper one (the call's default tiles, or
    config.hopper_bwd's), the portable one where `HopperBwdConfig(portable=True)` asks for it, and the
    portable one where the head dims need split_columns and config.hopper_bwd has none (256); square 192 splits
    at 192 (96-column halves) and 160 at 192 too."""
    band = masks.Band.of(True)
    choose = hopper_vjp._backward_config
    assert choose(KernelConfig(), 64, 1024, band, True) == hopper_bwd.default_config(64, 1024, band, True)
    assert choose(KernelConfig(), 128, 4096, band, False) == hopper_bwd.default_config(128, 4096, band, False)
    tiles = HopperBwdConfig(dq_overlap=True, num_stages_dq=3)
    assert choose(KernelConfig(hopper_bwd=tiles), 64, 1024, band, True) == tiles
    assert choose(KernelConfig(hopper_bwd=HopperBwdConfig(portable=True)), 64, 1024, band, True) is None
    assert choose(KernelConfig(hopper_bwd=tiles), 256, 1024, band, True) is None
    # square 192 splits its columns into 96-column halves, unpadded; 160 computes at 192
    assert hopper_bwd.backward_head_dims(192) == hopper_bwd.backward_head_dims(160) == (192, 192)
    assert choose(KernelConfig(), 192, 1024, band, True) == hopper_bwd.default_config(192, 1024, band, True)
    assert choose(KernelConfig(), 160, 1024, band, True).split_columns
