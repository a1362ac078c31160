"""Attention benchmarks: ours side by side with cuDNN, XLA dense and JAX's own Pallas examples.

    python -m benchmarks.attention --suite seed|sweep|memory|backends|sparse|all[,...] [--impls a,b] [--seqs 512,1024]
        [--head-dims 64,128] [--passes fwd,bwd,fwdbwd] [--out DIR] [--time-budget SECONDS]
    python -m benchmarks.attention --smoke            # every suite at tiny sizes on CPU; no timing claims
    python -m benchmarks.attention --render DIR [DIR ...] --out DIR   # merge results, redraw tables and plots

Writes `results.json` (one record per point, implementation and pass), `results.md` and one PNG per suite
to `runs/benchmarks/<date>-<device>/` (ignored by git; or `--out`), and prints the Markdown last. Published
tables are copied from there into their curated folder under `benchmarks/results/`.

Method, for every implementation, point and pass:
  1. compile the jitted function; its memory analysis gives `temp_bytes` (XLA's scratch, which holds
     cuDNN's workspace and a dense attention's N x N logits);
  2. run it once and read the device's high-water mark (`memory_stats()["peak_bytes_in_use"]`). JAX cannot
     reset that mark, so `peak_bytes` (this call's inputs plus what it allocated) is recorded only when the
     mark rose during the call, and left null otherwise; for the same reason each implementation runs in
     its own process on the GPU, with its points in ascending size;
  3. check it on fresh random inputs against the float32 dense reference (`pallas_flash.attention_reference`,
     run on the host so it cannot disturb device memory): output for fwd, dq/dk/dv for bwd and fwdbwd, on
     the first batch element and the query heads of the first key head, with the per-dtype tolerances of
     tests/tolerances.py. Above `CHECK_ROWS` queries only the first rows are checked (the cotangent is zero
     beyond them, so dk and dv are still exact). A wrong implementation gets no number, only FAIL;
  4. time it: warm-up, then `--reps` samples of back-to-back calls rotating over `--rotate` input sets
     (so no set stays in L2), each sample at least `--min-sample-ms` of host clock ending in
     `block_until_ready`; the median sample is `ms`.
Passes: fwd = the attention; bwd = the VJP alone, on residuals saved by a forward run beforehand; fwdbwd =
`jax.value_and_grad` of sum(out * cotangent) with respect to q, k, v. FLOPs: 4*B*H*Nq*Nk*D for fwd (halved
when causal), 2.5x that for bwd and 3.5x for fwdbwd. `ratio_to_cudnn` = cuDNN's ms / this ms at the same
point and pass (above 1 is faster than cuDNN).
Block-sparse points (the `sparse` suite) carry a block-mask `pattern` and the mask's `density`; their FLOPs
count the computed blocks only (times the density), the reference applies the same mask, and
`ratio_to_dense_same_impl` = this ms / the ms of the same implementation, pass and shape with a full block
mask (below 1 is faster than dense; issue 8 asks at most 0.35 at density 0.25).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from benchmarks import impls as impls_lib
from benchmarks import report
from tests import tolerances

PASSES = ("fwd", "bwd", "fwdbwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
CHECK_ROWS = 8192  # above this many queries, check the first CHECK_ROWS // 2 rows only (host memory, time)
DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
SUITES = ("seed", "sweep", "memory", "backends", "sparse")
# The sparse suite's masks: the dense baseline, then two patterns at three densities each.
SPARSE_PATTERNS = (("full", 1.0),) + tuple((p, d) for p in ("local", "strided") for d in (0.5, 0.25, 0.125))
SPARSE_TOKENS = 32768  # batch * seq of each sparse point
# The paper's figure 3 keeps the work per point comparable: batch * seq = 16k tokens, heads * head_dim = 2048.
SWEEP_TOKENS, SWEEP_WIDTH = 16384, 2048


@dataclasses.dataclass(frozen=True)
class Point:
    """One problem: [batch, seq_q, heads, head_dim] queries against [batch, seq_k, kv_heads, head_dim] keys."""

    suite: str
    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: str
    passes: tuple = PASSES
    timed: bool = True  # the memory suite compiles, checks and measures bytes, but does not time
    pattern: str | None = None  # block-sparse points: the BlockMask pattern (benchmarks/impls.block_mask_of)
    density: float | None = None  # ... and its target density

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def key(self) -> str:
        sparse = f"-{self.pattern}{self.density:g}" if self.pattern else ""
        return (f"{self.suite}/b{self.batch}-q{self.seq_q}-k{self.seq_k}-h{self.heads}-kvh{self.kv_heads}"
                f"-d{self.head_dim}-c{int(self.causal)}-{self.dtype}{sparse}")

    def dense_key(self) -> str:
        """The key of this point with a full block mask: the baseline of `ratio_to_dense_same_impl`."""
        return dataclasses.replace(self, pattern="full", density=1.0).key()

    def size(self) -> int:
        return self.batch * self.heads * self.seq_q * self.seq_k * self.head_dim


def fwd_flops(point: Point) -> float:
    flops = 4.0 * point.batch * point.heads * point.seq_q * point.seq_k * point.head_dim / (2 if point.causal else 1)
    return flops * (impls_lib.block_mask_of(point).density() if point.pattern else 1.0)


# ---------------------------------------------------------------------------------------------------- suites

def suite_points(name: str, *, smoke: bool, seqs=None, head_dims=None, passes=None) -> list[Point]:
    def square(suite, batch, seq, heads, head_dim, causal, dtype, **kw):
        return Point(suite, batch, seq, seq, heads, heads, head_dim, causal, dtype, **kw)

    if name == "seed":
        points = [square("seed", *((1, 64, 2, 32) if smoke else (32, 512, 16, 64)), True, "float16")]
    elif name == "backends":
        shapes = [(1, 64, 2, 32, "float16")] if smoke else [(32, 512, 16, 64, "float16"),
                                                            (2, 8192, 16, 128, "bfloat16")]
        points = [square("backends", b, n, h, d, True, dt, passes=("fwd", "fwdbwd")) for b, n, h, d, dt in shapes]
    elif name == "sweep":
        seqs = seqs or ([128] if smoke else [512, 1024, 2048, 4096, 8192, 16384])
        head_dims = head_dims or ([32] if smoke else [64, 128])
        tokens, width = (128, 64) if smoke else (SWEEP_TOKENS, SWEEP_WIDTH)
        causals = (True,) if smoke else (False, True)
        points = [square("sweep", max(1, tokens // n), n, width // d, d, causal, "bfloat16")
                  for d in head_dims for causal in causals for n in seqs]
    elif name == "memory":
        # Fixed batch and heads, so bytes grow with seq alone: linearly for flash, quadratically for dense.
        seqs = seqs or ([64, 128] if smoke else [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536])
        head_dims = head_dims or ([32] if smoke else [64])
        batch, heads = (1, 2) if smoke else (8, 16)
        points = [square("memory", batch, n, heads, d, True, "float16", passes=("fwd", "fwdbwd"), timed=False)
                  for d in head_dims for n in seqs]
    elif name == "sparse":
        # Issue 8's bar: block-sparse time falls with density. B * N fixed, H = 16, D = 128, not causal.
        seqs = seqs or ([128] if smoke else [8192, 16384])
        head_dims = head_dims or ([32] if smoke else [128])
        tokens, heads = (128, 2) if smoke else (SPARSE_TOKENS, 16)
        points = [square("sparse", max(1, tokens // n), n, heads, d, False, "bfloat16", passes=("fwd", "fwdbwd"),
                         pattern=pattern, density=density)
                  for d in head_dims for n in seqs for pattern, density in SPARSE_PATTERNS]
    else:
        raise ValueError(f"unknown suite {name!r}; choose from {SUITES} or 'all'")
    if passes:
        points = [dataclasses.replace(p, passes=tuple(x for x in p.passes if x in passes)) for p in points]
    return [p for p in points if p.passes]


def default_impls(suite: str, names: list[str]) -> list[str]:
    if suite == "backends":  # the SDPA-style comparison is among our implementations, with cuDNN as the bar
        return [n for n in names if n.startswith("pf:") or n == "cudnn"]
    if suite == "sparse":  # only ours take a block mask; dense "xla" would hold B*H*N^2 float32 logits
        return [n for n in names if n in ("pf:pallas", "pf:xla_chunked")]
    return names


# ---------------------------------------------------------------------------------------------- measurement

def environment() -> dict:
    """Device, software versions and CUDA/cuDNN versions (where this JAX exposes them)."""
    device = jax.devices()[0]
    env = dict(device=device.device_kind, platform=device.platform, jax_version=jax.__version__,
               jaxlib_version=getattr(jax.lib, "__version__", None) or _jaxlib_version(),
               python=platform.python_version(), cuda_version=None, cudnn_version=None)
    try:  # the only place that reads a private module: JAX has no public accessor for these versions
        from jax._src.lib import cuda_versions

        if cuda_versions is not None and device.platform == "gpu":
            env["cuda_version"] = cuda_versions.cuda_runtime_get_version()
            env["cudnn_version"] = cuda_versions.cudnn_get_version()
    except (ImportError, AttributeError, RuntimeError):
        pass
    try:
        env["platform_version"] = device.client.platform_version
    except AttributeError:
        pass
    return env


def _jaxlib_version():
    import jaxlib

    return getattr(jaxlib, "__version__", None)


def _random_inputs(point, dtype, seed):
    """q, k, v and a cotangent, standard normal (never zeros: they hide unwritten outputs). Threefry gives
    the same numbers on every backend, so each process draws the same check inputs and the cached
    reference stays valid."""
    shapes = [(point.batch, point.seq_q, point.heads, point.head_dim),
              (point.batch, point.seq_k, point.kv_heads, point.head_dim),
              (point.batch, point.seq_k, point.kv_heads, point.head_dim),
              (point.batch, point.seq_q, point.heads, point.head_dim)]
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(key, s, jnp.float32).astype(dtype) for key, s in zip(keys, shapes)]


def _check_slices(point):
    """The part of each tensor the check compares: batch 0, the query heads of key head 0, and the first
    `rows` queries."""
    group = point.heads // point.kv_heads
    rows = point.seq_q if point.seq_q <= CHECK_ROWS else CHECK_ROWS // 2
    return rows, (slice(0, 1), slice(0, rows), slice(0, group)), (slice(0, 1), slice(None), slice(0, 1))


def _reference(point, dtype, scale, cache_dir):
    """Reference output and gradients on the check slice, on the host in float32, cached on disk so every
    implementation's process reuses them."""
    name = hashlib.sha1(f"{point.key()}|{jnp.dtype(dtype).name}|{scale!r}|{CHECK_ROWS}".encode()).hexdigest()
    path = os.path.join(cache_dir, name + ".npz")
    if os.path.exists(path):
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    q, k, v, ct = _random_inputs(point, dtype, _check_seed(point))
    rows, qs, ks = _check_slices(point)
    cpu = jax.devices("cpu")[0]
    q, ct = (jax.device_put(x[qs].astype(jnp.float32), cpu) for x in (q, ct))
    k, v = (jax.device_put(x[ks].astype(jnp.float32), cpu) for x in (k, v))
    # Top-left causal alignment makes the first `rows` queries an exact sub-problem against all keys (and
    # the first rows of a block mask).
    block_mask = impls_lib.block_mask_of(point, q_len=rows) if point.pattern else None
    ref = jax.jit(lambda q, k, v: pf.attention_reference(q, k, v, scale=scale, is_causal=point.causal,
                                                         block_mask=block_mask)[0])
    out, vjp = jax.vjp(ref, q, k, v)
    dq, dk, dv = vjp(ct)
    result = {name: np.asarray(x) for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}
    np.savez(path, **result)
    return result


def _check_seed(point):
    return int(hashlib.sha1(point.key().encode()).hexdigest()[:7], 16)  # < 2**28: a valid int32 seed


def _relative_error(ours, ref):
    ours = np.asarray(ours, np.float64)
    if not np.all(np.isfinite(ours)):
        return float("inf")
    return tolerances.relative_error(ours, ref)


def _check(point, pass_, dtype, results, ref):
    """Relative errors of this pass's results against the reference, and whether they pass."""
    _, qs, ks = _check_slices(point)
    dt = jnp.dtype(dtype).type
    if pass_ == "fwd":
        errors = {"out": _relative_error(results[qs], ref["out"])}
        tol = tolerances.OUTPUT[dt]
    else:
        dq, dk, dv = results
        errors = {"dq": _relative_error(dq[qs], ref["dq"]), "dk": _relative_error(dk[ks], ref["dk"]),
                  "dv": _relative_error(dv[ks], ref["dv"])}
        tol = tolerances.GRADIENT[dt]
    worst = max(errors.values())
    return worst, worst <= tol, errors, tol


def _pass_function(fn, pass_):
    """The jitted function of one pass, and how to turn (q, k, v, ct) into its arguments."""
    if pass_ == "fwd":
        return jax.jit(fn), lambda q, k, v, ct: (q, k, v)
    if pass_ == "fwdbwd":
        def loss(q, k, v, ct):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        return grad, lambda q, k, v, ct: (q, k, v, ct)
    # bwd: the VJP alone. jax.vjp's function is a pytree holding the forward's residuals, so it can be an
    # argument of a jitted function; the residuals come from one forward run per input set, untimed.
    forward = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v))
    return jax.jit(lambda vjp, ct: vjp(ct)), lambda q, k, v, ct: (forward(q, k, v)[1], ct)


def _unpack(pass_, result):
    return result[1] if pass_ == "fwdbwd" else result


def median_ms(compiled, arg_sets, *, reps, min_sample_s):
    """Median over `reps` samples of the per-call time of back-to-back calls rotating over `arg_sets`."""
    for args in arg_sets:
        jax.block_until_ready(compiled(*args))
    # Calls per sample from the fastest of three single calls: one slow call (a host hiccup) used to leave
    # whole points timed one call per sample, host launch overhead included (2026-11-23, sweep_bar).
    probes = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*arg_sets[0]))
        probes.append(time.perf_counter() - start)
    calls = max(1, math.ceil(min_sample_s / max(min(probes), 1e-7)))
    samples = [_sample_ms(compiled, arg_sets, calls, r) for r in range(reps)]
    return statistics.median(samples), min(samples), max(samples), calls


def _sample_ms(compiled, arg_sets, calls, r):
    """Sample r: ms per call of `calls` back-to-back calls rotating over `arg_sets`."""
    start = time.perf_counter()
    for i in range(calls):
        out = compiled(*arg_sets[(r * calls + i) % len(arg_sets)])
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def paired_ratio(ours, theirs, arg_sets, *, reps, min_sample_s):
    """Per-pair time ratios theirs / ours from interleaved samples (ours, theirs, theirs, ours, ...), each
    sample back-to-back calls rotating over `arg_sets` as in `median_ms`: adjacent samples see the same
    clocks and temperature, so slow drift cancels in each ratio. Returns (median ratio, (low, high): a
    distribution-free ~95% interval for the median, ours' median ms, theirs' median ms, calls per sample)."""
    calls = max(median_ms(fn, arg_sets, reps=1, min_sample_s=min_sample_s)[3] for fn in (ours, theirs))
    ratios, ours_ms, theirs_ms = [], [], []
    for r in range(reps):
        if r % 2 == 0:
            ours_ms.append(_sample_ms(ours, arg_sets, calls, r))
            theirs_ms.append(_sample_ms(theirs, arg_sets, calls, r))
        else:
            theirs_ms.append(_sample_ms(theirs, arg_sets, calls, r))
            ours_ms.append(_sample_ms(ours, arg_sets, calls, r))
        ratios.append(theirs_ms[-1] / ours_ms[-1])
    ratios.sort()
    # Order statistics k and n-1-k bound the median with >= ~95% confidence (binomial, normal approximation).
    k = max(0, math.floor((reps - 1.96 * math.sqrt(reps)) / 2))
    return (statistics.median(ratios), (ratios[k], ratios[reps - 1 - k]), statistics.median(ours_ms),
            statistics.median(theirs_ms), calls)


def _memory_stats():
    try:
        stats = jax.devices()[0].memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    return stats if stats and "peak_bytes_in_use" in stats else None


def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype"))


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        return "out of memory"
    return f"{type(exc).__name__}: {text[:200]}"


def measure(impl, point, settings, emit):
    """Measure every pass of one implementation at one point; `emit` receives one record per pass."""
    dtype = DTYPES[point.dtype]
    try:
        if point.pattern and impl.kind != "ours":
            raise impls_lib.Unsupported("takes no block mask")
        dtype = impl.dtype_of(dataclasses.replace(point, dtype=dtype))
        fn = impl.build(point)
    except (impls_lib.Unsupported, ImportError) as e:
        for pass_ in point.passes:
            emit(point, impl, pass_, status="skip", note=str(e), dtype=dtype)
        return
    scale = impl.scale_of(point)
    for pass_ in point.passes:
        try:
            emit(point, impl, pass_, dtype=dtype, **_measure_pass(fn, point, pass_, dtype, scale, settings))
        except Exception as e:  # noqa: BLE001 - anything an implementation raises on a point skips that point
            emit(point, impl, pass_, status="skip", note=_short(e), dtype=dtype)


def _measure_pass(fn, point, pass_, dtype, scale, settings):
    jitted, make_args = _pass_function(fn, pass_)
    args = make_args(*_random_inputs(point, dtype, 0))
    compiled = jitted.lower(*args).compile()
    analysis = compiled.memory_analysis()
    record = dict(temp_bytes=getattr(analysis, "temp_size_in_bytes", None),
                  arg_bytes=getattr(analysis, "argument_size_in_bytes", None))
    # Peak: one call with one input set live, reading the high-water mark before and after.
    before = _memory_stats()
    jax.block_until_ready(compiled(*args))
    after = _memory_stats()
    if before is not None and after["peak_bytes_in_use"] > before["peak_bytes_in_use"]:
        record["peak_bytes"] = after["peak_bytes_in_use"] - before["bytes_in_use"] + _nbytes(args)
    del args
    # Check on fresh inputs, against the reference.
    ref = _reference(point, dtype, scale, settings["cache_dir"])
    q, k, v, ct = _random_inputs(point, dtype, _check_seed(point))
    rows, _, _ = _check_slices(point)
    if rows < point.seq_q:
        ct = ct.at[:, rows:].set(0)
    results = _unpack(pass_, jax.block_until_ready(compiled(*make_args(q, k, v, ct))))
    del q, k, v, ct
    err, ok, errors, tol = _check(point, pass_, dtype, results, ref)
    del results
    record.update(rel_err=err, tolerance=tol)
    if not ok:
        worst = ", ".join(f"{name} {e:.1e}" for name, e in errors.items())
        return dict(record, status="fail", note=f"relative error {worst} > {tol:.0e}")
    if not point.timed:
        return dict(record, status="ok")
    arg_sets = [make_args(*_random_inputs(point, dtype, seed)) for seed in range(settings["rotate"])]
    ms, ms_min, ms_max, calls = median_ms(compiled, arg_sets, reps=settings["reps"],
                                          min_sample_s=settings["min_sample_ms"] / 1e3)
    tflops = fwd_flops(point) * FLOP_FACTOR[pass_] / (ms * 1e-3) / 1e12
    return dict(record, status="ok", ms=ms, ms_min=ms_min, ms_max=ms_max, calls_per_sample=calls, tflops=tflops)


# ---------------------------------------------------------------------------------------------- the worker

def run_group(spec: dict) -> None:
    """Measure `spec["points"]` with `spec["impls"]`, appending one JSON line per record to `spec["sink"]`."""
    if spec["smoke"]:
        jax.config.update("jax_platforms", "cpu")
    env = dict(environment(), command=spec["command"], date=spec["date"], smoke=spec["smoke"])
    by_name = {impl.name: impl for impl in impls_lib.all_impls()}
    points = [Point(**dict(p, passes=tuple(p["passes"]))) for p in spec["points"]]
    settings = spec["settings"]
    on_gpu = impls_lib.on_nvidia_gpu()

    with open(spec["sink"], "a") as sink:
        def emit(point, impl, pass_, *, dtype, status="ok", note="", **values):
            rec = dict(suite=point.suite, impl=impl.name, kind=impl.kind, point=point.key(), batch=point.batch,
                       seq_q=point.seq_q, seq_k=point.seq_k, heads=point.heads, kv_heads=point.kv_heads,
                       head_dim=point.head_dim, causal=point.causal, dtype=jnp.dtype(dtype).name,
                       requested_dtype=point.dtype, ms=None, tflops=None, ratio_to_cudnn=None, temp_bytes=None,
                       peak_bytes=None, rel_err=None, status=status, note=note, **env)
            if point.pattern:
                rec.update(pattern=point.pattern, density=impls_lib.block_mask_of(point).density(),
                           dense_point=point.dense_key(), ratio_to_dense_same_impl=None)
            rec["pass"] = pass_
            rec.update(values)
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            print(report.progress_line(rec), flush=True)

        def emit_and_watch(point, impl, pass_, **kw):
            if kw.get("note") == "out of memory" and point.suite == "memory":
                out_of_memory.add((impl.name, pass_))  # larger sizes of this pass will not fit either
            emit(point, impl, pass_, **kw)

        out_of_memory = set()
        for point in points:
            for name in spec["impls"]:
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
                passes = tuple(x for x in point.passes if x not in skips)
                if passes:
                    measure(impl, dataclasses.replace(point, passes=passes), settings, emit_and_watch)


def _groups(points, names, isolate):
    """Work units: on the GPU one process per implementation and suite (per pass too where memory is the
    point), each in ascending size, so the device's high-water mark rises point by point."""
    if not isolate:
        return [(sorted(points, key=lambda p: (SUITES.index(p.suite), p.size())), names)]
    groups = []
    for suite in SUITES:
        suite_points_ = sorted((p for p in points if p.suite == suite), key=Point.size)
        if not suite_points_:
            continue
        for name in names[suite]:
            if suite in ("seed", "memory", "backends"):
                for pass_ in PASSES:
                    ps = [dataclasses.replace(p, passes=(pass_,)) for p in suite_points_ if pass_ in p.passes]
                    if ps:
                        groups.append((ps, {suite: [name]}))
            else:
                groups.append((suite_points_, {suite: [name]}))
    return groups


def _run_groups(points, impl_names, *, isolate, settings, command, date, smoke, time_budget, workdir):
    sink = os.path.join(workdir, "records.jsonl")
    start = time.time()
    groups = _groups(points, impl_names, isolate)
    for i, (group_points, names) in enumerate(groups):
        left = max(0.0, start + time_budget - time.time()) if time_budget else 1e9
        for suite, suite_names in names.items():
            ps = [p for p in group_points if p.suite == suite]
            if not ps:
                continue
            spec = dict(points=[dataclasses.asdict(p) for p in ps], impls=suite_names, sink=sink,
                        settings=settings, command=command, date=date, smoke=smoke,
                        deadline=time.time() + left / (len(groups) - i))
            if isolate:
                path = os.path.join(workdir, f"spec-{i}-{suite}.json")
                with open(path, "w") as f:
                    json.dump(spec, f)
                rc = subprocess.call([sys.executable, "-m", "benchmarks.attention", "--worker", path])
                if rc:
                    print(f"worker for {suite_names} on {suite} exited with status {rc}; its remaining points "
                          "have no record", flush=True)
            else:
                run_group(spec)
    with open(sink) as f:
        return [json.loads(line) for line in f if line.strip()]


def attach_ratios(records):
    """ratio_to_cudnn = cuDNN's ms / this ms at the same point and pass; for block-sparse points,
    ratio_to_dense_same_impl = this ms / the same implementation's ms with a full block mask."""
    cudnn = {(r["point"], r["pass"]): r["ms"] for r in records if r["impl"] == "cudnn" and r.get("ms")}
    by_point = {(r["point"], r["impl"], r["pass"]): r["ms"] for r in records if r.get("ms")}
    for r in records:
        base = cudnn.get((r["point"], r["pass"]))
        r["ratio_to_cudnn"] = base / r["ms"] if base and r.get("ms") else None
        if "dense_point" in r:
            dense = by_point.get((r["dense_point"], r["impl"], r["pass"]))
            r["ratio_to_dense_same_impl"] = r["ms"] / dense if dense and r.get("ms") else None
    return records


# ---------------------------------------------------------------------------------------------- the CLI

def _csv(text, cast=str):
    return [cast(x) for x in text.split(",") if x] if text else None


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="seed", help=f"comma list of {', '.join(SUITES)}, or all")
    parser.add_argument("--impls", help="comma list of implementations (default: every one that exists)")
    parser.add_argument("--seqs", help="sequence lengths for sweep and memory, e.g. 512,1024")
    parser.add_argument("--head-dims", help="head dims for sweep and memory, e.g. 64,128")
    parser.add_argument("--passes", help="comma list of fwd, bwd, fwdbwd")
    parser.add_argument("--out", help="output folder (default runs/benchmarks/<date>-<device>, ignored by git)")
    parser.add_argument("--reps", type=int, help="timed samples per measurement (default 15; 1 in --smoke)")
    parser.add_argument("--min-sample-ms", type=float, default=10.0, help="host-clock length of one sample")
    parser.add_argument("--rotate", type=int, default=3, help="input sets to rotate over while timing")
    parser.add_argument("--time-budget", type=float, help="seconds; points not started in time are skipped")
    parser.add_argument("--smoke", action="store_true", help="every suite at tiny sizes on CPU; no timing claims")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="one process per implementation and suite (default: yes, except in --smoke)")
    parser.add_argument("--render", nargs="+", metavar="DIR", help="merge these folders' results.json into --out")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            run_group(json.load(f))
        return None
    if args.render:
        if not args.out:
            raise SystemExit("--render needs --out")
        records = []
        for folder in args.render:
            with open(os.path.join(folder, "results.json")) as f:
                records += json.load(f)
        return _write(attach_ratios(records), args.out)
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    # The command that regenerates the numbers; where they were written does not matter to that.
    kept = [a for i, a in enumerate(argv) if a != "--out" and (i == 0 or argv[i - 1] != "--out")
            and not a.startswith("--out=")]
    command = "python -m benchmarks.attention " + " ".join(shlex.quote(a) for a in kept)
    suites = list(SUITES) if args.suite == "all" else _csv(args.suite)
    for s in suites:
        if s not in SUITES:
            raise SystemExit(f"unknown suite {s!r}; choose from {', '.join(SUITES)} or all")
    passes = _csv(args.passes)
    if passes and set(passes) - set(PASSES):
        raise SystemExit(f"unknown pass in {args.passes!r}; choose from {', '.join(PASSES)}")
    known = [impl.name for impl in impls_lib.all_impls()]
    chosen = _csv(args.impls)
    if chosen and set(chosen) - set(known):
        raise SystemExit(f"unknown implementation(s) {sorted(set(chosen) - set(known))}; known: {', '.join(known)}")
    if not impls_lib.tokamax_available():
        print("note: tokamax is not importable here; its implementations are skipped", flush=True)
    points, impl_names = [], {}
    for s in suites:
        points += suite_points(s, smoke=args.smoke, seqs=_csv(args.seqs, int), head_dims=_csv(args.head_dims, int),
                               passes=passes)
        impl_names[s] = [n for n in (chosen or default_impls(s, known))]
    # This process must not start a GPU client before the workers run: it would hold most of the memory.
    isolate = not args.smoke if args.isolate is None else args.isolate
    settings = dict(reps=args.reps or (1 if args.smoke else 15), min_sample_ms=0.0 if args.smoke else args.min_sample_ms,
                    rotate=1 if args.smoke else args.rotate)
    date = datetime.date.today().isoformat()
    with tempfile.TemporaryDirectory(prefix="pallas_flash_bench_") as workdir:
        settings["cache_dir"] = workdir
        records = _run_groups(points, impl_names, isolate=isolate, settings=settings, command=command, date=date,
                              smoke=args.smoke, time_budget=args.time_budget, workdir=workdir)
    if not records:
        raise SystemExit("no records: nothing was measured")
    return _write(attach_ratios(records), args.out or default_out(date, records[0]["device"]))


def default_out(date: str, device: str) -> str:
    """Where a run writes without --out: under the git-ignored runs/, never into the source tree."""
    return os.path.join("runs", "benchmarks", f"{date}-{report.slug(device)}")


def _write(records, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(records, f, indent=1)
    markdown = report.markdown(records)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown)
    pngs = report.plots(records, out)
    print("\n" + markdown)
    print(f"wrote {os.path.join(out, 'results.json')}, results.md and {', '.join(os.path.basename(p) for p in pngs)}")
    return out


if __name__ == "__main__":
    main()
