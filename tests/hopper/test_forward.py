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
from pallas_flash.hopper.fwd import persistent_order, persistent_split
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
