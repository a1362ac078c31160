"""A cost model of the Hopper forward's tile schedules (CPU, no GPU): the makespan of one CTA per tile
(the hardware hands each launched CTA to the first free SM) against persistent CTAs with a static split,
in the tile-major order of the first persistent version and in today's folded order
(`hopper_fwd.persistent_order`). Cost of a tile: the 128-key blocks it visits, plus a fixed cost per tile
(FIXED_LAUNCHED for a launched CTA, FIXED_PERSISTENT for a tile of a persistent CTA), in block units; anchor
shapes (B*N = 16k tokens, H*D = 2048), 132 SMs. Prints per-tile time / persistent time (> 1: persistent
faster). Used in pallas_flash/kernels/NOTES.md ("Folded order"); the fixed costs are rough fits, so it
predicts the causal balance better than the non-causal fixed-cost savings.

Run: `PYTHONPATH=. python benchmarks/persistent_schedule_model.py`
(output: benchmarks/results/2026-11-23-h100/persistent/schedule_model.log)."""
from __future__ import annotations

import heapq
import math

import numpy as np

from pallas_flash.kernels.hopper_fwd import L2_SHARE_BYTES, persistent_order, persistent_split

SMS = 132
FIXED_LAUNCHED, FIXED_PERSISTENT = 2.5, 0.8


def tile_costs(seq: int, causal: bool, block_kv: int) -> list[float]:
    """Blocks of 128 keys each 128-query tile visits (tile t: rows t*128 .. t*128+127)."""
    keys = [(t + 1) * 128 if causal else seq for t in range(seq // 128)]
    return [math.ceil(k / block_kv) * block_kv / 128 for k in keys]


def per_tile(pairs: int, costs: list[float], causal: bool) -> float:
    free_at = [0.0] * SMS
    for _ in range(pairs):
        for t in (reversed(range(len(costs))) if causal else range(len(costs))):
            heapq.heappush(free_at, heapq.heappop(free_at) + costs[t] + FIXED_LAUNCHED)
    return max(free_at)


def tile_major(pairs: int, costs: list[float], causal: bool, chunk: int) -> float:
    """The first persistent version: CTA c ran positions c, c + ctas, ... of a tile-major order per chunk."""
    tiles = len(costs)
    ctas = min(SMS, pairs * tiles)
    load = np.zeros(ctas)
    for position in range(pairs * tiles):
        within = position % (chunk * tiles)
        size = min(chunk, pairs - position // (chunk * tiles) * chunk)
        rank = within // size
        load[position % ctas] += costs[tiles - 1 - rank if causal else rank] + FIXED_PERSISTENT
    return load.max()


def folded(pairs: int, costs: list[float], causal: bool, chunk: int) -> float:
    tiles = len(costs)
    ctas, num_tiles_of = persistent_split(pairs * tiles, SMS)
    load = []
    for cta in range(ctas):
        owned = [2 * (cta + (i // 2) * ctas) + i % 2 for i in range(int(num_tiles_of(np.int32(cta))))]
        _, rank = persistent_order(np.asarray(owned, np.int32), pairs=pairs, chunk=chunk, num_q_tiles=tiles)
        ranks = np.asarray(rank)
        load.append(sum(costs[tiles - 1 - r if causal else r] + FIXED_PERSISTENT for r in ranks))
    return max(load)


def main() -> None:
    print("| D | N | causal | per-tile / tile-major persistent | per-tile / folded persistent |")
    print("|---|---|---|---|---|")
    for head_dim in (64, 128):
        for seq in (512, 1024, 2048, 8192, 16384):
            batch, heads = 16384 // seq, 2048 // head_dim
            chunk = max(1, min(batch * heads, L2_SHARE_BYTES // (2 * seq * head_dim * 2)))
            for causal in (False, True):
                block_kv = (128 if causal and seq <= 2048 else 256) if head_dim == 64 else 128
                costs = tile_costs(seq, causal, block_kv)
                base = per_tile(batch * heads, costs, causal)
                print(f"| {head_dim} | {seq} | {int(causal)} | {base / tile_major(batch * heads, costs, causal, chunk):.2f} "
                      f"| {base / folded(batch * heads, costs, causal, chunk):.2f} |", flush=True)


if __name__ == "__main__":
    main()
