"""Where attention spends its GPU time, kernel by kernel: ours against cuDNN at the bar's shapes, from a profile.

    python -m tools.kernel_breakdown --trace-dir DIR [--head-dim 64] [--seqs 8192,16384] [--causal true]
        [--pass fwdbwd] [--nondeterministic] [--calls 5] [--bwd ";delta_in_dp=0"] [--torch]

For each point, traces `--calls` queued calls of the jitted pass (after a warm-up) with `jax.profiler` and prints,
per call, the device's busy time and the kernels that take it (`gpu_kernel_summary`): the Mosaic GPU kernels by
name (`flash_forward_sm90`, `flash_backward_dkdv_sm90`, `flash_backward_dq_sm90`) and the XLA fusions around them
(the backward's delta = rowsum(dO * O), the float32 dQ buffer's zero fill and its conversion). Shapes, inputs and
passes are the bar suite's (`benchmarks.inputs.anchor_point`: B * N = 16k tokens, H * D = 2048, bf16); the times
come from a profiler, not from the bar's paired ratios. `--bwd`: backward variants as in the bar suite
(HopperBwdConfig field overrides of the call's default), each traced as its own "ours" row. `--torch`: also
PyTorch SDPA's cuDNN backend on the same inputs (the bar's torch_cudnn peer), its kernels from `torch.profiler`.
Needs a GPU.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib


def kernel_kind(name: str) -> str:
    """What a GPU kernel of a trace is: "attention" (our Mosaic GPU kernels), "collective" (NCCL), "gemm"
    (cuBLAS, cuBLASLt's nvjet, XLA's GEMM fusions) or "other" (XLA's fusions, copies, memsets)."""
    if name.startswith("flash_"):
        return "attention"
    if "nccl" in name.lower():
        return "collective"
    if name.startswith("nvjet") or "gemm" in name or "cutlass" in name:
        return "gemm"
    return "other"


def _exposed(kernels) -> float:
    """Microseconds during which a collective runs and no other kernel does (its time not hidden under compute)."""
    edges = sorted(
        (t, delta, kernel_kind(e["name"]) == "collective")
        for e in kernels
        for t, delta in ((e["ts"], 1), (e["ts"] + e["dur"], -1))
    )
    running = {True: 0, False: 0}
    alone, last = 0.0, None
    for t, delta, collective in edges:
        if last is not None and running[True] and not running[False]:
            alone += t - last
        running[collective] += delta
        last = t
    return alone


def _busy_and_gaps(kernels) -> tuple[float, float, list[tuple[float, str]]]:
    """(busy, span, gaps) of one device's kernels in microseconds: the union of their intervals, first start to
    last end, and each idle stretch between them as (length, the kernel that ends it)."""
    busy, end, gaps = 0.0, None, []
    for e in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is not None and start > end:
            gaps.append((start - end, e["name"]))
        busy += stop - start if end is None else max(0.0, stop - max(start, end))
        end = stop if end is None else max(end, stop)
    return busy, end - min(e["ts"] for e in kernels), gaps


def _totals(kernels, key=kernel_kind) -> dict[str, float]:
    """Microseconds per key of the kernels' names (by default their kind), largest first."""
    totals: dict[str, float] = {}
    for e in kernels:
        name = key(e["name"])
        totals[name] = totals.get(name, 0.0) + e["dur"]
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _top_kernels(totals: dict[str, float], busy: float, count: int, top: int, unit: str) -> list[str]:
    """One line per kernel name of `totals` (microseconds over `count` steps or calls), largest first: ms per
    `unit` and share of `busy`."""
    ranked = sorted(totals.items(), key=lambda item: -item[1])[:top]
    return [f"  {us / count / 1e3:7.3f} ms/{unit} {100 * us / busy:5.1f}%  {name[:110]}" for name, us in ranked]


def gpu_kernel_summary(trace_dir: str, steps: int, top: int = 12) -> str:
    """The first GPU's time per step (or call) from a perfetto trace: busy time, wall span, its idle time between
    kernels (and the longest such gap), time per kind of kernel (`kernel_kind`) with the collectives' exposed part,
    and the kernels that take the most of it (name, ms per step, share of busy time). One GPU's: on a mesh every
    device runs the same program, and a union over devices would hide one device's idle time under another's
    kernels; each other GPU gets one line of busy time and kinds, so that one device waiting on another (a
    collective that runs long on one side) shows."""
    path = sorted(pathlib.Path(trace_dir).glob("**/perfetto_trace.json.gz"))[-1]
    events = json.load(gzip.open(path))["traceEvents"]
    devices = {
        e["args"]["name"]: e["pid"]
        for e in events
        if e.get("name") == "process_name" and e["args"]["name"].startswith("/device:GPU")
    }
    per_device = {name: [e for e in events if e.get("ph") == "X" and e["pid"] == pid] for name, pid in devices.items()}
    kernels = per_device[min(devices)] if devices else []
    if not kernels:
        names = sorted({e["args"]["name"] for e in events if e.get("name") == "process_name"})
        return f"no device events in the trace; its processes: {names}"
    per_step = lambda us: us / steps / 1e3  # noqa: E731
    kinds = lambda totals: ", ".join(f"{kind} {per_step(us):.2f}" for kind, us in totals.items())  # noqa: E731
    busy, span, gaps = _busy_and_gaps(kernels)
    longest = max(gaps, default=(0.0, "-"))
    lines = [
        f"device busy {per_step(busy):.2f} ms/step of a {per_step(span):.2f} ms/step span, "
        f"{len(kernels) / steps:.0f} kernels/step; idle between kernels {per_step(sum(g for g, _ in gaps)):.2f} "
        f"ms/step, the longest gap {longest[0]:.0f} us (before {longest[1][:60]})",
        f"  by kind (ms/step, overlapping kernels each counted): {kinds(_totals(kernels))}; collectives alone "
        f"{per_step(_exposed(kernels)):.2f}",
    ]
    lines += _top_kernels(_totals(kernels, key=str), busy, steps, top, "step")
    for name in sorted(devices)[1:]:
        if others := per_device[name]:
            other_busy, other_span, _ = _busy_and_gaps(others)
            lines.append(
                f"{name.removeprefix('/device:')}: busy {per_step(other_busy):.2f} ms/step of a "
                f"{per_step(other_span):.2f} ms/step span; {kinds(_totals(others))}; collectives alone "
                f"{per_step(_exposed(others)):.2f}"
            )
    return "\n".join(lines)


def kernel_table(times: dict[str, float], calls: int, top: int = 12) -> str:
    """Microseconds per kernel name over `calls` calls as the busy time per call and the kernels that take it
    (ms per call, share), largest first: a profile's summary where it has no trace of its own (torch's)."""
    busy = sum(times.values())
    lines = [f"device busy {busy / calls / 1e3:.2f} ms/call (the kernels' sum), {len(times)} kernel names"]
    return "\n".join(lines + _top_kernels(times, busy, calls, top, "call"))


def torch_kernel_times(fn, arg_sets, calls: int) -> dict[str, float]:
    """Microseconds of device time per CUDA kernel name over `calls` calls of a torch pass (`timing.torch_pass`),
    from `torch.profiler` after a warm-up."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for args in arg_sets:
        fn(*args).block_until_ready()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in range(calls):
            fn(*arg_sets[call % len(arg_sets)])
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            us = event.device_time if hasattr(event, "device_time") else event.cuda_time
            times[event.name] = times.get(event.name, 0.0) + us
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.kernel_breakdown",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace-dir", required=True, help="where the traces go (one folder per point and row)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seqs", default="8192,16384")
    parser.add_argument("--causal", choices=("true", "false"), default="true")
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "fwdbwd"), default="fwdbwd")
    parser.add_argument("--nondeterministic", action="store_true", help="ours with deterministic=False")
    parser.add_argument("--calls", type=int, default=5, help="queued calls traced per row")
    parser.add_argument("--bwd", help="backward variants (the bar suite's --bwd), each traced as its own row")
    parser.add_argument("--torch", action="store_true", help="also PyTorch SDPA's cuDNN backend (torch.profiler)")
    args = parser.parse_args(argv)

    import jax

    from benchmarks import bar
    from benchmarks.inputs import anchor_point, compile_pass, random_inputs

    causal, deterministic = args.causal == "true", not args.nondeterministic
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    points = []  # (seq, point, its inputs, the header of its rows)
    for seq in (int(s) for s in args.seqs.split(",")):
        point = anchor_point("kernel_breakdown", seq, args.head_dim, causal)
        header = f"\n{args.pass_} D={args.head_dim} N={seq} batch={point.batch} heads={point.heads} causal={causal}"
        points.append((seq, point, [random_inputs(point, seed) for seed in range(3)], header))
    for seq, _, inputs, header in points:
        rows = []
        for overrides in bar.parse_bwd_overrides(args.bwd):
            config = bar.kernel_config(args.head_dim, seq, causal, deterministic, bwd=overrides)
            name = "ours" + bar.describe_bwd(overrides).replace(" bwd:", "_").replace(",", "_")
            rows.append((name, bar.attend(None, causal, deterministic, config)))
        for name, attention in (*rows, ("cudnn", bar.attend("cudnn", causal))):
            fn, arg_sets = compile_pass(attention, args.pass_, inputs)
            for _ in range(3):
                jax.block_until_ready(fn(*arg_sets[0]))
            trace_dir = f"{args.trace_dir}/d{args.head_dim}_{seq}_{args.causal}_{name}"
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for call in range(args.calls):
                    out = fn(*arg_sets[call % len(arg_sets)])
                jax.block_until_ready(out)
            print(f"{header} {name}:\n{gpu_kernel_summary(trace_dir, args.calls, top=16)}", flush=True)
    # torch's profiler last: once it holds CUPTI, jax.profiler cannot subscribe again in this process.
    for _, point, inputs, header in points if args.torch else ():
        try:
            timed = bar.torch_cudnn_timed(point, args.pass_, inputs)
        except bar.NoPeer as e:  # no torch, no CUDA for it, or a pass it does not time
            print(f"{header} torch: {e}", flush=True)
            continue
        times = torch_kernel_times(timed.fn, timed.args, args.calls)
        print(f"{header} {timed.label}:\n{kernel_table(times, args.calls, top=16)}", flush=True)


if __name__ == "__main__":
    main()
