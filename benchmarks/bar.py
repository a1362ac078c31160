"""Issues 6 and 7's bar as paired ratios: ours against cuDNN, timed interleaved, with a confidence interval.

  PYTHONPATH=. python benchmarks/bar.py [--passes fwd,fwdbwd] [--head-dims 64,128] [--seqs 2048,8192,16384]
      [--reps 21] [--budget 540] [--nondeterministic] [--out FILE.jsonl]
  python benchmarks/bar.py --smoke        # CPU: tiny shapes, "xla_chunked" against "xla", no timing claims

The bar (issue 6 forward, issue 7 forward+backward): at least 1.0x cuDNN at head_dim 64 and 128, N = 2k, 8k and
16k, causal and not; bf16, B*N = 16k tokens, H*D = 2048 (../shared/ANCHORS.md). Single medians of the two sides
taken minutes apart moved by +-5% at N=2k between runs (benchmarks/results/2026-11-23-h100/README.md), which is
the size of the margins in question. So each point here: both functions compiled, outputs compared (max abs
difference, printed), then `benchmarks.attention.paired_ratio`: samples alternate ours / cuDNN and each adjacent
pair gives one ratio, cancelling drift. Printed: the median ratio cuDNN time / ours (> 1: we are faster), its
~95% interval, and the verdict: "ahead" (interval above 1), "behind" (below 1) or "parity" (it spans 1).
TFLOP/s count 4*B*H*N^2*D per forward (halved when causal), x3.5 for forward+backward; inputs, the
forward+backward function (the gradient of sum(out * cotangent)) and FLOP counts are the harness's
(`benchmarks.attention`).
`--nondeterministic` passes `deterministic=False` (the one-pass Hopper backward where it is faster).
Stops starting points after `--budget` seconds.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

import pallas_flash as pf
from benchmarks.attention import (DTYPES, FLOP_FACTOR, SWEEP_TOKENS, SWEEP_WIDTH, Point, _pass_function,
                                  _random_inputs, _unpack, fwd_flops, paired_ratio)


def attend(impl, causal: bool, deterministic: bool):
    """(q, k, v) -> out: cuDNN, or `flash_attention` with this implementation (None: the dispatcher's)."""
    if impl == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    return lambda q, k, v: pf.flash_attention(q, k, v, is_causal=causal, implementation=impl,
                                              deterministic=deterministic)


def max_abs_difference(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", default="fwd,fwdbwd")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--seqs", default="2048,8192,16384")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--budget", type=float, default=540.0)
    parser.add_argument("--nondeterministic", action="store_true")
    parser.add_argument("--out", help="append one JSON record per point to this file")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, xla_chunked against xla")
    args = parser.parse_args(argv)
    tokens, width, dtype = (256, 64, "float32") if args.smoke else (SWEEP_TOKENS, SWEEP_WIDTH, "bfloat16")
    seqs = [128] if args.smoke else [int(n) for n in args.seqs.split(",")]
    head_dims = [16, 32] if args.smoke else [int(d) for d in args.head_dims.split(",")]
    ours_impl, theirs_impl = ("xla_chunked", "xla") if args.smoke else (None, "cudnn")
    reps, min_sample_s = (5, 0.0) if args.smoke else (args.reps, 0.02)
    ours_name, theirs_name = ours_impl or "ours", theirs_impl
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    print(f"| pass | D | N | causal | {ours_name} ms (TF/s) | {theirs_name} ms | {theirs_name} / {ours_name} "
          "(95% interval) | verdict | max abs diff |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    start = time.perf_counter()
    for pass_ in args.passes.split(","):
        for head_dim in head_dims:
            for seq in seqs:
                for causal in (False, True):
                    if time.perf_counter() - start > args.budget:
                        print(f"budget of {args.budget:.0f} s spent: stopped before {pass_} D={head_dim} "
                              f"N={seq} causal={causal}", flush=True)
                        return
                    heads = width // head_dim
                    point = Point("bar", max(1, tokens // seq), seq, seq, heads, heads, head_dim, causal, dtype)
                    inputs = [_random_inputs(point, DTYPES[dtype], seed) for seed in range(3)]  # q, k, v, ct
                    compiled = []
                    for impl in (ours_impl, theirs_impl):
                        jitted, make_args = _pass_function(attend(impl, causal, not args.nondeterministic), pass_)
                        arg_sets = [make_args(*x) for x in inputs]  # the same for both sides
                        compiled.append(jitted.lower(*arg_sets[0]).compile())
                    ours, theirs = compiled
                    difference = max_abs_difference(_unpack(pass_, ours(*arg_sets[0])),
                                                    _unpack(pass_, theirs(*arg_sets[0])))
                    ratio, (low, high), ours_ms, theirs_ms, calls = paired_ratio(
                        ours, theirs, arg_sets, reps=reps, min_sample_s=min_sample_s)
                    verdict = "ahead" if low > 1.0 else "behind" if high < 1.0 else "parity"
                    flops = FLOP_FACTOR[pass_] * fwd_flops(point)
                    print(f"| {pass_} | {head_dim} | {seq} | {causal} | {ours_ms:.3f} "
                          f"({flops / ours_ms / 1e9:.0f}) | {theirs_ms:.3f} | {ratio:.3f} ({low:.3f}-{high:.3f}) "
                          f"| {verdict} | {difference:.2e} |", flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps({
                                "pass": pass_, "ours": ours_name, "theirs": theirs_name, "head_dim": head_dim,
                                "seq": seq, "batch": point.batch, "heads": heads, "causal": causal,
                                "ours_ms": ours_ms, "theirs_ms": theirs_ms, "ratio": ratio, "interval": [low, high],
                                "verdict": verdict, "calls": calls, "reps": reps, "max_abs_difference": difference,
                                "nondeterministic": args.nondeterministic, "jax": jax.__version__,
                                "device": jax.devices()[0].device_kind}) + "\n")


if __name__ == "__main__":
    main()
