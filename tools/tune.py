"""Tune a kernel family's tiles on the GPU: each candidate against the default, paired; then the best against cuDNN.

    python -m tools.tune portable [--head-dims 64,128] [--seqs 8192] [--causal false,true] [--reps 11] [--out DIR]
    python -m tools.tune hopper [--head-dims 64,128] [--seqs 2048,8192,16384] [--causal false,true] [--nondeterministic]

portable: block-size candidates of each portable kernel (forward; dK/dV; dQ: block_q, block_kv, num_warps,
num_stages) as `KernelConfig` fields over the head_dim's default, run by `flash_attention(implementation="pallas")`.
hopper: `HopperConfig` forward tiles and `HopperBwdConfig` backward variants over the call's default, run by
`implementation="mosaic"`. Forward candidates are timed on the fwd pass, backward ones on the bwd pass (the VJP
alone). Shapes and inputs are the bar's (`benchmarks.inputs.anchor_point`: B * N = 16k tokens, H * D = 2048, bf16).

Each candidate's outputs are checked against the default's (relative error within the bf16 gradient tolerance of
tests/tolerances.py) and then timed in interleaved pairs against the default (`benchmarks.timing.paired_ratio`):
`ratio` = default ms / candidate ms, > 1 faster, with its ~95% interval. A kernel's best candidate is the fastest
whose interval lies above 1 (else the default); the best of every kernel combined is then paired with cuDNN on
fwd and fwd+bwd, beside the default. Writes results.json to --out (default runs/tune/<date>-<device>/). A default
changes in pallas_flash/config.py (portable) or pallas_flash/hopper/config.py (Hopper) after a bar run confirms it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys

# (block_q, block_kv, num_warps, num_stages) per portable kernel.
PORTABLE = {
    "fwd": {
        128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 3)],
        64: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 32, 4, 4)],
    },
    "dkdv": [
        (64, 64, 4, 3),
        (32, 64, 4, 3),
        (64, 128, 8, 2),
        (32, 128, 8, 2),
        (32, 128, 4, 2),
        (64, 64, 4, 2),
        (64, 64, 8, 3),
        (32, 64, 4, 4),
        (64, 128, 8, 3),
    ],
    "dq": [
        (64, 64, 4, 3),
        (128, 64, 8, 2),
        (128, 32, 4, 3),
        (64, 32, 4, 3),
        (128, 64, 8, 3),
        (64, 64, 4, 2),
        (128, 32, 8, 2),
        (64, 64, 8, 3),
    ],
}
PORTABLE_FIELDS = {
    "fwd": ("block_q", "block_kv", "num_warps", "num_stages"),
    "dkdv": ("block_q_dkv", "block_kv_dkv", "num_warps_dkv", "num_stages_dkv"),
    "dq": ("block_q_dq", "block_kv_dq", "num_warps_dq", "num_stages_dq"),
}
# (block_q, block_kv, num_stages[, flags]) Hopper forward tiles per head_dim.
HOPPER_FWD = {
    64: [
        "64,128,3",
        "64,256,2",
        "64,192,2",
        "64,192,3",
        "64,256,3",
        "64,128,2",
        "64,256,2,persistent",
        "64,128,3,persistent",
    ],
    128: [
        "64,128,2",
        "64,128,2,overlap",
        "64,128,2,persistent",
        "64,128,2,persistent,overlap",
        "64,192,2",
        "64,64,3",
        "64,64,4",
    ],
}
# HopperBwdConfig field overrides of the call's default backward.
HOPPER_BWD = [
    "dq_atomic=0,dq_ordered=0",
    "dq_atomic=1,dq_ordered=0,block_q_dkv=128",
    "delta_in_dp=0",
    "delta_in_dp=1",
    "dq_overlap=1,num_stages_dq=4",
    "dq_overlap=0",
    "dkv_overlap=1,num_stages_dkv=4",
    "dkv_overlap=0",
    "num_stages_dkv=2",
    "num_stages_dkv=3",
    "portable=1",
]


def candidates(family: str, head_dim: int, seq: int, causal: bool, deterministic: bool):
    """(kernel, pass, label, KernelConfig) for every candidate of the family at this point."""
    import pallas_flash as pf
    from benchmarks import bar

    base = pf.KernelConfig.default(head_dim)
    if family == "portable":
        padded = 128 if head_dim > 64 else 64
        for kernel in ("fwd", "dkdv", "dq"):
            values = PORTABLE[kernel][padded] if kernel == "fwd" else PORTABLE[kernel]
            for v in values:
                fields = dict(zip(PORTABLE_FIELDS[kernel], v))
                yield kernel, "fwd" if kernel == "fwd" else "bwd", str(v), dataclasses.replace(base, **fields)
        return
    for tiles in HOPPER_FWD[128 if head_dim > 64 else 64]:
        yield "fwd", "fwd", tiles, dataclasses.replace(base, hopper=bar.parse_hopper_configs(tiles)[0])
    for overrides in HOPPER_BWD:
        fields = bar.parse_bwd_overrides(overrides)[0]
        try:
            config = bar.overridden_bwd_config(head_dim, deterministic, seq, causal, fields)
        except ValueError as e:  # a combination HopperBwdConfig rejects over this default
            print(f"skipped bwd {overrides} at D={head_dim}: {e}", flush=True)
            continue
        yield "bwd", "bwd", overrides, dataclasses.replace(base, hopper_bwd=config)


def _relative_error(a, b) -> float:
    import jax
    import numpy as np

    from tests import tolerances

    errors = [
        tolerances.relative_error(np.asarray(x, np.float64), np.asarray(y, np.float64))
        if np.all(np.isfinite(np.asarray(x, np.float32)))
        else float("inf")
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    ]
    return max(errors)


def tune_point(family, head_dim, seq, causal, deterministic, *, reps, min_sample_s, emit):
    """Every candidate at one point against the default, then the best combination against cuDNN."""
    import jax.numpy as jnp

    import pallas_flash as pf
    from benchmarks import bar, timing
    from benchmarks.inputs import anchor_point, compile_pass, outputs, random_inputs
    from tests import tolerances

    implementation = "pallas" if family == "portable" else "mosaic"
    point = anchor_point("tune", seq, head_dim, causal)
    inputs = [random_inputs(point, seed) for seed in range(3)]
    base = dict(
        family=family,
        head_dim=head_dim,
        seq=seq,
        batch=point.batch,
        heads=point.heads,
        causal=causal,
        deterministic=deterministic,
    )
    defaults, best = {}, {}
    for kernel, pass_, label, config in candidates(family, head_dim, seq, causal, deterministic):
        if pass_ not in defaults:
            defaults[pass_] = compile_pass(bar.attend(implementation, causal, deterministic), pass_, inputs)
        default, default_args = defaults[pass_]
        record = dict(base, kernel=kernel, candidate=label, status="ok", note="")
        record["pass"] = pass_
        try:
            fn, args = compile_pass(bar.attend(implementation, causal, deterministic, config), pass_, inputs)
            error = _relative_error(outputs(pass_, fn(*args[0])), outputs(pass_, default(*default_args[0])))
            record["rel_err_to_default"] = error
            if error > tolerances.GRADIENT[jnp.bfloat16]:
                emit(dict(record, status="fail", note=f"relative error {error:.1e} to the default"))
                continue
            p = timing.paired_ratio(fn, args, default, default_args, reps=reps, min_sample_s=min_sample_s)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile (registers, shared memory)
            emit(dict(record, status="skip", note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
            continue
        emit(dict(record, ms=p.ours_ms, default_ms=p.theirs_ms, ratio=p.ratio, interval=[p.low, p.high]))
        if p.low > 1.0 and p.ratio > best.get(kernel, (None, 1.0))[1]:
            best[kernel] = (config, p.ratio, label)
    # The best of every kernel combined: the portable kernels' fields are disjoint; Hopper's are hopper / hopper_bwd.
    combined = pf.KernelConfig.default(head_dim)
    for kernel, (config, _, _) in best.items():
        if family == "portable":
            fields = {f: getattr(config, f) for f in PORTABLE_FIELDS[kernel]}
        else:
            fields = {
                "hopper" if kernel == "fwd" else "hopper_bwd": getattr(
                    config, "hopper" if kernel == "fwd" else "hopper_bwd"
                )
            }
        combined = dataclasses.replace(combined, **fields)
    label = "; ".join(f"{kernel} {value[2]}" for kernel, value in sorted(best.items())) or "the default"
    for pass_ in ("fwd", "fwdbwd"):
        cudnn, cudnn_args = compile_pass(bar.attend("cudnn", causal), pass_, inputs)
        for name, config in (("default", None), ("best", combined if best else None)):
            if name == "best" and config is None:
                continue
            fn, args = compile_pass(bar.attend(implementation, causal, deterministic, config), pass_, inputs)
            p = timing.paired_ratio(fn, args, cudnn, cudnn_args, reps=reps, min_sample_s=min_sample_s)
            emit(
                dict(
                    base,
                    kernel="all",
                    candidate=label if name == "best" else "default",
                    status="ok",
                    note="",
                    ms=p.ours_ms,
                    cudnn_ms=p.theirs_ms,
                    ratio_to_cudnn=p.ratio,
                    interval=[p.low, p.high],
                    **{"pass": pass_},
                )
            )
    print(f"BEST {family} D={head_dim} N={seq} causal={causal}: {label}", flush=True)


def _line(r) -> str:
    head = f"{r['family']} D={r['head_dim']} N={r['seq']} causal={int(r['causal'])} {r['kernel']:4s} {r['pass']:6s}"
    if r["status"] != "ok":
        return f"{head} {r['candidate']:40s} {r['status'].upper()}: {r['note']}"
    low, high = r["interval"]
    against = "cuDNN" if "ratio_to_cudnn" in r else "default"
    ratio = r.get("ratio_to_cudnn", r.get("ratio"))
    return f"{head} {r['candidate']:40s} {r['ms']:8.3f} ms  {against} / this {ratio:.3f} ({low:.3f}-{high:.3f})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("family", choices=("portable", "hopper"))
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seqs", help="default: 8192 (portable), 2048,8192,16384 (hopper)")
    parser.add_argument("--causal", default="false,true", help="false, true or false,true")
    parser.add_argument("--nondeterministic", action="store_true", help="tune with deterministic=False")
    parser.add_argument("--reps", type=int, default=11, help="interleaved pairs per candidate")
    parser.add_argument("--min-sample-ms", type=float, default=20.0)
    parser.add_argument("--out", help="output folder (default runs/tune/<date>-<device>, ignored by git)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    causals = args.causal.lower().split(",")
    if not set(causals) <= {"false", "true"}:
        parser.error(f"--causal takes false, true or false,true; got {args.causal!r}")

    import jax

    from benchmarks import report

    seqs = args.seqs or ("8192" if args.family == "portable" else "2048,8192,16384")
    device = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join("runs", "tune", f"{date}-{report.slug(device)}")
    os.makedirs(out, exist_ok=True)
    stamp = dict(
        device=device,
        jax_version=jax.__version__,
        date=date,
        command=" ".join(["python -m tools.tune", *map(shlex.quote, argv)]),
    )
    records = []

    def emit(record):
        records.append(dict(record, **stamp))
        print(_line(record), flush=True)
        with open(os.path.join(out, "results.json"), "w") as f:  # after every record: a cut-off run keeps them
            json.dump(records, f, indent=1)

    print("jax", jax.__version__, device, flush=True)
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for seq in (int(n) for n in seqs.split(",")):
            for causal in (c == "true" for c in causals):
                tune_point(
                    args.family,
                    head_dim,
                    seq,
                    causal,
                    not args.nondeterministic,
                    reps=args.reps,
                    min_sample_s=args.min_sample_ms / 1e3,
                    emit=emit,
                )
    print(f"wrote {os.path.join(out, 'results.json')}", flush=True)


if __name__ == "__main__":
    main()
