"""The Hopper backward (`kernels/hopper_bwd.py`): gradients against the float32 reference on sm90, and on CPU
its config validation, its lowering for the GPU, and its two kernels in JAX's Mosaic GPU interpreter (with
plain dots for the wgmmas, see `_dkdv_kernel`'s `interpreting`) against the reference."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import _compat, masks, reference
from pallas_flash.config import H100_SHARED_MEMORY, HopperBwdConfig, KernelConfig
from pallas_flash.kernels import hopper_bwd, hopper_fwd
from tests.tolerances import GRADIENT, assert_close

# (batch, q_len, kv_len, heads, kv_heads, head_dim)
GPU_GRID = [(1, 256, 256, 2, 2, 64), (2, 1000, 1000, 4, 2, 128), (1, 777, 1531, 4, 1, 64),
            (1, 1531, 513, 4, 4, 128), (1, 300, 300, 2, 2, 96)]


def _inputs(shape, dtype, seed=0):
    batch, q_len, kv_len, heads, kv_heads, head_dim = shape
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (batch, q_len, heads, head_dim), dtype)
    k = jax.random.normal(ks[1], (batch, kv_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(ks[2], (batch, kv_len, kv_heads, head_dim), dtype)
    d_out = jax.random.normal(ks[3], q.shape, dtype)
    d_lse = 0.1 * jax.random.normal(ks[4], (batch, heads, q_len), jnp.float32)
    return q, k, v, d_out, d_lse


def test_config_validation():
    assert HopperBwdConfig() == HopperBwdConfig(64, 64, 2, 64, 64, 2)
    for bad in (dict(block_q_dkv=32), dict(block_kv_dq=100), dict(block_kv_dkv=320), dict(num_stages_dq=1),
                dict(block_q_dq=64.0), dict(num_stages_dkv=True), dict(dq_atomic=1), dict(dq_overlap=1)):
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
    assert hopper_bwd.dq_split(128, 64) == "columns" and hopper_bwd.dq_split(64, 128) == "rows"
    with pytest.raises(ValueError, match="block_q_dkv >= 128"):
        hopper_bwd.check_config(HopperBwdConfig(block_q_dkv=64, dq_atomic=True), 64)


def test_head_dim_256_is_refused():
    with pytest.raises(ValueError, match="head_dim <= 128"):
        HopperBwdConfig.default(256)
    x = jnp.zeros((1, 64, 1, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim <= 128"):
        hopper_bwd.hopper_backward(x, x, x, x, jnp.zeros((1, 1, 64)), x, None, scale=1.0, is_causal=False)


BACKWARD_VARIANTS = {  # HopperBwdConfig fields over the default's, per backward variant under test
    "two_pass": dict(dq_atomic=False, dq_ordered=False, dq_overlap=False, num_stages_dq=2, dkv_overlap=False,
                     num_stages_dkv=2),
    "two_pass_dq_overlap": dict(dq_atomic=False, dq_ordered=False, dq_overlap=True, num_stages_dq=4,
                                dkv_overlap=False, num_stages_dkv=2),
    "two_pass_dkv_overlap": dict(dq_atomic=False, dq_ordered=False, dkv_overlap=True, num_stages_dkv=4,
                                 delta_in_dp=False),
    "two_pass_dkv_overlap_delta_in_dp": dict(dq_atomic=False, dq_ordered=False, dkv_overlap=True, num_stages_dkv=4,
                                             delta_in_dp=True),
    "one_pass": dict(dq_atomic=True, dq_ordered=False, num_stages_dkv=2),
}


@pytest.mark.parametrize("variant", list(BACKWARD_VARIANTS))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape,dtype", [((1, 300, 200, 4, 2, 64), jnp.bfloat16),
                                         ((1, 200, 333, 2, 1, 96), jnp.float16)])
def test_lowers_for_gpu(shape, dtype, is_causal, variant):
    """Both kernels (or, with dq_atomic, the one-pass kernel and its TMA reduce-adds into a dQ buffer) go
    through Mosaic GPU's lowering (ragged lengths, GQA, padded head_dim), under the names a profile shows."""
    q, k, v, d_out, d_lse = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _inputs(shape, dtype))
    lse = d_lse
    config = dataclasses.replace(HopperBwdConfig.default(128 if shape[-1] > 64 else 64), **BACKWARD_VARIANTS[variant])
    dq_atomic = config.dq_atomic

    def backward(*args):
        return hopper_bwd.hopper_backward(*args, scale=0.125, is_causal=is_causal, config=config)

    text = jax.jit(backward).trace(q, k, v, q, lse, d_out, d_lse).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == (1 if dq_atomic else 2)
    assert ("cp.reduce.async.bulk.tensor" in text) == dq_atomic
    assert "flash_backward_dkdv_sm90" in text and ("flash_backward_dq_sm90" in text) != dq_atomic


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_pass_lowers_for_gpu(head_dim, is_causal, dtype):
    """The one-pass kernel (shared dS^T tile, each consumer's share of dQ from all keys: columns at head_dim
    128, query rows at 64; two dQ staging slots) goes through Mosaic GPU's lowering: ragged, GQA."""
    q = jax.ShapeDtypeStruct((1, 200, 4, head_dim), dtype)
    k = jax.ShapeDtypeStruct((1, 333, 2, head_dim), dtype)
    lse = jax.ShapeDtypeStruct((1, 4, 200), jnp.float32)
    config = dataclasses.replace(HopperBwdConfig.default(head_dim), dq_atomic=True, dq_ordered=False, num_stages_dkv=2)

    def backward(*args):
        return hopper_bwd.hopper_backward(*args, scale=0.125, is_causal=is_causal, config=config)

    text = jax.jit(backward).trace(q, k, k, q, lse, q, lse).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "cp.reduce.async.bulk.tensor" in text


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


def _brute_force_ranks(batch, num_tiles, tile_keys, num_q_blocks, block_q, band, q_ids=None, kv_ids=None):
    """`hopper_bwd.dq_order_ranks` from first principles: key tile t visits query block j if some (query, key)
    pair of theirs is in the band and (with ids, sorted here) their valid id intervals overlap; entry (b, t, j)
    counts the tiles after t that visit j."""
    q_pos = np.arange(num_q_blocks * block_q)[:, None]
    k_pos = np.arange(num_tiles * tile_keys)[None, :]
    seen = np.ones((q_pos.size, k_pos.size), bool)
    if band.right is not None:
        seen &= k_pos <= q_pos + band.right
    if band.left is not None:
        seen &= k_pos >= q_pos - band.left
    visits = seen.reshape(num_q_blocks, block_q, num_tiles, tile_keys).any(axis=(1, 3)).T  # [tile, block]
    visits = np.broadcast_to(visits, (batch, num_tiles, num_q_blocks)).copy()
    if q_ids is not None:
        def interval(ids, size):
            ids = np.asarray(ids).reshape(batch, -1, size)
            valid = ids > masks.KEY_PADDING_ID
            return (np.where(valid, ids, np.iinfo(np.int32).max).min(2),
                    np.where(valid, ids, np.iinfo(np.int32).min).max(2))
        (t_lo, t_hi), (b_lo, b_hi) = interval(kv_ids, tile_keys), interval(q_ids, block_q)
        visits &= (t_lo[:, :, None] <= b_hi[:, None, :]) & (b_lo[:, None, :] <= t_hi[:, :, None])
    visits = visits.astype(np.int32)
    return np.cumsum(visits[:, ::-1], axis=1)[:, ::-1] - visits, visits


@pytest.mark.parametrize("is_causal, window, segments", [
    (False, None, False), (True, None, False), (False, (300, 100), False), (True, (200, None), False),
    (False, None, True), (True, (300, None), True)])
def test_dq_order_ranks(is_causal, window, segments):
    """The rank table the dq_ordered kernel waits on: per (example, key tile, query block), how many higher key
    tiles visit that block, against a brute-force count (queries and keys of unequal lengths, padding); and the
    rows of the blocks some tile visits (the kernel writes no others of its dQ buffer)."""
    batch, block_q, tile_keys, num_q_blocks, num_tiles = 2, 64, 128, 9, 7
    band = masks.Band.of(is_causal, window)
    q_ids = kv_ids = q_ranges = None
    if segments:  # packed sequences, the last rows / keys padding (as `pad_segment_ids` leaves them)
        q_ids, kv_ids = masks.pad_segment_ids(_segment_ids(batch, 520, [[100, 300], [250]]),
                                              _segment_ids(batch, 800, [[150, 500], [40]]),
                                              num_q_blocks * block_q, num_tiles * tile_keys)
        q_ranges = hopper_fwd.segment_block_ranges(kv_ids, q_ids, rows_per_tile=tile_keys, cols_per_block=block_q)
    common = dict(batch=batch, num_tiles=num_tiles, block_q=block_q, tile_keys=tile_keys,
                  num_q_blocks=num_q_blocks, kv_pad=num_tiles * tile_keys, band=band)
    visits_table = hopper_bwd.tile_visits(q_ranges, **common)
    ranks = hopper_bwd.dq_order_ranks(visits_table)
    want, visits = _brute_force_ranks(batch, num_tiles, tile_keys, num_q_blocks, block_q, band, q_ids, kv_ids)
    assert ranks.dtype == jnp.int32 and ranks.shape == want.shape
    np.testing.assert_array_equal(ranks, want)
    rows = hopper_bwd.dq_visited_rows(visits_table, block_q)
    np.testing.assert_array_equal(rows, np.repeat(visits.any(axis=1), block_q, axis=1))
    assert rows.all() != (is_causal and segments)  # the last point leaves a block unvisited
    assert 0 < visits.sum() and (visits.sum() < visits.size) == (not band.is_full or segments)  # masks skip some


def _simulate_dq_order(ranks, visited, *, heads_per_kv: int, kv_heads: int, resident: int, seed: int,
                       monkeypatch):
    """The dq_ordered protocol on the CPU: CTAs dispatched in `hopper_bwd.ordered_launch`'s order (decoded by
    `ordered_cta`; 3 pairs per launch group, so that the last group is partial), at most `resident` at once;
    each move is one random resident CTA's store warp's next action. A CTA's steps are (g, block) for each
    head of its group and each block it visits; at step i the store warp waits until step i's semaphore
    reaches its rank and adds, and its next move signals that semaphore (the add has landed: this needs
    nothing from other CTAs); after its last signal it exits. Inactive CTAs (past the last pair) exit at once.
    Step numbers decode by `hopper_bwd.step_block`, as in the kernel. Returns the tiles in the order they added
    into each (batch, head, block) and the semaphores' final values; raises on a deadlock."""
    rng = np.random.default_rng(seed)
    batch, num_tiles, _ = ranks.shape
    grid, names = hopper_bwd.ordered_launch(batch, kv_heads, num_tiles, group=3)
    pending = []  # (batch, kv head, tile) or None (inactive), in launch order: CUDA's x (the last axis) fastest
    for index in np.ndindex(*grid):
        axes = dict(zip(names, (np.int32(i) for i in index)))
        monkeypatch.setattr(hopper_bwd.lax, "axis_index", lambda name: axes[name])
        b, h, t, active = (int(x) for x in hopper_bwd.ordered_cta(batch, kv_heads, num_tiles, group=3))
        pending.append((b, h, t) if active else None)
    monkeypatch.undo()
    assert sorted(cta for cta in pending if cta) == [(b, h, t) for b in range(batch) for h in range(kv_heads)
                                                     for t in range(num_tiles)]
    def cta_steps(lo, hi):  # the kernel's own decode of step numbers (its loader's and store warp's order)
        decode = functools.partial(hopper_bwd.step_block, q_lo=np.int32(lo), q_steps=np.int32(hi - lo))
        return [tuple(int(x) for x in decode(np.int32(i))) for i in range(heads_per_kv * (hi - lo))]

    steps = {cta: cta_steps(*visited[cta[0]][cta[2]]) for cta in pending if cta}
    assert all(sorted(s) == [(g, j) for g in range(heads_per_kv) for j in range(*visited[cta[0]][cta[2]])]
               for cta, s in steps.items())
    semaphores, order, running = {}, {}, {}  # running: slot -> [cta, next step, whether step - 1 is signalled]

    def counter(cta, step):
        (b, h, _), (g, j) = cta, steps[cta][step]
        return b, h * heads_per_kv + g, j

    def ready(slot):
        cta, i, signalled = running[slot]
        if cta is None or i > 0 and not signalled or i == len(steps[cta]):
            return True  # to exit, to signal, or to exit after the last signal
        b, _, t = cta
        return semaphores.get(counter(cta, i), 0) >= ranks[b, t, steps[cta][i][1]]

    launched = 0
    while pending or running:
        while pending and len(running) < resident:
            running[launched], launched = [pending.pop(0), 0, True], launched + 1
        movable = [slot for slot in running if ready(slot)]
        if not movable:
            raise AssertionError(f"deadlock with {resident} resident CTAs: {running}")
        slot = movable[rng.integers(len(movable))]
        cta, i, signalled = running[slot]
        if cta is None:
            del running[slot]
        elif i > 0 and not signalled:
            semaphores[counter(cta, i - 1)] = semaphores.get(counter(cta, i - 1), 0) + 1
            running[slot][2] = True
        elif i == len(steps[cta]):
            del running[slot]
        else:
            order.setdefault(counter(cta, i), []).append(cta[2])
            running[slot] = [cta, i + 1, False]
    return order, semaphores


@pytest.mark.parametrize("pairs, dq_bytes, want", [
    (256, 1024 * 64 * 4, 32),   # 1k keys, head_dim 64: 256 KiB of dQ per pair; at most 32 pairs
    (256, 2048 * 64 * 4, 16),   # 2k: 512 KiB per pair, 8 MiB per group
    (32, 16384 * 64 * 4, 2),    # 16k, head_dim 64: 4 MiB per pair
    (3, 1024 * 64 * 4, 3),      # fewer pairs than a group holds
    (8, 1 << 26, 1)])           # one pair's dQ alone over the L2 budget: one pair per group
def test_dq_ordered_launch_groups_keep_dq_in_l2(pairs, dq_bytes, want):
    """A dq_ordered launch group's dQ (every pair a wave of CTAs adds into) stays within hopper_bwd.DQ_L2_BYTES,
    with at least one and at most MAX_PAIRS_PER_GROUP pairs; the grid covers every pair."""
    group = hopper_bwd.pairs_per_group(pairs, dq_bytes)
    assert group == want
    (groups, tiles, per_group), _ = hopper_bwd.ordered_launch(pairs, 1, 5, group)
    assert tiles == 5 and per_group == group and groups * group >= pairs > (groups - 1) * group


@pytest.mark.parametrize("is_causal, window", [(False, None), (True, None), (True, (200, None)),
                                               (False, (300, 100))])
def test_dq_order_protocol_is_deadlock_free_and_fixed(is_causal, window, monkeypatch):
    """Simulated on the CPU with the kernel's rank table, visited blocks and launch order: under in-order
    dispatch (1 to 5 CTAs resident, random interleaving) no CTA waits forever, every (batch, head, block)
    receives its tiles' adds in descending tile order whatever the interleaving, and each semaphore ends at
    the number of tiles that visit its block."""
    batch, kv_heads, group, block_q, tile_keys, num_q_blocks, num_tiles = 2, 2, 2, 64, 128, 9, 7  # 4 pairs
    band = masks.Band.of(is_causal, window)
    common = dict(block_q=block_q, tile_keys=tile_keys, num_q_blocks=num_q_blocks, kv_pad=num_tiles * tile_keys,
                  band=band)
    ranks = np.asarray(hopper_bwd.dq_order_ranks(hopper_bwd.tile_visits(None, batch=batch, num_tiles=num_tiles,
                                                                         **common)))
    visited = [[tuple(int(x) for x in hopper_bwd.visited_q_blocks(t, None, **common)[:2]) for t in range(num_tiles)]
               for _ in range(batch)]
    orders = []
    for resident, seed in ((1, 0), (2, 1), (3, 2), (5, 3), (5, 4)):
        order, semaphores = _simulate_dq_order(ranks, visited, heads_per_kv=group, kv_heads=kv_heads,
                                               resident=resident, seed=seed, monkeypatch=monkeypatch)
        for (b, head, j), tiles_in_order in order.items():
            assert tiles_in_order == sorted(tiles_in_order, reverse=True)
            assert semaphores[(b, head, j)] == len(tiles_in_order)
            assert len(tiles_in_order) == sum(lo <= j < hi for lo, hi in visited[b])
        orders.append(order)
    assert all(order == orders[0] for order in orders)
    assert len(orders[0]) == batch * kv_heads * group * len({j for lo, hi in visited[0] for j in range(lo, hi)})


def _abstract_inputs(shape, segments: bool):
    """(q, k, lse, (q_ids, kv_ids)) as bf16 / float32 / int32 shapes for the lowering tests; `shape`: (batch,
    q_len, kv_len, heads, kv_heads, head_dim); ids None without segments."""
    batch, q_len, kv_len, heads, kv_heads, head_dim = shape
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)
    ids = ((jax.ShapeDtypeStruct((batch, q_len), jnp.int32), jax.ShapeDtypeStruct((batch, kv_len), jnp.int32))
           if segments else (None, None))
    return q, k, lse, ids


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_causal, window, segments", [(False, None, False), (True, None, False),
                                                         ((False), (40, 10), True), (True, None, True)])
def test_dq_ordered_lowers_for_gpu(head_dim, is_causal, window, segments):
    """The deterministic one-pass kernel (dq_ordered) goes through Mosaic GPU's lowering: one kernel, its TMA
    reduce-adds into the dQ buffer, a GPU-scope acquire wait and release signal on global semaphores, which
    XLA passes in as a zeroed int32 buffer of one counter per (batch, query head, query block), aliased to an
    output; ragged lengths, GQA, bands and segment ids. The one-pass kernel without dq_ordered has none.
    The ordered kernel's float32 dQ buffer is an output (its first visitors store), not a zeroed input."""
    batch, q_len, heads = 2, 300, 4
    q, k, lse, ids = _abstract_inputs((batch, q_len, 333, heads, 2, head_dim), segments)
    one_pass = dataclasses.replace(HopperBwdConfig.default(head_dim), dq_atomic=True, num_stages_dkv=2)
    texts = {}
    for ordered in (False, True):
        config = dataclasses.replace(one_pass, dq_ordered=ordered)

        def backward(q, k, v, out, lse, d_out, d_lse, q_ids, kv_ids):
            return hopper_bwd.hopper_backward(q, k, v, out, lse, d_out, d_lse, q_segment_ids=q_ids,
                                              kv_segment_ids=kv_ids, scale=0.125, is_causal=is_causal,
                                              local_window_size=window, config=config)

        texts[ordered] = jax.jit(backward).trace(q, k, k, q, lse, q, lse, *ids).lower(
            lowering_platforms=("cuda",)).as_text()
    granule = math.lcm(one_pass.block_q_dkv, 2 * one_pass.block_q_dq)  # of the padded query length
    counters = f"tensor<{batch * heads * (-(-q_len // granule) * granule // one_pass.block_q_dkv)}xi32>"
    dq_buffer = f"tensor<{batch}x{granule * -(-q_len // granule)}x{heads}x{head_dim}xf32>"
    for ordered, text in texts.items():
        assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
        call = next(line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line)
        operand_types, result_types = call[call.rindex(": ("):].split("->")
        assert (dq_buffer in operand_types) != ordered and dq_buffer in result_types
        assert "cp.reduce.async.bulk.tensor" in text
        for ptx in ("red.release.gpu.global.add", "ld.relaxed.gpu.global", "fence.acquire.gpu"):
            assert (ptx in text) == ordered, ptx
        assert (counters in text) == ordered


def _largest_wgmma_group(jaxpr_text: str) -> int:
    """The most wgmmas issued in one innermost `{ lambda ... }` block of a printed jaxpr: a wgmma group
    (`pl.run_scoped` / `pl.run_state` bodies hold one group each)."""
    largest, stack = 0, []
    for line in jaxpr_text.splitlines():
        stack.extend([0] * line.count("{ lambda"))
        if stack:
            stack[-1] += line.count("wgmma_ref")
        for _ in range(min(line.count(" in ("), len(stack))):
            largest = max(largest, stack.pop())
    return largest


@pytest.mark.parametrize("dq_atomic, dq_ordered", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_fused_wgmma_order_only_for_the_ordered_one_pass_on_a_full_band(dq_atomic, dq_ordered, is_causal):
    """The dK/dV kernels issue dP^T with S^T and then dV, dK, dQ as one group (3 wgmmas) only in the ordered
    one pass on a full band, where it measured faster; elsewhere S^T alone, then dV with dP^T, then dK (and
    dQ): groups of at most 2 (`_dkdv_kernel`'s `fused`)."""
    shape = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)
    config = dataclasses.replace(HopperBwdConfig.default(64), dq_atomic=dq_atomic, dq_ordered=dq_ordered)
    text = str(jax.make_jaxpr(functools.partial(hopper_bwd.hopper_backward, scale=0.125, is_causal=is_causal,
                                                config=config))(shape, shape, shape, shape, lse, shape, None))
    assert "wgmma_ref" in text
    assert _largest_wgmma_group(text) == (3 if dq_ordered and not is_causal else 2)


@pytest.mark.parametrize("head_dim, deterministic, is_causal, kernels", [
    (64, True, False, 2), (64, True, True, 3), (64, False, True, 2), (128, True, False, 3), (128, False, True, 3)])
def test_deterministic_picks_the_backward(head_dim, deterministic, is_causal, kernels):
    """jax.grad of the Hopper attention lowers to forward + dK/dV + dQ kernels (3) at head_dim 128, and to the
    one-pass backward (2: its dK/dV kernel sums dQ) at head_dim 64, where it measured faster: with its dQ
    adds ordered by semaphores unless deterministic=False; deterministic causal calls of up to 2k keys (these
    have 333) keep the two passes. Also under jax.vmap, which the one-pass kernel only takes through
    `_fold_vmap`."""
    from pallas_flash.kernels import hopper
    q = jax.ShapeDtypeStruct((3, 1, 200, 4, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((3, 1, 333, 2, head_dim), jnp.bfloat16)

    def loss(q, k, v):
        out, _ = hopper.flash_attention_hopper(q, k, v, scale=0.125, band=masks.Band.of(is_causal, None),
                                               config=KernelConfig(), deterministic=deterministic)
        return out.astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    for fn, args in ((grad, (q.update(shape=q.shape[1:]), k.update(shape=k.shape[1:]))), (jax.vmap(grad), (q, k))):
        text = jax.jit(fn).trace(args[0], args[1], args[1]).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("stablehlo.custom_call @mosaic_gpu") == kernels
        assert ("cp.reduce.async.bulk.tensor" in text) == (kernels == 2)
        assert ("red.release.gpu.global.add" in text) == (kernels == 2 and deterministic)


@pytest.mark.parametrize("in_axes", [0, (0, None, 0), (None, 1, 0)])
def test_fold_vmap_matches_per_example_calls(in_axes):
    """`_fold_vmap` runs a vmapped call as one call on the batch axis folded with the vmapped one
    (unbatched arguments broadcast, None arguments kept), nested vmaps included."""
    calls = []

    def per_example(a, none, b, c):  # examples along axis 0 are independent; b is [batch, 3]
        assert none is None
        calls.append(a.shape)
        return a * b.sum(axis=-1, keepdims=True) + c, jnp.cumsum(a, axis=1)

    fn = hopper_bwd._fold_vmap(per_example)
    a, b, c = (jax.random.normal(jax.random.key(i), shape) for i, shape in
               enumerate([(4, 2, 5), (4, 2, 3), (4, 2, 5)]))
    shared_a, shared_b = in_axes == (None, 1, 0), in_axes == (0, None, 0)
    a_in = a[0] if shared_a else a
    b_in = b[0] if shared_b else (jnp.swapaxes(b, 0, 1) if shared_a else b)
    got = jax.vmap(lambda a, b, c: fn(a, None, b, c), in_axes=in_axes)(a_in, b_in, c)
    for i in range(4):
        expected = per_example(a[0] if shared_a else a[i], None, b[0] if shared_b else b[i], c[i])
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g[i], e, rtol=1e-5, atol=1e-6)
    assert (8, 5) in calls, f"the vmapped call was not folded into one: {calls}"
    nested = jax.vmap(jax.vmap(lambda a: fn(a, None, a[..., :3], a)))(a.reshape(2, 2, 2, 5))
    np.testing.assert_allclose(nested[1].reshape(4, 2, 5), jnp.cumsum(a, axis=2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", list(BACKWARD_VARIANTS))
@pytest.mark.parametrize("window, segments", [((30, 5), False), ((40, None), True), (None, True)])
def test_masked_kernels_lower_for_gpu(window, segments, variant):
    """The forward and both backward kernels with a local window and/or segment ids (their ids streamed
    beside K or Q) go through Mosaic GPU's lowering, causal or not."""
    q, k, lse, ids = _abstract_inputs((2, 300, 200, 4, 2, 64), segments)
    config = dataclasses.replace(HopperBwdConfig.default(64), **BACKWARD_VARIANTS[variant])
    dq_atomic = config.dq_atomic
    for is_causal in (False, True):
        mask = dict(scale=0.125, is_causal=is_causal, local_window_size=window)

        def forward(q, k, v, q_ids, kv_ids):
            return hopper_fwd.hopper_forward(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **mask)

        def backward(q, k, v, out, lse, d_out, d_lse, q_ids, kv_ids):
            return hopper_bwd.hopper_backward(q, k, v, out, lse, d_out, d_lse, q_segment_ids=q_ids,
                                              kv_segment_ids=kv_ids, config=config, **mask)

        lower = lambda fn, *args: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert lower(forward, q, k, k, *ids).count("stablehlo.custom_call @mosaic_gpu") == 1
        text = lower(backward, q, k, k, q, lse, q, lse, *ids)
        assert text.count("stablehlo.custom_call @mosaic_gpu") == (1 if dq_atomic else 2)


def _segment_ids(batch: int, length: int, starts):
    """int32 [batch, length]: example b's ids step up by one at each of starts[b] (packed sequences)."""
    return jnp.stack([jnp.searchsorted(jnp.asarray(s, jnp.int32), jnp.arange(length), side="right")
                      for s in starts[:batch]]).astype(jnp.int32)


@pytest.mark.parametrize("shape, is_causal, window, segments", [
    ((1, 200, 150, 2, 1, 64), False, None, False),  # ragged, q_len > kv_len, GQA; both rings wrap
    ((1, 100, 150, 2, 1, 64), True, None, False),   # causal, q_len < kv_len: a dK/dV tile that no query sees
    ((1, 200, 120, 1, 1, 64), False, (40, 10), False),  # both band edges; rows 160.. see no key (lse -inf)
    ((2, 130, 130, 1, 1, 64), True, None, True),    # segment ids: one example packed, one single sequence
], ids=["ragged_gqa", "causal", "window", "segments"])
@pytest.mark.parametrize("pipelining", [{}, dict(dq_overlap=True), dict(dkv_overlap=True, num_stages_dkv=3)],
                         ids=["plain", "dq_overlap", "dkv_overlap"])
def test_backward_in_mosaic_gpu_interpreter(shape, is_causal, window, segments, pipelining):
    """The dK/dV and dQ kernels (barriers, TMA rings, band and segment block ranges, masks, padded rows and
    keys, the GQA head loop) in JAX's Mosaic GPU CPU interpreter with race detection, from the reference's
    residuals, against the reference's gradients. The interpreter cannot run wgmma on a transposed
    shared-memory ref or a register operand, so there the five matmuls are plain dots on the same tiles
    (`interpreting`); everything else is the kernels that run on the GPU. (The one-pass dq_atomic kernel
    cannot run there: no mutable-array argument, no TMA reduce-add.) dq_overlap: the dQ kernel's pipelined
    steps, with its peeled first block, the last product after the loop and key blocks released a step later;
    dkv_overlap: the dK/dV kernel's, with its zero first product, the last one after the loop (or none, for
    the causal case's tile that no query sees) and query blocks released a step later."""
    params = _compat.mosaic_gpu_interpret_params(detect_races=True)
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    q, k, v, d_out, d_lse = _inputs(shape, jnp.bfloat16, seed=3)
    batch, q_len, kv_len = shape[:3]
    ids = dict(q_segment_ids=None, kv_segment_ids=None)
    if segments:
        ids = dict(q_segment_ids=_segment_ids(batch, q_len, [[70], []]),
                   kv_segment_ids=_segment_ids(batch, kv_len, [[60], []]))
    scale = 0.125
    (out, lse), vjp = jax.vjp(
        lambda *x: reference.attention_reference(*x, scale=scale, band=masks.Band.of(is_causal, window), **ids),
        *(x.astype(jnp.float32) for x in (q, k, v)))
    want = vjp((d_out.astype(jnp.float32), d_lse))
    with _compat.mosaic_gpu_race_states() as kernels:  # one state per kernel: dK/dV, then dQ
        grads = jax.block_until_ready(hopper_bwd.hopper_backward(
            q, k, v, out.astype(q.dtype), lse, d_out, d_lse, scale=scale, is_causal=is_causal,
            local_window_size=window, config=HopperBwdConfig(**pipelining), interpret=params, **ids))
    assert [state.races_found for state in kernels] == [False, False]
    for name, ours, ref, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert ours.shape == x.shape and ours.dtype == x.dtype
        assert_close(ours, ref, jnp.bfloat16, table=GRADIENT, what=name)
    if window is not None:
        assert np.isneginf(lse).any(), "this case is meant to contain rows that see no key"


def test_dq_atomic_is_refused_in_the_interpreter():
    params = _compat.mosaic_gpu_interpret_params()
    if params is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    x = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="dq_atomic"):
        hopper_bwd.hopper_backward(x, x, x, x, jnp.zeros((1, 1, 64)), x, None, scale=1.0,
                                   config=HopperBwdConfig(dq_atomic=True), interpret=params)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", GPU_GRID)
@pytest.mark.parametrize("variant", list(BACKWARD_VARIANTS))
def test_gradients_match_reference(shape, dtype, is_causal, variant):
    if not hopper_fwd.on_hopper():
        pytest.skip("needs an sm90 GPU")
    q, k, v, d_out, d_lse = _inputs(shape, dtype, seed=1)
    scale = shape[-1] ** -0.5
    out, lse = hopper_fwd.hopper_forward(q, k, v, scale=scale, is_causal=is_causal)
    config = dataclasses.replace(HopperBwdConfig.default(hopper_fwd.padded_head_dim(shape[-1])),
                                 **BACKWARD_VARIANTS[variant])
    grads = hopper_bwd.hopper_backward(q, k, v, out, lse, d_out, d_lse, scale=scale, is_causal=is_causal,
                                       config=config)
    _, vjp = jax.vjp(lambda *x: reference.attention_reference(*x, scale=scale, is_causal=is_causal),
                     *(x.astype(jnp.float32) for x in (q, k, v)))
    want = vjp((d_out.astype(jnp.float32), d_lse))
    for name, ours, ref, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert ours.shape == x.shape and ours.dtype == x.dtype
        assert_close(ours, ref, dtype, table=GRADIENT, what=name)


# The last shape's three (batch, kv head) pairs launch in groups of two (`pairs_per_group`: 2.75 MiB of dQ per
# pair), so its second group has an inactive CTA per key tile (checked on CPU below).
DQ_ORDERED_GPU_SHAPES = [(2, 1000, 1000, 4, 2, 64), (1, 777, 1531, 4, 1, 64), (2, 1000, 1000, 4, 2, 128),
                         (1, 1531, 513, 4, 4, 128), (1, 2816, 2816, 12, 3, 64)]


def test_dq_ordered_gpu_grid_has_a_partial_launch_group():
    batch, q_len, _, heads, kv_heads, head_dim = DQ_ORDERED_GPU_SHAPES[-1]
    group = hopper_bwd.pairs_per_group(batch * kv_heads, q_len * heads // kv_heads * head_dim * 4)
    assert q_len % 128 == 0 and (batch * kv_heads) % group != 0


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["full", "causal", "window", "segments"])
@pytest.mark.parametrize("shape", DQ_ORDERED_GPU_SHAPES)
def test_dq_ordered_gradients_match_reference_and_repeat(shape, mask):
    """The deterministic one-pass backward (dq_atomic + dq_ordered) against the reference, and 5 calls on one
    input set give bitwise the same dq (and dk, dv)."""
    if not hopper_fwd.on_hopper():
        pytest.skip("needs an sm90 GPU")
    q, k, v, d_out, d_lse = _inputs(shape, jnp.bfloat16, seed=4)
    batch, q_len, kv_len = shape[:3]
    is_causal, window = mask == "causal", (200, 30) if mask == "window" else None
    ids = dict(q_segment_ids=None, kv_segment_ids=None)
    if mask == "segments":
        ids = dict(q_segment_ids=_segment_ids(batch, q_len, [[300, 500], [100]]),
                   kv_segment_ids=_segment_ids(batch, kv_len, [[300, 500], [100]]))
    scale = shape[-1] ** -0.5
    band = dict(is_causal=is_causal, local_window_size=window)
    out, lse = hopper_fwd.hopper_forward(q, k, v, scale=scale, **band, **ids)
    config = dataclasses.replace(HopperBwdConfig.default(hopper_fwd.padded_head_dim(shape[-1])), dq_atomic=True,
                                 dq_ordered=True, num_stages_dkv=2)
    call = functools.partial(hopper_bwd.hopper_backward, q, k, v, out, lse, d_out, d_lse, scale=scale,
                             config=config, **band, **ids)
    grads = jax.block_until_ready(call())
    _, vjp = jax.vjp(lambda *x: reference.attention_reference(*x, scale=scale, band=masks.Band.of(is_causal, window),
                                                              **ids),
                     *(x.astype(jnp.float32) for x in (q, k, v)))
    want = vjp((d_out.astype(jnp.float32), d_lse))
    for name, ours, ref, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert ours.shape == x.shape and ours.dtype == x.dtype
        assert_close(ours, ref, jnp.bfloat16, table=GRADIENT, what=name)
    first = [np.asarray(g) for g in grads]
    for _ in range(4):
        for name, a, b in zip(("dq", "dk", "dv"), first, jax.block_until_ready(call())):
            np.testing.assert_array_equal(a, np.asarray(b), err_msg=f"{name} differs between calls")


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_grad_of_mosaic_attention_uses_it(monkeypatch, is_causal):
    """`jax.grad` of `flash_attention(implementation="mosaic")` with the switch on, against the reference."""
    if not hopper_fwd.on_hopper():
        pytest.skip("needs an sm90 GPU")
    import pallas_flash as pf
    monkeypatch.setenv("PALLAS_FLASH_HOPPER_BWD", "1")
    q, k, v, d_out, _ = _inputs((2, 640, 640, 4, 2, 128), jnp.bfloat16, seed=2)

    def loss(attend, *x):
        return jnp.vdot(attend(*x).astype(jnp.float32), d_out.astype(jnp.float32))

    ours = jax.grad(functools.partial(loss, lambda *x: pf.flash_attention(*x, is_causal=is_causal,
                                                                          implementation="mosaic")),
                    argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(functools.partial(loss, lambda *x: reference.attention_reference(
        *x, scale=128 ** -0.5, is_causal=is_causal)[0]), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, b in zip(("dq", "dk", "dv"), ours, ref):
        assert_close(a, b, jnp.bfloat16, table=GRADIENT, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_one_pass_grad_under_vmap(is_causal, deterministic):
    """The one-pass backward at head_dim 64 (the default: dQ adds ordered, or free with deterministic=False)
    under jax.vmap (folded into the batch by `_fold_vmap`), against the reference per example."""
    if not hopper_fwd.on_hopper():
        pytest.skip("needs an sm90 GPU")
    import pallas_flash as pf
    q, k, v, d_out, _ = _inputs((3, 777, 1000, 4, 2, 64), jnp.bfloat16, seed=3)

    def loss(attend, q, k, v, d_out):
        return jnp.vdot(attend(q[None], k[None], v[None])[0].astype(jnp.float32), d_out.astype(jnp.float32))

    ours = jax.vmap(jax.grad(functools.partial(loss, lambda *x: pf.flash_attention(
        *x, is_causal=is_causal, implementation="mosaic", deterministic=deterministic)), argnums=(0, 1, 2)))(
        q, k, v, d_out)
    ref = jax.vmap(jax.grad(functools.partial(loss, lambda *x: reference.attention_reference(
        *x, scale=64 ** -0.5, is_causal=is_causal)[0]), argnums=(0, 1, 2)))(
        *(x.astype(jnp.float32) for x in (q, k, v)), d_out)
    for name, a, b in zip(("dq", "dk", "dv"), ours, ref):
        assert_close(a, b, jnp.bfloat16, table=GRADIENT, what=name)
