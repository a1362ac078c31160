"""The record suites: seed, sweep, memory, backends and sparse, each a list of points measured for every
implementation and pass, one record each.

Method, for every implementation, point and pass:
  1. compile the jitted pass (`benchmarks.inputs.pass_function`); its memory analysis gives `temp_bytes` (XLA's
     scratch, which holds cuDNN's workspace and a dense attention's N x N logits);
  2. run it once and read the device's high-water mark (`memory_stats()["peak_bytes_in_use"]`). JAX cannot reset
     that mark, so `peak_bytes` (this call's inputs plus what it allocated) is recorded only when the mark rose
     during the call, and left null otherwise; for the same reason the memory suite runs each implementation and
     pass in its own process on the GPU, its points in ascending size;
  3. check it on fresh random inputs against the float32 dense reference (`pallas_flash.attention_reference`, run
     on the host so it cannot disturb device memory): output for fwd, dq/dk/dv for bwd and fwdbwd, on the first
     batch element and the query heads of the first key head, with the per-dtype tolerances of
     tests/tolerances.py. Above `CHECK_ROWS` queries only the first rows are checked (the cotangent is zero beyond
     them, so dk and dv are still exact). A wrong implementation gets no number, only FAIL;
  4. time it (`benchmarks.timing`) over `rotate` input sets: paired with the baseline (cuDNN on an NVIDIA GPU,
     our dense XLA path elsewhere) at the same point and pass, which gives `ratio_to_baseline` (the baseline's
     ms / this ms, > 1: faster) and its ~95% `ratio_interval`; the baseline itself, and anything whose baseline
     did not run, by its median alone. `ms` is the median sample.
Block-sparse points (the sparse suite) carry a block-mask `pattern` and the mask's `density`; their FLOPs count
the computed blocks only, the reference applies the same mask, and each is paired with the same implementation,
pass and shape under a full block mask: `ratio_to_dense_same_impl` = this ms / that ms (below 1 is faster than
dense), with `dense_ratio_interval`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from benchmarks import impls as impls_lib
from benchmarks import report, timing
from benchmarks.inputs import (
    ANCHOR_TOKENS,
    ANCHOR_WIDTH,
    DTYPES,
    FLOP_FACTOR,
    PASSES,
    Point,
    anchor_point,
    fwd_flops,
    outputs,
    pass_function,
    random_inputs,
)
from pallas_flash.device import on_nvidia_gpu
from tests import tolerances

SUITES = ("seed", "sweep", "memory", "backends", "sparse")
CHECK_ROWS = 8192  # above this many queries, check the first CHECK_ROWS // 2 rows only (host memory, time)
# The sparse suite's masks: the dense baseline, then two patterns at three densities each.
SPARSE_PATTERNS = (("full", 1.0),) + tuple((p, d) for p in ("local", "strided") for d in (0.5, 0.25, 0.125))
SMOKE_SPARSE_PATTERNS = (("full", 1.0), ("local", 0.5), ("strided", 0.25))
SPARSE_TOKENS = 32768  # batch * seq of each sparse point


# ---------------------------------------------------------------------------------------------------- suites


def suite_points(name: str, *, smoke: bool, seqs=None, head_dims=None, passes=None) -> list[Point]:
    """The points of one suite (tiny ones with `smoke`); `seqs`, `head_dims`, `passes` restrict or replace them."""

    def square(suite, batch, seq, heads, head_dim, causal, dtype, **kw):
        return Point(suite, batch, seq, seq, heads, heads, head_dim, causal, dtype, **kw)

    if name == "seed":
        points = [square("seed", *((1, 64, 2, 32) if smoke else (32, 512, 16, 64)), True, "float16")]
    elif name == "backends":
        shapes = (
            [(1, 64, 2, 32, "float16")] if smoke else [(32, 512, 16, 64, "float16"), (2, 8192, 16, 128, "bfloat16")]
        )
        points = [square("backends", b, n, h, d, True, dt, passes=("fwd", "fwdbwd")) for b, n, h, d, dt in shapes]
    elif name == "sweep":
        seqs = seqs or ([128] if smoke else [512, 1024, 2048, 4096, 8192, 16384])
        head_dims = head_dims or ([32] if smoke else [64, 128])
        tokens, width = (128, 64) if smoke else (ANCHOR_TOKENS, ANCHOR_WIDTH)
        causals = (True,) if smoke else (False, True)
        sweep_passes = ("fwd", "fwdbwd") if smoke else PASSES  # the seed suite's smoke covers bwd
        points = [
            anchor_point("sweep", n, d, causal, tokens=tokens, width=width, passes=sweep_passes)
            for d in head_dims
            for causal in causals
            for n in seqs
        ]
    elif name == "memory":
        # Fixed batch and heads, so bytes grow with seq alone: linearly for flash, quadratically for dense.
        seqs = seqs or ([64, 128] if smoke else [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536])
        head_dims = head_dims or ([32] if smoke else [64])
        batch, heads = (1, 2) if smoke else (8, 16)
        points = [
            square("memory", batch, n, heads, d, True, "float16", passes=("fwd", "fwdbwd"), timed=False)
            for d in head_dims
            for n in seqs
        ]
    elif name == "sparse":
        # Issue 8's bar: block-sparse time falls with density. B * N fixed, H = 16, D = 128, not causal.
        seqs = seqs or ([128] if smoke else [8192, 16384])
        head_dims = head_dims or ([32] if smoke else [128])
        tokens, heads = (128, 2) if smoke else (SPARSE_TOKENS, 16)
        points = [
            square(
                "sparse",
                max(1, tokens // n),
                n,
                heads,
                d,
                False,
                "bfloat16",
                passes=("fwd", "fwdbwd"),
                pattern=pattern,
                density=density,
            )
            for d in head_dims
            for n in seqs
            for pattern, density in SPARSE_PATTERNS
            if not smoke or (pattern, density) in SMOKE_SPARSE_PATTERNS
        ]
    else:
        raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    if passes:
        points = [dataclasses.replace(p, passes=tuple(x for x in p.passes if x in passes)) for p in points]
    return [p for p in points if p.passes]


def default_impls(suite: str, names: list[str], smoke: bool = False) -> list[str]:
    """The implementations a suite runs unless --impls names them. At smoke sizes (CPU) only the seed suite runs
    every one (those that need a GPU record why they skip); the others run ours through XLA (`pf:xla_chunked`, and
    the baseline `pf:xla` where ratios are paired with it), enough to exercise the harness, where the kernels in
    interpret mode would take minutes."""
    if smoke and suite != "seed":
        return [n for n in names if n == "pf:xla_chunked" or (n == "pf:xla" and suite in ("sweep", "backends"))]
    if suite == "backends":  # the SDPA-style comparison is among our implementations, with the baseline as the bar
        return [n for n in names if n.startswith("pf:") or n in ("cudnn", "xla")]
    if suite == "sparse":  # only ours take a block mask; dense "xla" would hold B*H*N^2 float32 logits
        return [n for n in names if n in ("pf:pallas", "pf:xla_chunked")]
    return names


# ---------------------------------------------------------------------------------------------- environment


def environment() -> dict:
    """Device, software versions and CUDA/cuDNN versions (where this JAX exposes them)."""
    device = jax.devices()[0]
    import jaxlib

    env = dict(
        device=device.device_kind,
        platform=device.platform,
        jax_version=jax.__version__,
        jaxlib_version=getattr(jaxlib, "__version__", None),
        python=platform.python_version(),
        cuda_version=None,
        cudnn_version=None,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
    )
    try:  # the only place that reads a private module: JAX has no public accessor for these versions
        from jax._src.lib import cuda_versions

        if cuda_versions is not None and device.platform == "gpu":
            env["cuda_version"] = cuda_versions.cuda_runtime_get_version()
            env["cudnn_version"] = cuda_versions.cudnn_get_version()
    except (ImportError, AttributeError, RuntimeError):
        pass
    return env


# ---------------------------------------------------------------------------------------------- the check


def _check_seed(point):
    return int(hashlib.sha1(point.key().encode()).hexdigest()[:7], 16)  # < 2**28: a valid int32 seed


def _check_slices(point):
    """The part of each tensor the check compares: batch 0, the query heads of key head 0, and the first `rows`
    queries."""
    group = point.heads // point.kv_heads
    rows = point.seq_q if point.seq_q <= CHECK_ROWS else CHECK_ROWS // 2
    return rows, (slice(0, 1), slice(0, rows), slice(0, group)), (slice(0, 1), slice(None), slice(0, 1))


def _reference(point, dtype, scale, cache_dir):
    """Reference output and gradients on the check slice, on the host in float32, cached on disk so every
    process reuses them."""
    name = hashlib.sha1(f"{point.key()}|{jnp.dtype(dtype).name}|{scale!r}|{CHECK_ROWS}".encode()).hexdigest()
    path = os.path.join(cache_dir, name + ".npz")
    if os.path.exists(path):
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    q, k, v, ct = random_inputs(point, _check_seed(point), dtype)
    rows, qs, ks = _check_slices(point)
    cpu = jax.devices("cpu")[0]
    q, ct = (jax.device_put(x[qs].astype(jnp.float32), cpu) for x in (q, ct))
    k, v = (jax.device_put(x[ks].astype(jnp.float32), cpu) for x in (k, v))
    # Top-left causal alignment makes the first `rows` queries an exact sub-problem against all keys (and the
    # first rows of a block mask).
    block_mask = impls_lib.block_mask_of(point, q_len=rows) if point.pattern else None
    ref = jax.jit(
        lambda q, k, v: pf.attention_reference(q, k, v, scale=scale, is_causal=point.causal, block_mask=block_mask)[0]
    )
    out, vjp = jax.vjp(ref, q, k, v)
    dq, dk, dv = vjp(ct)
    result = {name: np.asarray(x) for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}
    np.savez(path, **result)
    return result


def _relative_error(ours, ref):
    ours = np.asarray(ours, np.float64)
    if not np.all(np.isfinite(ours)):
        return float("inf")
    return tolerances.relative_error(ours, ref)


def _check(point, pass_, dtype, results, ref):
    """Relative errors of this pass's results against the reference, the tolerance, and whether they pass."""
    _, qs, ks = _check_slices(point)
    dt = jnp.dtype(dtype).type
    if pass_ == "fwd":
        errors, tol = {"out": _relative_error(results[qs], ref["out"])}, tolerances.OUTPUT[dt]
    else:
        dq, dk, dv = results
        errors = {
            "dq": _relative_error(dq[qs], ref["dq"]),
            "dk": _relative_error(dk[ks], ref["dk"]),
            "dv": _relative_error(dv[ks], ref["dv"]),
        }
        tol = tolerances.GRADIENT[dt]
    return errors, tol


# ---------------------------------------------------------------------------------------------- measurement


def _memory_stats():
    try:
        stats = jax.devices()[0].memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    return stats if stats and "peak_bytes_in_use" in stats else None


def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype"))


def error_note(exc: BaseException) -> str:
    """A record's note for an exception: "out of memory" (what the tables print as OOM), else its type and the
    start of its message on one line."""
    text = " ".join(str(exc).split())
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        return "out of memory"
    return f"{type(exc).__name__}: {text[:200]}"


def measure_pass(fn, point, pass_, dtype, scale, input_sets, settings, partner=None):
    """Compile, measure memory, check and (for timed points) time one pass. `partner`: (compiled, argument
    sets) of what this pass is paired with, or None. Returns (record fields, (compiled, argument sets) where the
    check passed, else None)."""
    jitted, make_args = pass_function(fn, pass_)
    arg_sets = [make_args(*x) for x in input_sets]
    compiled = jitted.lower(*arg_sets[0]).compile()
    analysis = compiled.memory_analysis()
    record = dict(
        temp_bytes=getattr(analysis, "temp_size_in_bytes", None),
        arg_bytes=getattr(analysis, "argument_size_in_bytes", None),
    )
    before = _memory_stats()
    jax.block_until_ready(compiled(*arg_sets[0]))
    after = _memory_stats()
    if before is not None and after["peak_bytes_in_use"] > before["peak_bytes_in_use"]:
        record["peak_bytes"] = after["peak_bytes_in_use"] - before["bytes_in_use"] + _nbytes(arg_sets[0])
    # Check on fresh inputs, against the reference.
    ref = _reference(point, dtype, scale, settings["cache_dir"])
    q, k, v, ct = random_inputs(point, _check_seed(point), dtype)
    rows, _, _ = _check_slices(point)
    if rows < point.seq_q:
        ct = ct.at[:, rows:].set(0)
    results = outputs(pass_, jax.block_until_ready(compiled(*make_args(q, k, v, ct))))
    del q, k, v, ct
    errors, tol = _check(point, pass_, dtype, results, ref)
    del results
    record.update(rel_err=max(errors.values()), tolerance=tol)
    if record["rel_err"] > tol:
        worst = ", ".join(f"{name} {e:.1e}" for name, e in errors.items())
        return dict(record, status="fail", note=f"relative error {worst} > {tol:.0e}"), None
    if not point.timed:
        return dict(record, status="ok"), (compiled, arg_sets)
    reps, min_sample_s = settings["reps"], settings["min_sample_ms"] / 1e3
    if partner is None:
        t = timing.median_ms(compiled, arg_sets, reps=reps, min_sample_s=min_sample_s)
        record.update(ms=t.ms, ms_min=t.ms_min, ms_max=t.ms_max, calls_per_sample=t.calls)
    else:
        p = timing.paired_ratio(compiled, arg_sets, *partner, reps=reps, min_sample_s=min_sample_s)
        record.update(
            ms=p.ours_ms, partner_ms=p.theirs_ms, ratio=p.ratio, interval=[p.low, p.high], calls_per_sample=p.calls
        )
    density = impls_lib.block_mask_of(point).density() if point.pattern else 1.0
    record["tflops"] = fwd_flops(point, density) * FLOP_FACTOR[pass_] / (record["ms"] * 1e-3) / 1e12
    return dict(record, status="ok"), (compiled, arg_sets)


def _partner_fields(point, record, baseline):
    """Turn a paired measurement's (partner_ms, ratio, interval) into the record's named ratio fields."""
    partner_ms, ratio, interval = (
        record.pop("partner_ms", None),
        record.pop("ratio", None),
        record.pop("interval", None),
    )
    if ratio is None:
        return record
    if point.pattern:  # paired with the same implementation under a full block mask: this ms / dense ms
        return dict(
            record,
            dense_ms=partner_ms,
            ratio_to_dense_same_impl=1.0 / ratio,
            dense_ratio_interval=[1.0 / interval[1], 1.0 / interval[0]],
        )
    return dict(record, baseline=baseline, baseline_ms=partner_ms, ratio_to_baseline=ratio, ratio_interval=interval)


# ---------------------------------------------------------------------------------------------- the worker


def run_group(spec: dict) -> None:
    """Measure `spec["points"]` (in order) with `spec["impls"]`, appending one JSON line per record to
    `spec["sink"]`. Runs in a worker process on the GPU, so the parent never holds device memory."""
    if spec["smoke"]:
        jax.config.update("jax_platforms", "cpu")
    env = dict(environment(), command=spec["command"], date=spec["date"], smoke=spec["smoke"])
    by_name = {impl.name: impl for impl in impls_lib.all_impls()}
    points = [Point(**dict(p, passes=tuple(p["passes"]))) for p in spec["points"]]
    settings = spec["settings"]
    on_gpu = on_nvidia_gpu()
    baseline = impls_lib.baseline_name()
    names = list(spec["impls"])
    if any(p.timed and not p.pattern for p in points) and baseline not in names:
        names.insert(0, baseline)  # every ratio's partner runs, chosen or not
    elif baseline in names:
        names.insert(0, names.pop(names.index(baseline)))

    with open(spec["sink"], "a") as sink:

        def emit(point, impl, pass_, *, dtype, status="ok", note="", **values):
            rec = dict(
                suite=point.suite,
                impl=impl.name,
                kind=impl.kind,
                point=point.key(),
                batch=point.batch,
                seq_q=point.seq_q,
                seq_k=point.seq_k,
                heads=point.heads,
                kv_heads=point.kv_heads,
                head_dim=point.head_dim,
                causal=point.causal,
                dtype=jnp.dtype(dtype).name,
                requested_dtype=point.dtype,
                ms=None,
                tflops=None,
                baseline=None,
                baseline_ms=None,
                ratio_to_baseline=None,
                ratio_interval=None,
                temp_bytes=None,
                peak_bytes=None,
                rel_err=None,
                status=status,
                note=note,
                **env,
            )
            if point.pattern:
                rec.update(
                    pattern=point.pattern,
                    density=impls_lib.block_mask_of(point).density(),
                    dense_point=point.dense_key(),
                    ratio_to_dense_same_impl=None,
                    dense_ratio_interval=None,
                )
            rec["pass"] = pass_
            rec.update(values)
            if status == "skip" and note == "out of memory" and point.suite == "memory":
                out_of_memory.add((impl.name, pass_))  # larger sizes of this pass will not fit either
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            print(report.progress_line(rec), flush=True)

        out_of_memory, dense = set(), {}
        for point in points:
            if point.pattern == "full":
                dense = {}  # the previous shape's full-mask partners
            partners = {}  # pass -> the baseline's (compiled, argument sets) at this point
            input_sets = {}
            for name in names:
                impl = by_name[name]
                skips = {}
                for pass_ in point.passes:
                    if time.time() > spec["deadline"]:
                        skips[pass_] = "time budget spent"
                    elif (impl.name, pass_) in out_of_memory:
                        skips[pass_] = "out of memory at a smaller size"
                    elif impl.slow_on_cpu and not on_gpu and (point.suite, pass_) != ("seed", "fwd"):
                        skips[pass_] = "Pallas interpret mode is slow on CPU; only the seed suite's fwd runs it"
                for pass_, note in skips.items():
                    emit(point, impl, pass_, status="skip", note=note, dtype=point.dtype)
                passes = [x for x in point.passes if x not in skips]
                if not passes:
                    continue
                dtype = DTYPES[point.dtype]
                try:
                    if point.pattern and impl.kind != "ours":
                        raise impls_lib.Unsupported("takes no block mask")
                    dtype = impl.dtype_of(dataclasses.replace(point, dtype=dtype))
                    fn = impl.build(point)
                except (impls_lib.Unsupported, ImportError) as e:
                    for pass_ in passes:
                        emit(point, impl, pass_, status="skip", note=str(e), dtype=dtype)
                    continue
                key = jnp.dtype(dtype).name
                if key not in input_sets:
                    input_sets[key] = [random_inputs(point, seed, dtype) for seed in range(settings["rotate"])]
                for pass_ in passes:
                    if point.pattern:  # block-sparse: paired with the same implementation under a full mask
                        partner = dense.get((name, point.dense_key(), pass_))
                    else:  # paired with the baseline, which itself is timed alone
                        partner = partners.get(pass_) if name != baseline else None
                    try:
                        record, kept = measure_pass(
                            fn, point, pass_, dtype, impl.scale_of(point), input_sets[key], settings, partner
                        )
                    except Exception as e:  # noqa: BLE001 - anything an implementation raises skips that point
                        emit(point, impl, pass_, status="skip", note=error_note(e), dtype=dtype)
                        continue
                    emit(point, impl, pass_, dtype=dtype, **_partner_fields(point, record, baseline))
                    if kept is not None and point.timed:
                        if name == baseline and not point.pattern:
                            partners[pass_] = kept
                        if point.pattern == "full":
                            dense[(name, point.key(), pass_)] = kept


def _groups(points, names, isolate):
    """Work units: one process per suite on the GPU (every implementation of a point in one process, so ratios
    can be paired), and per implementation and pass for the memory suite (the device's high-water mark then
    rises point by point); points in ascending size."""
    groups = []
    for suite in SUITES:
        ps = sorted((p for p in points if p.suite == suite), key=Point.size)
        if not ps:
            continue
        if isolate and suite == "memory":
            for name in names[suite]:
                for pass_ in PASSES:
                    one = [dataclasses.replace(p, passes=(pass_,)) for p in ps if pass_ in p.passes]
                    if one:
                        groups.append((suite, one, [name]))
        else:
            groups.append((suite, ps, names[suite]))
    return groups


def run(points, impl_names, *, isolate, settings, command, date, smoke, time_budget, workdir) -> list[dict]:
    """Measure the points (in worker processes where `isolate`); returns every record."""
    sink = os.path.join(workdir, "records.jsonl")
    start = time.time()
    groups = _groups(points, impl_names, isolate)
    for i, (suite, group_points, names) in enumerate(groups):
        left = max(0.0, start + time_budget - time.time()) if time_budget else 1e9
        spec = dict(
            points=[dataclasses.asdict(p) for p in group_points],
            impls=names,
            sink=sink,
            settings=settings,
            command=command[suite],
            date=date,
            smoke=smoke,
            deadline=time.time() + left / (len(groups) - i),
        )
        if isolate:
            path = os.path.join(workdir, f"spec-{i}-{suite}.json")
            with open(path, "w") as f:
                json.dump(spec, f)
            rc = subprocess.call([sys.executable, "-m", "benchmarks", "worker", path])
            if rc:
                print(
                    f"worker for {names} on {suite} exited with status {rc}; its remaining points have no record",
                    flush=True,
                )
        else:
            run_group(spec)
    if not os.path.exists(sink):
        return []
    with open(sink) as f:
        return [json.loads(line) for line in f if line.strip()]
