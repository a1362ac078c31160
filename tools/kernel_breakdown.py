"""Where forward+backward attention spends its GPU time, kernel by kernel: ours against cuDNN (bar shapes).

  PYTHONPATH=. python benchmarks/kernel_breakdown.py [--head-dim 64] [--seqs 8192,16384] [--causal true]
      [--pass fwdbwd] [--nondeterministic] [--calls 5] [--bwd ";delta_in_dp=0"] --trace-dir DIR

For each point, traces `--calls` queued calls of the jitted pass (after a warm-up) with `jax.profiler` and
prints, per call, the device's busy time and the kernels that take it (`train_step_breakdown.
gpu_kernel_summary`): the Mosaic GPU kernels by name (`flash_forward_sm90`, `flash_backward_dkdv_sm90`,
`flash_backward_dq_sm90`), and the XLA fusions around them (the backward's
delta = rowsum(dO * O), the float32 dQ buffer's zero fill and its conversion). The shapes are `bar.py`'s
(B * N = 16k tokens, H * D = 2048, bf16); the timings come from a profiler and are not the bar's paired ratios.
`--bwd`: backward variants as in `bar.py` (HopperBwdConfig field overrides of the call's default), each traced
as its own "ours" row.
"""
import argparse
import dataclasses

import jax

import pallas_flash as pf

from benchmarks.attention import DTYPES, SWEEP_TOKENS, SWEEP_WIDTH, Point, _random_inputs
from benchmarks.bar import attend, compile_pass, describe_bwd, overridden_bwd_config, parse_bwd_overrides
from benchmarks.train_step_breakdown import gpu_kernel_summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seqs", default="8192,16384")
    parser.add_argument("--causal", choices=("true", "false"), default="true")
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), default="fwdbwd")
    parser.add_argument("--nondeterministic", action="store_true", help="ours with deterministic=False")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--bwd", help="backward variants (bar.py's --bwd), each traced as its own row")
    parser.add_argument("--trace-dir", required=True)
    args = parser.parse_args(argv)
    causal = args.causal == "true"
    deterministic = not args.nondeterministic
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    for seq in (int(s) for s in args.seqs.split(",")):
        heads = SWEEP_WIDTH // args.head_dim
        point = Point("bar", max(1, SWEEP_TOKENS // seq), seq, seq, heads, heads, args.head_dim, causal, "bfloat16")
        inputs = [_random_inputs(point, DTYPES["bfloat16"], seed) for seed in range(3)]
        rows = []
        for overrides in parse_bwd_overrides(args.bwd):
            config = None
            if overrides:
                config = dataclasses.replace(pf.KernelConfig.default(args.head_dim), hopper_bwd=overridden_bwd_config(
                    args.head_dim, deterministic, seq, causal, overrides))
            rows.append(("ours" + describe_bwd(overrides).replace(" bwd:", "_").replace(",", "_"),
                         attend(None, causal, deterministic, config)))
        for name, attention in (*rows, ("cudnn", attend("cudnn", causal, deterministic))):
            fn, arg_sets = compile_pass(attention, args.pass_, inputs)
            for _ in range(3):
                jax.block_until_ready(fn(*arg_sets[0]))
            trace_dir = f"{args.trace_dir}/d{args.head_dim}_{seq}_{args.causal}_{name}"
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for call in range(args.calls):
                    out = fn(*arg_sets[call % len(arg_sets)])
                jax.block_until_ready(out)
            print(f"\n{args.pass_} D={args.head_dim} N={seq} batch={point.batch} heads={heads} causal={causal} "
                  f"{name}:\n{gpu_kernel_summary(trace_dir, args.calls, top=16)}", flush=True)


if __name__ == "__main__":
    main()
