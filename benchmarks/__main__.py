"""The benchmark harness: ours side by side with cuDNN, XLA and JAX's own Pallas examples.

    python -m benchmarks SUITE [options]          # SUITE: seed, sweep, memory, backends, sparse, bar, flex, ring,
                                                  # decode, or all
    python -m benchmarks SUITE --smoke            # tiny sizes on CPU: checks the harness, claims nothing
    python -m benchmarks render DIR [DIR ...] --out DIR    # merge results.json files, redraw tables and plots

Each suite writes results.json (one record per implementation, point and pass), results.md and a PNG to
OUT/SUITE/, where OUT is `--out` or runs/benchmarks/<date>-<device>/ (ignored by git; never the source tree), and
prints the command that regenerates it. Published tables are copied from there into benchmarks/results/SUITE/.
`python -m benchmarks SUITE --help` lists a suite's options; benchmarks/README.md describes the suites.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile

SUITES = ("seed", "sweep", "memory", "backends", "sparse", "bar", "flex", "ring", "decode")
OWN_RUNNERS = ("bar", "flex", "ring", "decode")  # suites with a runner of their own (not points x implementations)
SMOKE_CPU_DEVICES = 2  # the ring suite's --smoke splits its sequence over two CPU devices
HELP = {
    "seed": "B=32 N=512 H=16 D=64 fp16 causal: fwd, bwd, fwd+bwd time and memory of every implementation",
    "sweep": "the FlashAttention paper's figure 3: N = 512..16k, D = 64 and 128, causal or not, B*N = 16k, H*D = 2048",
    "memory": "device and XLA temp bytes against N (B=8, H=16, D=64, fp16, causal) up to 64k, until dense runs out",
    "backends": "PyTorch SDPA's backend comparison: math (pf:xla), flash (pf:pallas, pf:mosaic), memory-efficient "
    "(pf:xla_chunked), and cuDNN",
    "sparse": "block-sparse time against the same call with a full block mask (local and strided masks)",
    "bar": "the bar: flash_attention's defaults against cuDNN (JAX's, PyTorch SDPA's), interleaved pairs with ~95%% "
    "intervals",
    "flex": "score_mod, mask_mod and sinks against our plain kernel, cuDNN and torch flex_attention (bf16, B*N = 16k, "
    "H=16, D=128, N=8k), and block-mask construction",
    "ring": "context parallelism on every local device (zig-zag and contiguous rings, all-gather) against one GPU "
    "on the whole sequence and cuDNN: causal, B=1, H=16 (and GQA 16/4), D=128, bf16, 8k-32k tokens per GPU",
    "decode": "flash_decode (one query, GQA 32/8, D=128, bf16; contiguous, paged, ragged) against cuDNN in TB/s, "
    "and GPT.generate against a dense masked-cache decode loop",
}


def default_out(date: str, device: str) -> str:
    """Where a run writes without --out: under the git-ignored runs/, never into the source tree."""
    from benchmarks import report

    return os.path.join("runs", "benchmarks", f"{date}-{report.slug(device)}")


def smoke_on_cpu() -> None:
    """--smoke runs on the CPU, split into SMOKE_CPU_DEVICES devices where JAX has not started its CPU client yet
    and XLA_FLAGS does not set a count (a process that started already, like the test session with its 8
    devices, keeps what it has)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", SMOKE_CPU_DEVICES)
    except (RuntimeError, AttributeError):  # started already, or a JAX without the option
        pass


def _csv(text, cast=str):
    return [cast(x) for x in text.split(",") if x] if text else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--out",
        help="output folder; each suite writes OUT/SUITE/ (default runs/benchmarks/<date>-<device>, ignored by git)",
    )
    common.add_argument("--smoke", action="store_true", help="tiny sizes on CPU; no timing claims")
    common.add_argument("--passes", help="comma list of fwd, bwd, fwdbwd")
    common.add_argument("--seqs", help="sequence lengths, e.g. 2048,8192")
    common.add_argument("--head-dims", help="head dims, e.g. 64,128")
    common.add_argument("--reps", type=int, help="timed samples (pairs) per measurement (default 15; bar 21)")
    common.add_argument("--min-sample-ms", type=float, help="host-clock length of one sample (default 10; bar 20)")
    common.add_argument("--time-budget", type=float, help="seconds; points not started in time are skipped")
    records = argparse.ArgumentParser(add_help=False)
    records.add_argument("--impls", help="comma list of implementations (default: every one the suite takes)")
    records.add_argument("--rotate", type=int, default=3, help="input sets to rotate over while timing")
    records.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="worker processes, so this one never holds the GPU (default: yes, except --smoke)",
    )
    bar = argparse.ArgumentParser(add_help=False)
    bar.add_argument("--causal", default="false,true", help="false, true or false,true")
    bar.add_argument(
        "--baselines",
        help="comma list of cudnn (jax.nn's, the default) and torch_cudnn (PyTorch SDPA's cuDNN backend, same process)",
    )
    bar.add_argument("--nondeterministic", action="store_true", help="ours with deterministic=False")
    forced = bar.add_mutually_exclusive_group()
    for flag, text in (
        ("--one-pass", "the one-pass Hopper backward (dq_atomic) at every head_dim"),
        (
            "--dq-ordered",
            "the one-pass backward with its dQ adds in a fixed order (bitwise deterministic) at every head_dim",
        ),
        ("--two-pass", "the two-pass Hopper backward (a separate dQ kernel) at every head_dim"),
    ):
        forced.add_argument(flag, dest="backward", action="store_const", const=flag[2:], default="default", help=text)
    bar.add_argument(
        "--hopper",
        help="forward tiles, each its own row: ';'-separated block_q,block_kv,num_stages[,persistent][,overlap]",
    )
    bar.add_argument(
        "--bwd",
        help="backward variants, each its own row: ';'-separated items of ','-separated "
        "HopperBwdConfig field=int overrides of the call's default (an empty item: the default)",
    )
    flex = argparse.ArgumentParser(add_help=False)
    flex.add_argument("--cases", help="comma list of the cases to run (default: all; see benchmarks/README.md)")
    flex.add_argument(
        "--hopper",
        help="mod on other Hopper forward tiles, each its own row: ';'-separated block_q,block_kv,num_stages"
        "[,persistent][,overlap]",
    )
    flex.add_argument(
        "--bwd",
        help="mod on other Hopper backwards, each its own row: ';'-separated items of ','-separated "
        "HopperBwdConfig field=int overrides of the plain call's default",
    )
    ring = argparse.ArgumentParser(add_help=False)
    ring.add_argument("--seqs-per-gpu", help="tokens per device, e.g. 8192,16384,32768 (the default)")
    decode = argparse.ArgumentParser(add_help=False)
    decode.add_argument("--cases", help="comma list of the cases to run (default: all; see benchmarks/README.md)")
    kind = argparse.RawDescriptionHelpFormatter
    for name in SUITES:
        parents = {"bar": [common, bar], "flex": [common, flex], "ring": [common, ring], "decode": [common, decode]}
        parents = parents.get(name, [common, records])
        doc = _suite_doc(name)
        sub.add_parser(name, parents=parents, help=HELP[name], description=doc, formatter_class=kind)
    sub.add_parser(
        "all", parents=[common, records], help="every suite in turn; flex, ring, decode, bar last", formatter_class=kind
    )
    render = sub.add_parser("render", help="merge the results.json of folders and redraw tables and plots")
    render.add_argument("dirs", nargs="+", metavar="DIR")
    render.add_argument("--out", required=True)
    return parser


def _suite_doc(name: str) -> str:
    from benchmarks import bar, decode, flex, ring, suites

    own = {"bar": bar.__doc__, "flex": flex.__doc__, "ring": ring.__doc__, "decode": decode.__doc__}
    return own.get(name) or f"The {name} suite: {HELP[name]}.\n\n{suites.__doc__}"


def _command(suite: str, argv: list[str]) -> str:
    """The command that regenerates a suite's numbers: its options, less where they were written."""
    kept = [
        a
        for i, a in enumerate(argv)
        if a != "--out" and (i == 0 or argv[i - 1] != "--out") and not a.startswith("--out=")
    ]
    return " ".join(["python -m benchmarks", suite, *map(shlex.quote, kept)])


def write(records: list[dict], folder: str) -> str:
    """results.json, results.md and the suite's PNG in `folder`; prints the table and the command."""
    from benchmarks import report

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(records, f, indent=1)
    markdown = report.markdown(records)
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write(markdown)
    pngs = report.plots(records, folder)
    print("\n" + markdown)
    for command in sorted({r["command"] for r in records}):
        print(f"regenerate: {command}")
    print(
        f"wrote {os.path.join(folder, 'results.json')}, results.md" + "".join(f", {os.path.basename(p)}" for p in pngs),
        flush=True,
    )
    return folder


def run_record_suites(args, names: list[str], argv: list[str], parser) -> dict[str, str]:
    from benchmarks import impls as impls_lib
    from benchmarks import suites
    from benchmarks.inputs import PASSES

    passes = _csv(args.passes)
    if passes and set(passes) - set(PASSES):
        parser.error(f"unknown pass in {args.passes!r}; choose from {', '.join(PASSES)}")
    if args.smoke:
        smoke_on_cpu()
    known = [impl.name for impl in impls_lib.all_impls()]
    chosen = _csv(args.impls)
    if chosen and set(chosen) - set(known):
        parser.error(
            f"unknown implementation(s) {', '.join(sorted(set(chosen) - set(known)))}; known: {', '.join(known)}"
        )
    if not impls_lib.tokamax_available():
        print("note: tokamax is not importable here; its implementations are skipped", flush=True)
    points, impl_names = [], {}
    for name in names:
        points += suites.suite_points(
            name, smoke=args.smoke, seqs=_csv(args.seqs, int), head_dims=_csv(args.head_dims, int), passes=passes
        )
        impl_names[name] = chosen or suites.default_impls(name, known, args.smoke)
    commands = {name: _command(name, argv) for name in names}
    for command in commands.values():
        print(f"regenerate: {command}", flush=True)
    settings = dict(
        reps=args.reps or (1 if args.smoke else 15),
        rotate=1 if args.smoke else args.rotate,
        min_sample_ms=0.0 if args.smoke else (10.0 if args.min_sample_ms is None else args.min_sample_ms),
    )
    isolate = not args.smoke if args.isolate is None else args.isolate  # the parent must not start a GPU client
    date = datetime.date.today().isoformat()
    with tempfile.TemporaryDirectory(prefix="pallas_flash_bench_") as workdir:
        settings["cache_dir"] = workdir
        records = suites.run(
            points,
            impl_names,
            isolate=isolate,
            settings=settings,
            command=commands,
            date=date,
            smoke=args.smoke,
            time_budget=args.time_budget,
            workdir=workdir,
        )
    if not records:
        raise SystemExit("no records: nothing was measured")
    root = args.out or default_out(date, records[0]["device"])
    return {
        name: write([r for r in records if r["suite"] == name], os.path.join(root, name))
        for name in names
        if any(r["suite"] == name for r in records)
    }


def run_bar(args, argv: list[str], parser) -> str:
    from benchmarks import bar

    causals = args.causal.lower().split(",")
    if not set(causals) <= {"false", "true"}:
        parser.error(f"--causal takes false, true or false,true; got {args.causal!r}")
    passes = _csv(args.passes) or ["fwd", "fwdbwd"]
    if set(passes) - {"fwd", "bwd", "fwdbwd"}:
        parser.error(f"unknown pass in {args.passes!r}; choose from fwd, bwd, fwdbwd")
    baselines = _csv(args.baselines) or ["cudnn"]
    if set(baselines) - {"cudnn", "torch_cudnn"}:
        parser.error(f"--baselines takes cudnn and torch_cudnn, got {args.baselines!r}")
    backward = args.backward
    if args.bwd is not None and backward != "default":
        parser.error("--bwd excludes --one-pass, --dq-ordered and --two-pass (set dq_atomic/dq_ordered in it)")
    try:
        bar.parse_hopper_configs(args.hopper)
        bar.parse_bwd_overrides(args.bwd)
        head_dims = bar.parse_head_dims(args.head_dims)
    except ValueError as e:
        parser.error(str(e))
    return _run_own_suite(
        "bar",
        args,
        argv,
        lambda stamp, on_record: bar.run(
            passes=passes,
            head_dims=[32] if args.smoke else head_dims or [128, 64],
            seqs=[128] if args.smoke else _csv(args.seqs, int) or [2048, 8192, 16384],
            causals=[c == "true" for c in causals],
            baselines=baselines,
            nondeterministic=args.nondeterministic,
            backward=backward,
            hopper=args.hopper,
            bwd=args.bwd,
            reps=args.reps,
            min_sample_ms=args.min_sample_ms,
            time_budget=args.time_budget,
            smoke=args.smoke,
            stamp=stamp,
            on_record=on_record,
        ),
    )


def _passes(args, parser, suite: str, allowed) -> list[str]:
    """--passes as a list (default: every pass `allowed`), or a usage error naming the suite's passes."""
    passes = _csv(args.passes) or list(allowed)
    if set(passes) - set(allowed):
        parser.error(f"{suite} takes the passes {' and '.join(allowed)}, got {args.passes!r}")
    return passes


def _cases(args, parser, known) -> list[str] | None:
    """--cases as a list (None: all), or a usage error listing the `known` cases."""
    names = _csv(args.cases)
    if names and set(names) - set(known):
        parser.error(f"unknown case in {args.cases!r}; choose from {', '.join(known)}")
    return names


def run_flex(args, argv: list[str], parser) -> str:
    from benchmarks import flex

    passes = _passes(args, parser, "flex", ("fwd", "fwdbwd"))
    names = _cases(args, parser, flex.case_names())
    from benchmarks import bar

    try:
        bar.parse_hopper_configs(args.hopper)
        bar.parse_bwd_overrides(args.bwd)
    except ValueError as e:
        parser.error(str(e))
    if not args.smoke:
        flex.share_the_gpu_with_torch()
    return _run_own_suite(
        "flex",
        args,
        argv,
        lambda stamp, on_record: flex.run(
            seqs=[flex.SMOKE_SEQ] if args.smoke else _csv(args.seqs, int) or [8192],
            head_dims=[32] if args.smoke else _csv(args.head_dims, int) or [128],
            passes=passes,
            names=names,
            reps=args.reps,
            min_sample_ms=args.min_sample_ms,
            time_budget=args.time_budget,
            smoke=args.smoke,
            stamp=stamp,
            on_record=on_record,
            hopper=args.hopper,
            bwd=args.bwd,
        ),
    )


def run_ring(args, argv: list[str], parser) -> str:
    from benchmarks import ring

    passes = _passes(args, parser, "ring", ring.PASSES)
    try:
        seqs = _csv(args.seqs_per_gpu, int)
    except ValueError:
        parser.error(f"--seqs-per-gpu takes a comma list of integers, got {args.seqs_per_gpu!r}")
    return _run_own_suite(
        "ring",
        args,
        argv,
        lambda stamp, on_record: ring.run(
            seqs_per_gpu=[ring.SMOKE_SEQ_PER_GPU] if args.smoke else seqs or list(ring.SEQS_PER_GPU),
            passes=passes,
            reps=args.reps,
            min_sample_ms=args.min_sample_ms,
            time_budget=args.time_budget,
            smoke=args.smoke,
            stamp=stamp,
            on_record=on_record,
        ),
    )


def run_decode(args, argv: list[str], parser) -> str:
    from benchmarks import decode

    names = _cases(args, parser, decode.case_names())
    return _run_own_suite(
        "decode",
        args,
        argv,
        lambda stamp, on_record: decode.run(
            names=names,
            reps=args.reps,
            min_sample_ms=args.min_sample_ms,
            time_budget=args.time_budget,
            smoke=args.smoke,
            stamp=stamp,
            on_record=on_record,
        ),
    )


def _run_own_suite(name: str, args, argv: list[str], measure) -> str:
    """A suite with a runner of its own (bar, flex, ring, decode): `measure(stamp, on_record)` returns its records,
    each stamped with the environment, command and date; results.json is rewritten after each record, so a cut-off
    run keeps what it measured. Returns the folder written."""
    from benchmarks import suites

    if args.smoke:
        smoke_on_cpu()
    command = _command(name, argv)
    print(f"regenerate: {command}", flush=True)
    env = suites.environment()
    date = datetime.date.today().isoformat()
    folder = os.path.join(args.out or default_out(date, env["device"]), name)
    print(f"jax {env['jax_version']}, {env['device']}", flush=True)

    def save(records):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "results.json"), "w") as f:
            json.dump(records, f, indent=1)

    records = measure(dict(env, command=command, date=date), save)
    if not records:
        raise SystemExit("no records: nothing was measured")
    return write(records, folder)


def main(argv=None):
    """Run the suites named on the command line; returns {suite: the folder it wrote}."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["worker"]:  # one work unit of the record suites, in its own process (benchmarks/suites.py)
        from benchmarks import suites

        with open(argv[1]) as f:
            suites.run_group(json.load(f))
        return {}
    parser = build_parser()
    args = parser.parse_args(argv)
    rest = argv[1:]
    if args.suite == "render":
        records = []
        for folder in args.dirs:
            with open(os.path.join(folder, "results.json")) as f:
                records += json.load(f)
        return {
            suite: write([r for r in records if r["suite"] == suite], os.path.join(args.out, suite))
            for suite in SUITES
            if any(r["suite"] == suite for r in records)
        }
    runners = {"bar": run_bar, "flex": run_flex, "ring": run_ring, "decode": run_decode}
    if args.suite in runners:
        return {args.suite: runners[args.suite](args, rest, parser)}
    names = [s for s in SUITES if s not in OWN_RUNNERS] if args.suite == "all" else [args.suite]
    written = run_record_suites(args, names, rest, parser)
    if args.suite == "all":
        own_argv = _drop_record_options([a for a in rest if a not in ("--isolate", "--no-isolate")])
        for name in ("flex", "ring", "decode", "bar"):
            written[name] = runners[name](build_parser().parse_args([name, *own_argv]), own_argv, parser)
    return written


def _drop_record_options(argv: list[str]) -> list[str]:
    """`all`'s options without those only the record suites take (--impls, --rotate and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--impls", "--rotate"):
            skip = True
        elif not a.startswith(("--impls=", "--rotate=")):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
