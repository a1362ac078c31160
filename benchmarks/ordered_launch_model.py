"""A cost model of the one-pass dK/dV kernel's launch orders (CPU, no GPU): why the deterministic (dq_ordered)
kernel loses more under a causal band than on a full one.

The dq_ordered kernel launches each (batch, kv head) pair's key tiles in descending order, in groups of pairs
(`hopper_bwd.ordered_launch`, `hopper_bwd.pairs_per_group`): a tile's dQ adds wait on the higher tiles, which must
already hold an SM. The free-order kernel launches grid (batch, kv_heads, kv_tiles), key tiles ascending. Under a
causal band tile t visits T - t query blocks, so descending means shortest first. The hardware hands each
launched CTA to the first free SM; cost of a CTA: the query blocks it visits plus FIXED (loading K and V, writing
dK and dV), in block units; anchor shapes (B*N = 16k tokens, H*D = 2048), head_dim 64 defaults (128-key tiles,
128-query blocks), 132 SMs. Prints the makespan's efficiency (ideal / modelled) per order. The chain of
semaphores itself (a tile waiting for a higher tile's add) is not modelled. Used in pallas_flash/kernels/NOTES.md
("Why the ordered one pass loses under a causal band").

Run: `PYTHONPATH=. python benchmarks/ordered_launch_model.py`
(output: benchmarks/results/2026-11-24-h100/session9/ordered_launch_model.log)."""
from __future__ import annotations

import heapq

from pallas_flash.config import HopperBwdConfig
from pallas_flash.kernels.hopper_bwd import NUM_CONSUMERS, pairs_per_group

SMS = 132
FIXED = 2.0
TOKENS, WIDTH, HEAD_DIM = 16384, 2048, 64


def makespan(costs) -> float:
    free_at = [0.0] * SMS
    for cost in costs:
        heapq.heappush(free_at, heapq.heappop(free_at) + cost)
    return max(free_at)


def model(seq: int, causal: bool) -> dict[str, float]:
    config = HopperBwdConfig.default(HEAD_DIM, deterministic=True, kv_len=seq, is_causal=causal)
    tiles = seq // (NUM_CONSUMERS * config.block_kv_dkv)
    blocks = seq // config.block_q_dkv
    per_tile = NUM_CONSUMERS * config.block_kv_dkv // config.block_q_dkv  # query blocks per key tile's diagonal
    cost = [(blocks - t * per_tile if causal else blocks) + FIXED for t in range(tiles)]
    pairs = (TOKENS // seq) * (WIDTH // HEAD_DIM)
    group = pairs_per_group(pairs, seq * HEAD_DIM * 4)
    ordered = [cost[t] for g0 in range(0, pairs, group) for t in reversed(range(tiles))
               for _ in range(g0, min(pairs, g0 + group))]
    free = [cost[t] for _ in range(pairs) for t in range(tiles)]
    ideal = pairs * sum(cost) / SMS
    return dict(group=group, ordered=ideal / makespan(ordered), free=ideal / makespan(free))


def main() -> None:
    print(f"head_dim {HEAD_DIM}, {SMS} SMs, fixed cost {FIXED} blocks per CTA; efficiency = ideal / modelled makespan")
    print("| N | causal | pairs per group | ordered (descending tiles) | free order (ascending tiles) |")
    print("|---|---|---|---|---|")
    for seq in (2048, 8192, 16384):
        for causal in (False, True):
            m = model(seq, causal)
            print(f"| {seq} | {causal} | {m['group']} | {m['ordered']:.3f} | {m['free']:.3f} |")


if __name__ == "__main__":
    main()
