"""The deterministic one-pass Hopper backward's dQ order (`pallas_flash/hopper/bwd_ordered.py`): the rank
table its CTAs wait on, the launch order in L2-sized groups, the protocol simulated on the CPU (deadlock-free,
one fixed order), and on sm90 its gradients against the reference, bitwise repeatable."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import device, masks, reference
from pallas_flash.hopper import bwd as hopper_bwd
from pallas_flash.hopper import bwd_ordered
from pallas_flash.hopper import fwd as hopper_fwd
from pallas_flash.hopper.common import padded_head_dim, segment_block_ranges, step_block
from pallas_flash.hopper.config import HopperBwdConfig
from tests.helpers import make_backward_inputs, packed_segment_ids
from tests.tolerances import GRADIENT, assert_close


def _brute_force_ranks(batch, num_tiles, tile_keys, num_q_blocks, block_q, band, q_ids=None, kv_ids=None):
    """`bwd_ordered.dq_order_ranks` from first principles: key tile t visits query block j if some (query, key)
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
            return (
                np.where(valid, ids, np.iinfo(np.int32).max).min(2),
                np.where(valid, ids, np.iinfo(np.int32).min).max(2),
            )

        (t_lo, t_hi), (b_lo, b_hi) = interval(kv_ids, tile_keys), interval(q_ids, block_q)
        visits &= (t_lo[:, :, None] <= b_hi[:, None, :]) & (b_lo[:, None, :] <= t_hi[:, :, None])
    visits = visits.astype(np.int32)
    return np.cumsum(visits[:, ::-1], axis=1)[:, ::-1] - visits, visits


@pytest.mark.parametrize(
    "is_causal, window, segments",
    [
        (False, None, False),
        (True, None, False),
        (False, (300, 100), False),
        (True, (200, None), False),
        (False, None, True),
        (True, (300, None), True),
    ],
)
def test_dq_order_ranks(is_causal, window, segments):
    """The rank table the dq_ordered kernel waits on: per (example, key tile, query block), how many higher key
    tiles visit that block, against a brute-force count (queries and keys of unequal lengths, padding); and the
    rows of the blocks some tile visits (the kernel writes no others of its dQ buffer)."""
    batch, block_q, tile_keys, num_q_blocks, num_tiles = 2, 64, 128, 9, 7
    band = masks.Band.of(is_causal, window)
    q_ids = kv_ids = q_ranges = None
    if segments:  # packed sequences, the last rows / keys padding (as `pad_segment_ids` leaves them)
        q_ids, kv_ids = masks.pad_segment_ids(
            packed_segment_ids(batch, 520, [[100, 300], [250]]),
            packed_segment_ids(batch, 800, [[150, 500], [40]]),
            num_q_blocks * block_q,
            num_tiles * tile_keys,
        )
        q_ranges = segment_block_ranges(kv_ids, q_ids, rows_per_tile=tile_keys, cols_per_block=block_q)
    common = dict(
        batch=batch,
        num_tiles=num_tiles,
        block_q=block_q,
        tile_keys=tile_keys,
        num_q_blocks=num_q_blocks,
        kv_pad=num_tiles * tile_keys,
        band=band,
    )
    visits_table = bwd_ordered.tile_visits(q_ranges, **common)
    ranks = bwd_ordered.dq_order_ranks(visits_table)
    want, visits = _brute_force_ranks(batch, num_tiles, tile_keys, num_q_blocks, block_q, band, q_ids, kv_ids)
    assert ranks.dtype == jnp.int32 and ranks.shape == want.shape
    np.testing.assert_array_equal(ranks, want)
    rows = bwd_ordered.dq_visited_rows(visits_table, block_q)
    np.testing.assert_array_equal(rows, np.repeat(visits.any(axis=1), block_q, axis=1))
    assert rows.all() != (is_causal and segments)  # the last point leaves a block unvisited
    assert 0 < visits.sum() and (visits.sum() < visits.size) == (not band.is_full or segments)  # masks skip some


def _simulate_dq_order(ranks, visited, *, heads_per_kv: int, kv_heads: int, resident: int, seed: int, monkeypatch):
    """The dq_ordered protocol on the CPU: CTAs dispatched in `bwd_ordered.ordered_launch`'s order (decoded by
    `ordered_cta`; 3 pairs per launch group, so that the last group is partial), at most `resident` at once;
    each move is one random resident CTA's store warp's next action. A CTA's steps are (g, block) for each
    head of its group and each block it visits; at step i the store warp waits until step i's semaphore
    reaches its rank and adds, and its next move signals that semaphore (the add has landed: this needs
    nothing from other CTAs); after its last signal it exits. Inactive CTAs (past the last pair) exit at once.
    Step numbers decode by `common.step_block`, as in the kernel. Returns the tiles in the order they added
    into each (batch, head, block) and the semaphores' final values; raises on a deadlock."""
    rng = np.random.default_rng(seed)
    batch, num_tiles, _ = ranks.shape
    grid, names = bwd_ordered.ordered_launch(batch, kv_heads, num_tiles, group=3)
    pending = []  # (batch, kv head, tile) or None (inactive), in launch order: CUDA's x (the last axis) fastest
    for index in np.ndindex(*grid):
        axes = dict(zip(names, (np.int32(i) for i in index)))
        monkeypatch.setattr(bwd_ordered.lax, "axis_index", lambda name: axes[name])
        b, h, t, active = (int(x) for x in bwd_ordered.ordered_cta(batch, kv_heads, num_tiles, group=3))
        pending.append((b, h, t) if active else None)
    monkeypatch.undo()
    assert sorted(cta for cta in pending if cta) == [
        (b, h, t) for b in range(batch) for h in range(kv_heads) for t in range(num_tiles)
    ]

    def cta_steps(lo, hi):  # the kernel's own decode of step numbers (its loader's and store warp's order)
        decode = functools.partial(step_block, q_lo=np.int32(lo), q_steps=np.int32(hi - lo))
        return [tuple(int(x) for x in decode(np.int32(i))) for i in range(heads_per_kv * (hi - lo))]

    steps = {cta: cta_steps(*visited[cta[0]][cta[2]]) for cta in pending if cta}
    assert all(
        sorted(s) == [(g, j) for g in range(heads_per_kv) for j in range(*visited[cta[0]][cta[2]])]
        for cta, s in steps.items()
    )
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


@pytest.mark.parametrize(
    "pairs, dq_bytes, want",
    [
        (256, 1024 * 64 * 4, 32),  # 1k keys, head_dim 64: 256 KiB of dQ per pair; at most 32 pairs
        (256, 2048 * 64 * 4, 16),  # 2k: 512 KiB per pair, 8 MiB per group
        (32, 16384 * 64 * 4, 2),  # 16k, head_dim 64: 4 MiB per pair
        (3, 1024 * 64 * 4, 3),  # fewer pairs than a group holds
        (8, 1 << 26, 1),
    ],
)  # one pair's dQ alone over the L2 budget: one pair per group
def test_dq_ordered_launch_groups_keep_dq_in_l2(pairs, dq_bytes, want):
    """A dq_ordered launch group's dQ (every pair a wave of CTAs adds into) stays within bwd_ordered.DQ_L2_BYTES,
    with at least one and at most MAX_PAIRS_PER_GROUP pairs; the grid covers every pair."""
    group = bwd_ordered.pairs_per_group(pairs, dq_bytes)
    assert group == want
    (groups, tiles, per_group), _ = bwd_ordered.ordered_launch(pairs, 1, 5, group)
    assert tiles == 5 and per_group == group and groups * group >= pairs > (groups - 1) * group


@pytest.mark.parametrize("is_causal, window", [(False, None), (True, None), (True, (200, None)), (False, (300, 100))])
def test_dq_order_protocol_is_deadlock_free_and_fixed(is_causal, window, monkeypatch):
    """Simulated on the CPU with the kernel's rank table, visited blocks and launch order: under in-order
    dispatch (1 to 5 CTAs resident, random interleaving) no CTA waits forever, every (batch, head, block)
    receives its tiles' adds in descending tile order whatever the interleaving, and each semaphore ends at
    the number of tiles that visit its block."""
    batch, kv_heads, group, block_q, tile_keys, num_q_blocks, num_tiles = 2, 2, 2, 64, 128, 9, 7  # 4 pairs
    band = masks.Band.of(is_causal, window)
    common = dict(
        block_q=block_q, tile_keys=tile_keys, num_q_blocks=num_q_blocks, kv_pad=num_tiles * tile_keys, band=band
    )
    ranks = np.asarray(
        bwd_ordered.dq_order_ranks(bwd_ordered.tile_visits(None, batch=batch, num_tiles=num_tiles, **common))
    )
    visited = [
        [tuple(int(x) for x in bwd_ordered.visited_q_blocks(t, None, **common)[:2]) for t in range(num_tiles)]
        for _ in range(batch)
    ]
    orders = []
    for resident, seed in ((1, 0), (2, 1), (3, 2), (5, 3), (5, 4)):
        order, semaphores = _simulate_dq_order(
            ranks, visited, heads_per_kv=group, kv_heads=kv_heads, resident=resident, seed=seed, monkeypatch=monkeypatch
        )
        for (b, head, j), tiles_in_order in order.items():
            assert tiles_in_order == sorted(tiles_in_order, reverse=True)
            assert semaphores[(b, head, j)] == len(tiles_in_order)
            assert len(tiles_in_order) == sum(lo <= j < hi for lo, hi in visited[b])
        orders.append(order)
    assert all(order == orders[0] for order in orders)
    assert len(orders[0]) == batch * kv_heads * group * len({j for lo, hi in visited[0] for j in range(lo, hi)})


# The last shape's three (batch, kv head) pairs launch in groups of two (`pairs_per_group`: 2.75 MiB of dQ per
# pair), so its second group has an inactive CTA per key tile (checked on CPU below).
DQ_ORDERED_GPU_SHAPES = [
    (2, 1000, 1000, 4, 2, 64),
    (1, 777, 1531, 4, 1, 64),
    (2, 1000, 1000, 4, 2, 128),
    (1, 1531, 513, 4, 4, 128),
    (1, 2816, 2816, 12, 3, 64),
]


def test_dq_ordered_gpu_grid_has_a_partial_launch_group():
    batch, q_len, _, heads, kv_heads, head_dim = DQ_ORDERED_GPU_SHAPES[-1]
    group = bwd_ordered.pairs_per_group(batch * kv_heads, q_len * heads // kv_heads * head_dim * 4)
    assert q_len % 128 == 0 and (batch * kv_heads) % group != 0


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["full", "causal", "window", "segments"])
@pytest.mark.parametrize("shape", DQ_ORDERED_GPU_SHAPES)
def test_dq_ordered_gradients_match_reference_and_repeat(shape, mask):
    """The deterministic one-pass backward (dq_atomic + dq_ordered) against the reference, and 5 calls on one
    input set give bitwise the same dq (and dk, dv)."""
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    q, k, v, d_out, d_lse = make_backward_inputs(shape, jnp.bfloat16, seed=4)
    batch, q_len, kv_len = shape[:3]
    is_causal, window = mask == "causal", (200, 30) if mask == "window" else None
    ids = dict(q_segment_ids=None, kv_segment_ids=None)
    if mask == "segments":
        ids = dict(
            q_segment_ids=packed_segment_ids(batch, q_len, [[300, 500], [100]]),
            kv_segment_ids=packed_segment_ids(batch, kv_len, [[300, 500], [100]]),
        )
    scale = shape[-1] ** -0.5
    band = dict(is_causal=is_causal, local_window_size=window)
    out, lse = hopper_fwd.hopper_forward(q, k, v, scale=scale, **band, **ids)
    config = dataclasses.replace(
        HopperBwdConfig.default(padded_head_dim(shape[-1])), dq_atomic=True, dq_ordered=True, num_stages_dkv=2
    )
    call = functools.partial(
        hopper_bwd.hopper_backward, q, k, v, out, lse, d_out, d_lse, scale=scale, config=config, **band, **ids
    )
    grads = jax.block_until_ready(call())
    _, vjp = jax.vjp(
        lambda *x: reference.attention_reference(*x, scale=scale, band=masks.Band.of(is_causal, window), **ids),
        *(x.astype(jnp.float32) for x in (q, k, v)),
    )
    want = vjp((d_out.astype(jnp.float32), d_lse))
    for name, ours, ref, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert ours.shape == x.shape and ours.dtype == x.dtype
        assert_close(ours, ref, jnp.bfloat16, table=GRADIENT, what=name)
    first = [np.asarray(g) for g in grads]
    for _ in range(4):
        for name, a, b in zip(("dq", "dk", "dv"), first, jax.block_until_ready(call())):
            np.testing.assert_array_equal(a, np.asarray(b), err_msg=f"{name} differs between calls")
