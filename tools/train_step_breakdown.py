"""Where a training step of the trainer's `small` preset spends its time, on the GPU (flash's tokens/s against dense's).

    python -m tools.train_step_breakdown [--seq-len 4096] [--batch-size 4] [--profile DIR]
        [--compiler-option NAME=VALUE ...] [--mesh data=D,context=C] [--attentions flash,dense,none]

Times the jitted train step (forward, backward, AdamW update) of the `small` GPT at the given context with three
attentions: "flash" (what the trainer runs), "dense" (XLA), and "none" (attention replaced by returning the values:
the cost of everything but attention). Prints ms per step three ways: synchronised after each step (median and
minimum of 20), queued back to back as the trainer runs them, and the host's dispatch time per call (as long as a
queued step once the device's queue is full, as the call then waits for room: the profile's idle time between
kernels says whether the GPU ever waits on the host); then XLA's cost analysis (FLOPs, bytes accessed) and how many
kernels the step launches. The step threads its parameters and optimiser state from call to call, so it is timed
here rather than by `benchmarks.timing` (which repeats fixed arguments). The summary's speed-up and shares are from
the queued times. With --mesh, the step runs as the trainer runs it on that mesh (batches placed by `shard_batch`,
flash as ring attention), and profiles count the first GPU's kernels (with a line for each other GPU). With
--profile DIR, also the device's busy time per step and the kernels that take it, from a trace of 5 queued steps
(`tools.kernel_breakdown.gpu_kernel_summary`). Each line ends with a hash of the parameters after 5 steps from the
seed's initialisation, taken twice: compare them within the process, and across two runs, to see whether training
there is bitwise reproducible (and with which --compiler-option).
"""

import argparse
import dataclasses
import hashlib
import re
import statistics
import time

import jax
import numpy as np

from tools.kernel_breakdown import gpu_kernel_summary
from train import data as data_lib
from train.config import PRESETS
from train.loop import init_model, make_mesh, make_optimizer, make_steps, replicate, shard_batch


def values_only(query, key, value, **_):
    """An attention_fn that skips attention: the step's cost without it (shapes and dtypes as flash's)."""
    del query, key
    return value


def kernel_count(compiled) -> dict[str, int]:
    """Instructions of the compiled step's entry computation that launch work: fusions, custom calls
    (the Pallas kernels, cuBLAS, cuDNN) and the rest; a rough count of the kernels one step launches."""
    text = compiled.as_text() or ""
    entry = text[text.rfind("ENTRY") :]
    counts = {"fusion": 0, "custom-call": 0, "other": 0}
    for line in entry.splitlines()[1:]:
        match = re.search(r"= [^ ]+ ([a-z-]+)\(", line)
        if not match or match.group(1) in ("parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
            continue
        counts[match.group(1) if match.group(1) in counts else "other"] += 1
    return counts


def fingerprint(compiled, cfg, attention, batches, steps=5) -> str:
    """A hash of the parameters after `steps` steps from the seed's initialisation: equal hashes from two
    calls (or two processes) mean the step is bitwise reproducible there."""
    mesh = make_mesh(cfg)
    _, params, rest = init_model(cfg, attention, mesh=mesh)
    opt_state = replicate(make_optimizer(cfg).init(params), mesh)
    for batch in batches[:steps]:
        params, opt_state, rest, _ = compiled(params, opt_state, rest, batch)
    digest = hashlib.sha1()
    for leaf in jax.tree.leaves(params):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()[:16]


def compiler_option(text: str) -> tuple[str, bool | str]:
    """A --compiler-option NAME=VALUE as (name, value), "true"/"false" (any case) as a bool: XLA's parser of
    option strings takes only "True" and "False" for a bool, so "false" would fail the compile."""
    name, _, value = text.partition("=")
    return name, {"true": True, "false": False}.get(value.lower(), value)


def time_step(cfg, attention, compiler_options, steps=20, profile_dir=None):
    """Times the compiled step three ways: synchronised one by one, queued back to back (what the trainer
    does between its log syncs), and the host's dispatch alone (how long a call takes to return)."""
    dataset = data_lib.make_dataset(cfg)
    mesh = make_mesh(cfg)
    model = cfg.model_config(attention, mesh=mesh)
    graphdef, params, rest = init_model(cfg, attention, mesh=mesh)
    tx = make_optimizer(cfg)
    opt_state = replicate(tx.init(params), mesh)
    train_step, _ = make_steps(graphdef, tx, mesh=mesh)
    batches = [shard_batch(dataset.train_batch(i), mesh, model) for i in range(2 * steps + 3)]
    compiled = train_step.lower(params, opt_state, rest, batches[0]).compile(compiler_options or None)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    prints = [fingerprint(compiled, cfg, attention, batches) for _ in range(2)]
    synced = []
    for i, b in enumerate(batches[: steps + 3]):
        start = time.perf_counter()
        params, opt_state, rest, metrics = compiled(params, opt_state, rest, b)
        jax.block_until_ready(metrics["loss"])
        if i >= 3:
            synced.append(time.perf_counter() - start)
    dispatch = []
    start = time.perf_counter()
    for b in batches[steps + 3 :]:
        call_start = time.perf_counter()
        params, opt_state, rest, metrics = compiled(params, opt_state, rest, b)
        dispatch.append(time.perf_counter() - call_start)
    jax.block_until_ready((params, metrics))
    queued_ms = 1e3 * (time.perf_counter() - start) / steps
    summary = ""
    if profile_dir:
        profiled = 5
        trace_dir = f"{profile_dir}/{attention if isinstance(attention, str) else 'none'}"
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for b in batches[:profiled]:
                params, opt_state, rest, metrics = compiled(params, opt_state, rest, b)
            jax.block_until_ready((params, metrics))
        summary = "\n" + gpu_kernel_summary(trace_dir, profiled)
    ms = 1e3 * statistics.median(synced)
    tokens = cfg.batch_size * cfg.seq_len
    flops = (cost or {}).get("flops", float("nan"))
    bytes_accessed = (cost or {}).get("bytes accessed", float("nan"))
    name = attention if isinstance(attention, str) else "none"
    print(
        f"STEP attention={name} seq={cfg.seq_len} batch={cfg.batch_size} mesh={cfg.mesh}: "
        f"synchronised {ms:.2f} ms/step (min {1e3 * min(synced):.2f}); "
        f"queued {queued_ms:.2f} ms/step ({tokens / queued_ms * 1e3:,.0f} tokens/s); "
        f"host dispatch {1e3 * statistics.median(dispatch):.2f} ms/call; XLA cost: {flops / 1e12:.2f} TFLOP, "
        f"{bytes_accessed / 1e9:.2f} GB accessed; launches {kernel_count(compiled)}; parameters after 5 steps "
        f"{' / '.join(prints)} ({'the same' if prints[0] == prints[1] else 'DIFFERENT'} in this process)"
        f"{summary}",
        flush=True,
    )
    return queued_ms


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tools.train_step_breakdown",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--compiler-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an XLA option for the step's compilation, e.g. xla_gpu_graph_min_graph_size=1 or "
        "xla_gpu_enable_triton_gemm=false",
    )
    parser.add_argument("--mesh", help="the trainer's --mesh (data=D,context=C): the step as it runs there")
    parser.add_argument(
        "--attentions",
        default="flash,dense,none",
        help="which of flash, dense and none (attention skipped) to time; the summary needs all three",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="also trace 5 queued steps of each into DIR and print the device's busy time and top kernels",
    )
    args = parser.parse_args(argv)
    jax.numpy.zeros(())  # initialise the backend before timing
    compiler_options = dict(compiler_option(option) for option in args.compiler_option)
    cfg = dataclasses.replace(PRESETS["small"], seq_len=args.seq_len, batch_size=args.batch_size, mesh=args.mesh)
    print("jax", jax.__version__, jax.devices()[0].device_kind, "compiler options", compiler_options, flush=True)
    attentions = {"flash": "flash", "dense": "dense", "none": values_only}
    names = args.attentions.split(",")
    if unknown := set(names) - set(attentions):
        parser.error(f"--attentions takes flash, dense and none, got {sorted(unknown)}")
    results = {name: time_step(cfg, attentions[name], compiler_options, profile_dir=args.profile) for name in names}
    if len(results) == 3:
        print(
            f"SUMMARY flash/dense speed-up {results['dense'] / results['flash']:.2f}x; without attention "
            f"{results['none']:.2f} ms: attention takes {results['flash'] - results['none']:.2f} ms (flash) and "
            f"{results['dense'] - results['none']:.2f} ms (dense) of a step",
            flush=True,
        )


if __name__ == "__main__":
    main()
