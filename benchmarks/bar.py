"""Issues 6 and 7's bar as paired ratios: ours against cuDNN, timed interleaved, with a confidence interval.

  PYTHONPATH=. python benchmarks/bar.py [--passes fwd,fwdbwd] [--head-dims 64,128] [--seqs 2048,8192,16384]
      [--reps 21] [--budget 540] [--causal false,true] [--nondeterministic] [--out FILE.jsonl]
      [--hopper "64,128,3,persistent;128,128,2"]   # forward tiles to try instead of the default
      [--one-pass] [--bwd-registers 240,24]        # backward experiments: dq_atomic at every head_dim;
                                                   # setmaxnreg budgets of the backward kernels
      [--dq-ordered]                               # the one-pass backward with its dQ adds in a fixed
                                                   # order (dq_atomic + dq_ordered: bitwise deterministic)
      [--two-pass]                                 # the two-pass backward at every head_dim
      [--bwd ";dq_overlap=1;dq_overlap=1,num_stages_dq=3"]  # HopperBwdConfig fields over the call's default,
                                                   # each its own row ("": the default itself)
  python benchmarks/bar.py --smoke        # CPU: tiny shapes, "xla_chunked" against "xla", no timing claims

The bar (issue 6 forward, issue 7 forward+backward): at least 1.0x cuDNN at head_dim 64 and 128, N = 2k, 8k and
16k, causal and not; bf16, B*N = 16k tokens, H*D = 2048 (../shared/ANCHORS.md). Single medians of the two sides
taken minutes apart moved by +-5% at N=2k between runs (benchmarks/results/2026-11-23-h100/README.md), which is
the size of the margins in question. So each point here: both functions compiled, outputs compared (max abs
difference, printed), then `benchmarks.attention.paired_ratio`: samples alternate ours / cuDNN and each adjacent
pair gives one ratio, cancelling drift. Printed: the median ratio cuDNN time / ours (> 1: we are faster), its
~95% interval, and the verdict: "ahead" (interval above 1), "behind" (below 1) or "parity" (it spans 1).
Also whether each side's outputs (gradients included) are bitwise the same over 5 calls on one input set:
cuDNN's backward may sum with atomics unless XLA_FLAGS has --xla_gpu_deterministic_ops=true (recorded in
the JSON), which decides whether our deterministic default or `--nondeterministic` is the like-for-like run.
TFLOP/s count 4*B*H*N^2*D per forward (halved when causal), x3.5 for forward+backward; inputs, the
forward+backward function (the gradient of sum(out * cotangent)) and FLOP counts are the harness's
(`benchmarks.attention`).
`--nondeterministic` passes `deterministic=False` (the one-pass Hopper backward where it is faster).
Stops starting points after `--budget` seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from pallas_flash.config import HopperBwdConfig, HopperConfig
from benchmarks import impls
from benchmarks.attention import (DTYPES, FLOP_FACTOR, SWEEP_TOKENS, SWEEP_WIDTH, Point, _pass_function,
                                  _random_inputs, _unpack, fwd_flops, paired_ratio)

REPEAT_CALLS = 5  # calls per side on one input set for the bitwise-repeatability column


def attend(impl, causal: bool, deterministic: bool, config: pf.KernelConfig | None = None):
    """(q, k, v) -> out: cuDNN, or `flash_attention` with this implementation (None: the dispatcher's) and
    config (None: its default)."""
    if impl == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    return lambda q, k, v: pf.flash_attention(q, k, v, is_causal=causal, implementation=impl,
                                              deterministic=deterministic, config=config)


def parse_hopper_configs(text: str | None) -> list[HopperConfig | None]:
    """`--hopper` as HopperConfigs: ";"-separated "block_q,block_kv,num_stages[,persistent][,overlap]"
    (e.g. "64,128,3,persistent;128,128,2"); None (no flag): the default tiles only."""
    if not text:
        return [None]
    configs = []
    for item in text.split(";"):
        fields = item.split(",")
        sizes, flags = fields[:3], set(fields[3:])
        if len(sizes) < 3 or not all(x.isdigit() for x in sizes) or not flags <= {"persistent", "overlap"}:
            raise ValueError(f"--hopper: want block_q,block_kv,num_stages[,persistent][,overlap], got {item!r}")
        block_q, block_kv, num_stages = (int(x) for x in sizes)
        configs.append(HopperConfig(block_q, block_kv, num_stages, "persistent" in flags, "overlap" in flags))
    return configs


def parse_bwd_overrides(text: str | None) -> list[dict | None]:
    """`--bwd` as HopperBwdConfig field overrides: ";"-separated items of ","-separated field=int pairs (bools
    as 0/1); an empty item is the default backward; None (no flag): [None], the default only."""
    if text is None:
        return [None]
    fields = {f.name: f.type for f in dataclasses.fields(HopperBwdConfig)}
    items = []
    for item in text.split(";"):
        overrides = {}
        for pair in filter(None, item.split(",")):
            name, _, value = pair.partition("=")
            if name not in fields or not value.lstrip("-").isdigit():
                raise ValueError(f"--bwd: want field=int with a HopperBwdConfig field, got {pair!r}")
            overrides[name] = bool(int(value)) if fields[name] in (bool, "bool") else int(value)
        items.append(overrides)
    return items


def overridden_bwd_config(head_dim: int, deterministic: bool, seq: int, causal: bool, overrides: dict) -> HopperBwdConfig:
    """The backward this call would take by default (`HopperBwdConfig.default` for its head_dim, key length and
    mask) with one `--bwd` item's field overrides."""
    return dataclasses.replace(HopperBwdConfig.default(head_dim, deterministic, kv_len=seq, is_causal=causal),
                               **overrides)


def describe_bwd(overrides: dict | None) -> str:
    return "" if not overrides else " bwd:" + ",".join(f"{k}={int(v)}" for k, v in overrides.items())


def describe(config: HopperConfig | None) -> str:
    if config is None:
        return "default"
    flags = "".join(f",{name}" for name in ("persistent", "overlap") if getattr(config, name))
    return f"{config.block_q},{config.block_kv},{config.num_stages}{flags}"


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
    parser.add_argument("--causal", default="false,true")
    parser.add_argument("--nondeterministic", action="store_true")
    parser.add_argument("--out", help="append one JSON record per point to this file")
    parser.add_argument("--hopper", help="Hopper forward tiles to try instead of the default, each its own row: "
                        "';'-separated block_q,block_kv,num_stages[,persistent][,overlap]")
    parser.add_argument("--one-pass", action="store_true",
                        help="force the one-pass Hopper backward (dq_atomic) at every head_dim")
    parser.add_argument("--dq-ordered", action="store_true",
                        help="force the deterministic one-pass Hopper backward (dq_atomic and dq_ordered: "
                        "semaphore-ordered dQ reduce-adds) at every head_dim")
    parser.add_argument("--two-pass", action="store_true",
                        help="force the two-pass Hopper backward (a separate dQ kernel) at every head_dim")
    parser.add_argument("--bwd", help="backward variants, each its own row: ';'-separated items of ','-separated "
                        "HopperBwdConfig field=int overrides of the call's default (an empty item: the default)")
    parser.add_argument("--bwd-registers", help="experiment: CONSUMER,PRODUCER setmaxnreg budgets of every Hopper "
                        "backward kernel (multiples of 8; 2 * CONSUMER + PRODUCER <= 512; defaults: two-pass "
                        "232,40, one-pass 240,24)")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, xla_chunked against xla")
    args = parser.parse_args(argv)
    if args.two_pass and (args.one_pass or args.dq_ordered):
        parser.error("--two-pass excludes --one-pass and --dq-ordered")
    if args.bwd_registers:
        impls.set_hopper_bwd_registers(args.bwd_registers)
    hopper_configs = parse_hopper_configs(args.hopper)
    bwd_variants = parse_bwd_overrides(args.bwd)
    if args.bwd is not None and (args.one_pass or args.dq_ordered or args.two_pass):
        parser.error("--bwd excludes --one-pass, --dq-ordered and --two-pass (set dq_atomic/dq_ordered in it)")
    causals = [c == "true" for c in args.causal.lower().split(",")]
    if not set(args.causal.lower().split(",")) <= {"false", "true"}:
        parser.error(f"--causal takes false, true or false,true; got {args.causal!r}")
    tokens, width, dtype = (256, 64, "float32") if args.smoke else (SWEEP_TOKENS, SWEEP_WIDTH, "bfloat16")
    seqs = [128] if args.smoke else [int(n) for n in args.seqs.split(",")]
    head_dims = [16, 32] if args.smoke else [int(d) for d in args.head_dims.split(",")]
    ours_impl, theirs_impl = ("xla_chunked", "xla") if args.smoke else (None, "cudnn")
    reps, min_sample_s = (5, 0.0) if args.smoke else (args.reps, 0.02)
    ours_name, theirs_name = ours_impl or "ours", theirs_impl
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    print("options:", " ".join(f"{k}={v}" for k, v in vars(args).items() if v not in (None, False)), flush=True)
    print(f"| pass | D | N | causal | tiles | {ours_name} ms (TF/s) | {theirs_name} ms | {theirs_name} / "
          f"{ours_name} (95% interval) | verdict | max abs diff | bitwise repeatable ({ours_name}/{theirs_name}) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|",
          flush=True)
    start = time.perf_counter()
    for pass_ in args.passes.split(","):
        for head_dim in head_dims:
            for seq in seqs:
                for causal in causals:
                    if time.perf_counter() - start > args.budget:
                        print(f"budget of {args.budget:.0f} s spent: stopped before {pass_} D={head_dim} "
                              f"N={seq} causal={causal}", flush=True)
                        return
                    heads = width // head_dim
                    point = Point("bar", max(1, tokens // seq), seq, seq, heads, heads, head_dim, causal, dtype)
                    inputs = [_random_inputs(point, DTYPES[dtype], seed) for seed in range(3)]  # q, k, v, ct
                    theirs, arg_sets = compile_pass(attend(theirs_impl, causal, True), pass_, inputs)
                    for hopper, bwd in ((h, b) for h in hopper_configs for b in bwd_variants):
                        config = None
                        hopper_bwd_config = None
                        if args.one_pass or args.dq_ordered or args.two_pass:
                            hopper_bwd_config = dataclasses.replace(HopperBwdConfig.default(head_dim),
                                                                    dq_atomic=not args.two_pass,
                                                                    dq_ordered=args.dq_ordered,
                                                                    num_stages_dkv=2)
                        elif bwd:
                            hopper_bwd_config = overridden_bwd_config(head_dim, not args.nondeterministic, seq,
                                                                      causal, bwd)
                        if hopper is not None or hopper_bwd_config is not None:
                            config = dataclasses.replace(pf.KernelConfig.default(head_dim), hopper=hopper,
                                                         hopper_bwd=hopper_bwd_config)
                        tiles = describe(hopper) + describe_bwd(bwd)
                        try:
                            ours, _ = compile_pass(attend(ours_impl, causal, not args.nondeterministic, config),
                                                   pass_, inputs)
                        except Exception as error:  # a swept tile that does not compile (registers, memory)
                            if hopper is None and not bwd:
                                raise
                            print(f"| {pass_} | {head_dim} | {seq} | {causal} | {tiles} | failed: "
                                  f"{type(error).__name__}: {str(error).splitlines()[0][:160]} |", flush=True)
                            continue
                        difference = max_abs_difference(_unpack(pass_, ours(*arg_sets[0])),
                                                        _unpack(pass_, theirs(*arg_sets[0])))
                        repeats = [repeatable(fn, arg_sets[0]) for fn in (ours, theirs)]
                        ratio, (low, high), ours_ms, theirs_ms, calls = paired_ratio(
                            ours, theirs, arg_sets, reps=reps, min_sample_s=min_sample_s)
                        verdict = "ahead" if low > 1.0 else "behind" if high < 1.0 else "parity"
                        flops = FLOP_FACTOR[pass_] * fwd_flops(point)
                        print(f"| {pass_} | {head_dim} | {seq} | {causal} | {tiles} | {ours_ms:.3f} "
                              f"({flops / ours_ms / 1e9:.0f}) | {theirs_ms:.3f} | {ratio:.3f} ({low:.3f}-{high:.3f})"
                              f" | {verdict} | {difference:.2e} | {'/'.join(map(_yes_no, repeats))} |", flush=True)
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps({
                                    "pass": pass_, "ours": ours_name, "theirs": theirs_name, "head_dim": head_dim,
                                    "seq": seq, "batch": point.batch, "heads": heads, "causal": causal,
                                    "forward_tiles": describe(hopper), "bwd_overrides": bwd or {},
                                    "ours_ms": ours_ms, "theirs_ms": theirs_ms,
                                    "ratio": ratio, "interval": [low, high], "verdict": verdict, "calls": calls,
                                    "reps": reps, "max_abs_difference": difference,
                                    "bitwise_repeatable": dict(zip(("ours", "theirs"), repeats)),
                                    "xla_flags": os.environ.get("XLA_FLAGS", ""),
                                    "nondeterministic": args.nondeterministic, "one_pass": args.one_pass,
                                    "dq_ordered": args.dq_ordered, "two_pass": args.two_pass,
                                    "bwd_registers": args.bwd_registers, "jax": jax.__version__,
                                    "device": jax.devices()[0].device_kind}) + "\n")


def repeatable(compiled, args, calls: int = REPEAT_CALLS) -> bool:
    """Whether `calls` calls on the same inputs give bitwise the same outputs (a backward that sums with
    atomics usually does not)."""
    first = [np.asarray(x) for x in jax.tree.leaves(compiled(*args))]
    for _ in range(calls - 1):
        again = [np.asarray(x) for x in jax.tree.leaves(compiled(*args))]
        if not all(np.array_equal(a, b) for a, b in zip(first, again)):
            return False
    return True


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def compile_pass(fn, pass_: str, inputs):
    """`fn`'s pass (the harness's `_pass_function`) compiled for these (q, k, v, cotangent) input sets;
    returns (compiled, the argument sets)."""
    jitted, make_args = _pass_function(fn, pass_)
    arg_sets = [make_args(*x) for x in inputs]
    return jitted.lower(*arg_sets[0]).compile(), arg_sets

if __name__ == "__main__":
    main()
