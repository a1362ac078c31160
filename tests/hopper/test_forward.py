"""The Hopper forward (`pallas_flash/hopper/fwd.py`) and the geometry it shares with the backward
(`pallas_flash/hopper/common.py`): the persistent schedule, segment block ranges, and on sm90 the overlapped
forward through the correctness grid. The interpreter and lowering tests are in test_interpreter.py and
test_lowering.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import device, masks
from pallas_flash.config import KernelConfig
from pallas_flash.hopper.common import padded_head_dim, segment_block_ranges
from pallas_flash.hopper.config import HopperConfig
from pallas_flash.hopper.fwd import (
    DEAL_HEADER,
    deal_index,
    deal_tiles,
    long_rows_deal,
    persistent_order,
    persistent_split,
)
from tests.helpers import check_against_reference, shape_id

GPU_SHAPES = [
    (2, 1000, 1000, 8, 8, 64),
    (1, 777, 1531, 8, 2, 128),
    (1, 1531, 513, 4, 1, 96),
    (2, 256, 256, 4, 4, 256),
    (1, 2048, 2048, 4, 4, 128),
]


@pytest.mark.parametrize(
    "pairs, num_q_tiles, chunk, max_ctas",
    [(1, 1, 1, 132), (3, 7, 2, 2), (17, 3, 5, 7), (16, 16, 16, 132), (5, 16, 2, 3), (32, 128, 2, 132)],
)
def test_persistent_order_runs_every_tile_once_in_balanced_pairs(pairs, num_q_tiles, chunk, max_ctas):
    """The persistent Hopper forward's static split: every (pair, tile) exactly once over all CTAs, and
    under a causal band (a tile of rank r visits T - r blocks) no CTA more than one (long, short) unit
    (T + 1 blocks) above the mean."""
    ctas, num_tiles_of = persistent_split(pairs * num_q_tiles, max_ctas)
    seen, blocks = [], []
    for cta in range(ctas):
        owned = [2 * (cta + (i // 2) * ctas) + i % 2 for i in range(int(num_tiles_of(np.int32(cta))))]
        pair, rank = persistent_order(np.asarray(owned, np.int32), pairs=pairs, chunk=chunk, num_q_tiles=num_q_tiles)
        seen += list(zip(np.asarray(pair).tolist(), np.asarray(rank).tolist()))
        blocks.append(int(np.sum(num_q_tiles - np.asarray(rank))))
    assert sorted(seen) == [(p, r) for p in range(pairs) for r in range(num_q_tiles)]
    assert max(blocks) <= np.mean(blocks) + num_q_tiles + 1


def _dealt_positions(deal, ctas: int, total: int):
    """Each CTA's positions (`persistent_order`'s) under a `long_rows_deal`, as the kernel walks them."""
    deal = np.asarray(deal)
    num_long, rounds, units = (int(x) for x in deal[:DEAL_HEADER])
    owned = []
    for cta in range(ctas):
        count = int(deal_tiles(np.int32(cta), ctas=ctas, num_long=num_long, rounds=rounds, num_units=units,
                               odd=total % 2 == 1))  # fmt: skip
        tiles = np.arange(count)
        index = np.asarray(deal_index(np.int32(cta), tiles // 2, ctas=ctas, num_long=num_long, rounds=rounds))
        owned.append((2 * deal[DEAL_HEADER + index] + tiles % 2).tolist())
    return owned


@pytest.mark.parametrize(
    "pairs, num_q_tiles, ctas, long_tiles",
    [(16, 128, 132, [0]), (2, 12, 2, [0]), (3, 7, 4, [0]), (1, 9, 3, [4]), (16, 16, 132, []), (40, 64, 8, [0])],
)
def test_long_rows_deal_runs_every_tile_once_and_balances(pairs, num_q_tiles, ctas, long_tiles):
    """The persistent forward's long-rows deal: every position exactly once over all CTAs (odd totals too), each
    CTA with at least one tile; where a few long units stand out, they go to CTAs of their own, which take fewer
    short ones, so the busiest CTA holds at most two short units over the larger of a long unit and the mean (the
    strided deal: a long unit over its share of short ones); without long units, or with too many for CTAs of
    their own, the strided deal over the order."""
    steps = np.full((1, pairs, num_q_tiles), 8)
    steps[:, :, long_tiles] = 10 * num_q_tiles
    ranges = jnp.asarray(np.stack([np.zeros_like(steps), steps, steps, steps, steps * 0, steps * 0], axis=-1))
    total = pairs * num_q_tiles
    units = -(-total // 2)
    ctas = min(ctas, units)
    deal = long_rows_deal(ranges, batch=1, heads=pairs, num_q_tiles=num_q_tiles, band=masks.Band(), ctas=ctas,
                          chunk=2)  # fmt: skip
    owned = _dealt_positions(deal, ctas, total)
    assert sorted(sum(owned, [])) == list(range(total)) and min(map(len, owned)) >= 1
    pair, rank = persistent_order(np.arange(total, dtype=np.int32), pairs=pairs, chunk=2, num_q_tiles=num_q_tiles)
    cost = steps[0][np.asarray(pair), np.asarray(rank)] + 2
    loads = [int(cost[o].sum()) for o in owned]
    strided = [[p for k in range(c, units, ctas) for p in (2 * k, 2 * k + 1) if p < total] for c in range(ctas)]
    if int(deal[0]):
        assert int(deal[0]) == pairs * len(long_tiles)
        unit_cost = np.add.reduceat(np.append(cost, [0] * (2 * units - total)), np.arange(0, 2 * units, 2))
        assert max(loads) <= max(unit_cost.max(), np.mean(loads)) + 2 * unit_cost.min()
        assert max(loads) < max(int(cost[s].sum()) for s in strided)
    else:
        assert owned == [[2 * int(deal[DEAL_HEADER + p // 2]) + p % 2 for p in s] for s in strided]


@pytest.mark.parametrize("sort", [True, False])
def test_segment_block_ranges_cover_every_meeting(sort):
    """The Hopper kernels visit only the key blocks `segment_block_ranges` names for a query tile: every
    (tile, block) pair that shares a segment id must be inside it, and for sorted ids (packed sequences,
    lengths) it must be exactly the first to the last such block. Blocks they visit unmasked (the
    same-segment run) must hold only the tile's one id, as the tile must; for sorted ids, all such blocks."""
    rows, cols, tile, block = 96, 80, 16, 8
    k1, k2 = jax.random.split(jax.random.key(5))
    q_ids = jax.random.randint(k1, (3, rows), 0, 3 if sort else 6)
    kv_ids = jax.random.randint(k2, (3, cols), 1, 4 if sort else 7)
    if sort:
        q_ids, kv_ids = jnp.sort(q_ids, axis=1), jnp.sort(kv_ids, axis=1)
    # Padding past per-example lengths, as the kernels' wrappers pad.
    q_ids = jnp.where(jnp.arange(rows) < jnp.array([96, 40, 0])[:, None], q_ids, masks.QUERY_PADDING_ID)
    kv_ids = jnp.where(jnp.arange(cols) < jnp.array([80, 80, 30])[:, None], kv_ids, masks.KEY_PADDING_ID)
    ranges = np.asarray(segment_block_ranges(q_ids, kv_ids, rows_per_tile=tile, cols_per_block=block))
    assert ranges.shape == (3, rows // tile, 4)
    q_tiles = np.asarray(q_ids).reshape(3, rows // tile, tile)
    kv_blocks = np.asarray(kv_ids).reshape(3, cols // block, block)
    same_runs = 0
    for b in range(3):
        for t in range(rows // tile):
            same = [
                j
                for j in range(cols // block)
                if len(set(q_tiles[b, t]) | set(kv_blocks[b, j])) == 1 and q_tiles[b, t, 0] >= 0
            ]
            same_lo, same_hi = ranges[b, t, 2:]
            assert set(range(same_lo, same_hi)) <= set(same), (b, t)
            if sort:
                assert list(range(same_lo, same_hi)) == same, (b, t)
            same_runs += same_hi > same_lo
    if sort:
        assert same_runs, "the sorted case is meant to have same-segment blocks"
    meets = np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :]  # [batch, rows, cols]
    meets = meets.reshape(3, rows // tile, tile, cols // block, block).any(axis=(2, 4))  # [batch, tiles, blocks]
    for b in range(3):
        for t in range(rows // tile):
            lo, hi = ranges[b, t, :2]
            hit = np.flatnonzero(meets[b, t])
            if sort:
                expected = (hit[0], hit[-1] + 1) if hit.size else (0, 0)
                assert (lo, hi) == expected, (b, t)
            else:
                assert all(lo <= j < hi for j in hit), (b, t)
    assert (ranges[2] == 0).all()  # example 2 has no queries


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=shape_id)
def test_gpu_mosaic_overlap(shape, is_causal, persistent):
    """`HopperConfig.overlap` (FA3's intra-warpgroup pipelining) on the GPU grid, bf16; skipped off sm90."""
    if not device.on_hopper_gpu():
        pytest.skip("needs an sm90 GPU")
    head_dim = padded_head_dim(shape[-1])
    block_kv = 64 if head_dim > 128 else 128
    # The portable backward keeps its tuned tiles (KernelConfig()'s do not fit shared memory at head_dim 256).
    config = dataclasses.replace(
        KernelConfig.default(shape[-1]), hopper=HopperConfig(64, block_kv, 2, persistent, overlap=True)
    )
    check_against_reference("mosaic", shape, jnp.bfloat16, is_causal, config, seed=2)
