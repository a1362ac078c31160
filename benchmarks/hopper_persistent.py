"""Hopper forward variants against each other and cuDNN in the same run (H100): by default persistent CTAs
vs one CTA per query tile; `--variants` adds FA3's intra-warpgroup overlap (`HopperConfig.overlap`).

Anchor shapes (bf16, B*N = 16k tokens, H*D = 2048), causal and not; default tiles (`HopperConfig.default`)
changed per variant (`VARIANTS`; the overlap variants use 128-key blocks, whose S and P fit the registers
beside O at head_dim 64 too). Timing as the harness (`benchmarks.attention.median_ms`): warm-up, then the
median of samples of back-to-back calls rotating over 3 input sets. Each point also checks both variants'
outputs against cuDNN's (max abs difference). Stops starting new points after `--budget` seconds.

Run: `PYTHONPATH=. python benchmarks/hopper_persistent.py [--seqs 512,2048,8192,16384] [--head_dims 64,128]
[--variants persistent,per-tile,overlap,overlap-persistent]`
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from benchmarks.attention import median_ms
from pallas_flash.config import HopperConfig
from pallas_flash.kernels import hopper_fwd

VARIANTS = {"persistent": dict(persistent=True, overlap=False),
            "per-tile": dict(persistent=False, overlap=False),
            "overlap": dict(persistent=False, overlap=True, block_kv=128),
            "overlap-persistent": dict(persistent=True, overlap=True, block_kv=128)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default="512,2048,8192,16384")
    parser.add_argument("--head_dims", default="64,128")
    parser.add_argument("--budget", type=float, default=240.0)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--variants", default="persistent,per-tile", help=f"from {list(VARIANTS)}")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)}")
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    print("| D | N | B x H | causal | cuDNN ms (TF/s) | " + " | ".join(f"{v} ms (TF/s, x cuDNN)" for v in variants)
          + f" | max abs diff vs cuDNN ({' / '.join(variants)}) |", flush=True)
    print("|---|---|---|---|---|" + "---|" * (len(variants) + 1), flush=True)
    start = time.perf_counter()
    for head_dim in map(int, args.head_dims.split(",")):
        for seq in map(int, args.seqs.split(",")):
            batch, heads = 16384 // seq, 2048 // head_dim
            keys = jax.random.split(jax.random.key(seq + head_dim), 9)
            arg_sets = [[jax.random.normal(keys[3 * s + i], (batch, seq, heads, head_dim), jnp.bfloat16)
                         for i in range(3)] for s in range(3)]
            for causal in (False, True):
                if time.perf_counter() - start > args.budget:
                    print(f"budget of {args.budget:.0f} s spent: stopping before D={head_dim} N={seq} "
                          f"causal={causal}", flush=True)
                    return
                flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
                base = HopperConfig.default(head_dim, seq, causal)
                fns = {"cudnn": lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="cudnn")}
                for name in variants:
                    config = dataclasses.replace(base, **VARIANTS[name])
                    fns[name] = (lambda config: lambda q, k, v: hopper_fwd.hopper_forward(
                        q, k, v, scale=head_dim ** -0.5, is_causal=causal, config=config)[0])(config)
                times, outs = {}, {}
                for name, fn in fns.items():
                    compiled = jax.jit(fn).lower(*arg_sets[0]).compile()
                    outs[name] = compiled(*arg_sets[0]).astype(jnp.float32)
                    times[name] = median_ms(compiled, arg_sets, reps=args.reps, min_sample_s=0.02)[0]
                cud = times["cudnn"]

                def cell(name):
                    return f"{times[name]:.3f} ({flops / times[name] / 1e9:.0f}, {cud / times[name]:.3f}x)"

                diffs = " / ".join(f"{float(jnp.max(jnp.abs(outs[n] - outs['cudnn']))):.2e}" for n in variants)
                print(f"| {head_dim} | {seq} | {batch} x {heads} | {int(causal)} | {cud:.3f} "
                      f"({flops / cud / 1e9:.0f}) | " + " | ".join(cell(v) for v in variants) + f" | {diffs} |",
                      flush=True)


if __name__ == "__main__":
    main()
