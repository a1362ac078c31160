"""A float64 numpy model of the one-pass Hopper backward's dQ (`hopper_bwd._dkdv_kernel` with
`HopperBwdConfig(dq_atomic=True)`): which query blocks a CTA visits, which keys, rows and columns each of the two
consumer warpgroups writes into the shared dS^T tile and reads back for its share of dQ (`hopper_bwd.dq_split`),
and the two staging slots per warpgroup, with every TMA reduce-add delayed as long as
`wait_smem_to_gmem(1, wait_read_only=True)` allows (it reads its staging tile only when the warpgroup's next
store but one is about to overwrite it). Against dense float64 attention gradients.

  PYTHONPATH=. python benchmarks/hopper_bwd_onepass_model.py

`--break-slots` stages every step in slot 0 (what a single staging tile without the wait would do): the model
must then fail, which shows it can see a slot error.
"""
import argparse

import numpy as np

from pallas_flash import masks
from pallas_flash.config import NUM_CONSUMERS, HopperBwdConfig
from pallas_flash.kernels import hopper_bwd, tiles


def dense_dq(q, k, v, d_out, *, scale, is_causal):
    """dQ of softmax attention in float64, q [Tq, H, D], k/v [Tk, Hkv, D]; also lse and delta per head."""
    tq, heads, _ = q.shape
    group = heads // k.shape[1]
    dq, lse, delta = np.zeros_like(q), np.zeros((heads, tq)), np.zeros((heads, tq))
    for h in range(heads):
        kh, vh = k[:, h // group], v[:, h // group]
        s = scale * q[:, h] @ kh.T
        if is_causal:
            s = np.where(np.arange(tq)[:, None] >= np.arange(k.shape[0])[None, :], s, -np.inf)
        m = s.max(1, keepdims=True)
        lse[h] = (m + np.log(np.exp(s - m).sum(1, keepdims=True)))[:, 0]
        p = np.exp(s - lse[h][:, None])
        out = p @ vh
        delta[h] = (d_out[:, h] * out).sum(1)
        ds = p * (d_out[:, h] @ vh.T - delta[h][:, None])
        dq[:, h] = scale * ds @ kh
    return dq, lse, delta


def model_dq(q, k, v, d_out, lse, delta, *, scale, is_causal, config, break_slots=False):
    """The kernel's dQ, block by block, from the forward's lse and the preprocess's delta."""
    block_q, block_kv = config.block_q_dkv, config.block_kv_dkv
    tq, heads, head_dim = q.shape
    tk, kv_heads = k.shape[:2]
    group = heads // kv_heads
    tile = NUM_CONSUMERS * block_kv
    q_pad = -(-tq // block_q) * block_q
    kv_pad = -(-tk // tile) * tile
    pad = lambda x, n: np.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    q, d_out, k, v = pad(q, q_pad), pad(d_out, q_pad), pad(k, kv_pad), pad(v, kv_pad)
    lse2 = np.pad(lse, ((0, 0), (0, q_pad - tq)), constant_values=np.inf)  # padded rows: P = 0
    delta = np.pad(delta, ((0, 0), (0, q_pad - tq)))
    split = hopper_bwd.dq_split(head_dim, block_q)
    assert split is not None
    band = masks.Band.of(is_causal, None)
    dq_acc = np.zeros((q_pad, heads, head_dim))
    for hk in range(kv_heads):
        for kv_tile in range(kv_pad // tile):
            q_lo, _, _, q_hi = (int(x) for x in tiles.q_block_range(
                kv_tile, block_q=block_q, block_kv=tile, num_q_blocks=q_pad // block_q, kv_len=kv_pad,
                band=band, always_mask=True))
            q_steps = max(q_hi - q_lo, 0)
            ds_t_tile = np.full((tile, block_q), np.nan)  # the shared dS^T tile (NaN: never written)
            k_tile = k[kv_tile * tile:(kv_tile + 1) * tile, hk]  # K of both warpgroups, [2 block_kv, D]
            rows_n, cols_n = (block_q, head_dim // 2) if split == "columns" else (block_q // 2, head_dim)
            staging = np.full((2, NUM_CONSUMERS, rows_n, cols_n), np.nan)
            pending = [[] for _ in range(NUM_CONSUMERS)]  # per warpgroup: issued, not yet read reduce-adds

            def read_oldest(wg):
                slot, rows, cols, head = pending[wg].pop(0)
                dq_acc[rows, head, cols] += staging[slot, wg]

            for g in range(group):
                head = hk * group + g
                for q_block in range(q_lo, q_hi):
                    t = g * q_steps + q_block - q_lo
                    queries = slice(q_block * block_q, (q_block + 1) * block_q)
                    for wg in range(NUM_CONSUMERS):  # each warpgroup's dS^T half into its rows of the tile
                        kv_start = kv_tile * tile + wg * block_kv
                        keys = slice(kv_start, kv_start + block_kv)
                        s_t = k[keys, hk] @ q[queries, head].T
                        p_t = np.exp(scale * s_t - lse2[head, queries][None, :])
                        key_pos = np.arange(kv_start, kv_start + block_kv)[:, None]
                        q_pos = np.arange(queries.start, queries.stop)[None, :]
                        visible = key_pos < tk
                        if is_causal:
                            visible = visible & (key_pos <= q_pos)
                        p_t = np.where(visible, p_t, 0.0)
                        dp_t = v[keys, hk] @ d_out[queries, head].T
                        ds_t = p_t * (dp_t - delta[head, queries][None, :])
                        ds_t_tile[wg * block_kv:(wg + 1) * block_kv] = ds_t
                    for wg in range(NUM_CONSUMERS):  # after ds_ready: each warpgroup's share from all keys
                        if split == "columns":
                            cols = slice(wg * head_dim // 2, (wg + 1) * head_dim // 2)
                            part, rows = ds_t_tile.T @ k_tile[:, cols], slice(0, block_q)
                        else:
                            rows = slice(wg * block_q // 2, (wg + 1) * block_q // 2)
                            part, cols = ds_t_tile[:, rows].T @ k_tile, slice(0, head_dim)
                        while len(pending[wg]) > 1:  # wait_smem_to_gmem(1, wait_read_only=True)
                            read_oldest(wg)
                        slot = 0 if break_slots else t % 2
                        staging[slot, wg] = part
                        target = slice(queries.start + rows.start, queries.start + rows.stop)
                        pending[wg].append((slot, target, cols, head))
            for wg in range(NUM_CONSUMERS):  # wait_smem_to_gmem(0) at the kernel's end
                while pending[wg]:
                    read_oldest(wg)
    return scale * dq_acc[:tq]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--break-slots", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    worst = 0.0
    # (q_len, kv_len, heads, kv_heads, head_dim, causal)
    for tq, tk, heads, kv_heads, head_dim, causal in [(200, 333, 4, 2, 64, False), (200, 333, 4, 2, 128, True),
                                                      (333, 200, 2, 1, 128, False), (300, 300, 2, 2, 64, True),
                                                      (130, 500, 3, 1, 128, True)]:
        q, d_out = (rng.standard_normal((tq, heads, head_dim)) for _ in range(2))
        k, v = (rng.standard_normal((tk, kv_heads, head_dim)) for _ in range(2))
        scale = head_dim ** -0.5
        want, lse, delta = dense_dq(q, k, v, d_out, scale=scale, is_causal=causal)
        for block_q in (64, 128):
            config = HopperBwdConfig(block_q_dkv=block_q, dq_atomic=True)
            if hopper_bwd.dq_split(head_dim, block_q) is None:
                continue
            got = model_dq(q, k, v, d_out, lse, delta, scale=scale, is_causal=causal, config=config,
                           break_slots=args.break_slots)
            err = np.linalg.norm(got - want) / np.linalg.norm(want) if np.isfinite(got).all() else np.inf
            worst = max(worst, err)
            print(f"{tq}x{tk} H={heads}/{kv_heads} D={head_dim} causal={causal} block_q={block_q} "
                  f"split={hopper_bwd.dq_split(head_dim, block_q)}: dq relative error {err:.1e}")
    print(f"worst {worst:.1e}: {'PASS' if worst < 1e-12 else 'FAIL'}")


if __name__ == "__main__":
    main()
