"""The ring suite: context parallelism (`pallas_flash.parallel`) on every local device against one device.

Points: causal self-attention, batch 1, bf16, D=128, H=16 (and a GQA row, 16 query heads on 4 key heads), with
`--seqs-per-gpu` tokens on each of the n local devices (default 8k, 16k, 32k), so the whole sequence is n times
that. Each point and pass (fwd; fwdbwd: the output and its VJP of a cotangent) has one row per variant:
  single           `flash_attention(is_causal=True)` on the whole sequence on device 0 (the dispatcher's choice);
  ring_zigzag      `context_parallel_attention(strategy="ring", layout="zigzag")` over a mesh of the n devices;
  ring_contiguous  the same ring with the contiguous layout (device r waits while later shards pass by);
  all_gather       `strategy="all_gather"`, zig-zag layout (K/V gathered once, one call per device);
  cudnn            `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)` on the whole sequence on
                   device 0 (the one-GPU peer of `single`).
The sharded inputs are made already sharded (`jax.device_put` with a `NamedSharding` of the sequence axis over
the mesh); the zig-zag rows get the same tokens permuted into zig-zag order (`parallel.to_zigzag`), as a model
permutes its tokens once. Every row is checked before it is timed: its output (fwd) or dq, dk, dv (fwdbwd)
against the single-device call's on the same inputs (relative error, tolerances of tests/tolerances.py).
Timing (`benchmarks.timing`): every sharded row and cuDNN in interleaved pairs with `single`; `speedup` = single
ms / this ms with its ~95% interval, and `efficiency` = speedup / n (targets: >= 0.85 fwd and >= 0.90 fwd+bwd at
>= 32k tokens per device). The zig-zag ring is also paired with the contiguous ring: `ratio_to_contiguous` =
contiguous ms / zig-zag ms (target >= 1.4). A variant that runs out of device memory is an OOM row.
With `--smoke` (CPU): two of the CPU devices, float32, tiny shapes, `xla_chunked`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_flash as pf
from benchmarks import report, timing
from benchmarks.inputs import DTYPES, FLOP_FACTOR, Point, compile_pass, fwd_flops, outputs, random_inputs
from benchmarks.suites import error_note
from pallas_flash import parallel
from pallas_flash.device import on_nvidia_gpu
from tests import tolerances

AXIS = "context"
SEQS_PER_GPU = (8192, 16384, 32768)
SMOKE_SEQ_PER_GPU = 64
EFFICIENCY_TARGETS = {"fwd": 0.85, "fwdbwd": 0.90}  # single ms / (n x sharded ms), at TARGET_MIN_SEQ tokens per GPU
TARGET_MIN_SEQ = 32768
ZIGZAG_TARGET = 1.4  # contiguous ring ms / zig-zag ring ms: the causal work the zig-zag layout balances
ROTATE = 3  # input sets each function rotates over while timed (so none stays in L2)
PASSES = ("fwd", "fwdbwd")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A run's shapes: (query heads, key heads) rows, head_dim, dtype; `devices`: the mesh's size (None: every
    local device); `implementation`: flash_attention's, for the single call and every shard (None: dispatch)."""

    heads: tuple = ((16, 16), (16, 4))
    head_dim: int = 128
    dtype: str = "bfloat16"
    devices: int | None = None
    implementation: str | None = None


SMOKE = Sizes(heads=((2, 1),), head_dim=32, dtype="float32", devices=2, implementation="xla_chunked")


class Variant(NamedTuple):
    """A sharded row: its name, the layout of its inputs and the strategy."""

    name: str
    layout: str
    strategy: str


SHARDED = (
    Variant("ring_zigzag", "zigzag", "ring"),
    Variant("ring_contiguous", "contiguous", "ring"),
    Variant("all_gather", "zigzag", "all_gather"),
)
VARIANTS = ("single", *(v.name for v in SHARDED), "cudnn")


class Built(NamedTuple):
    """A compiled pass ready to time: the function, its argument sets, and its checked relative error."""

    fn: Callable
    args: list
    rel_err: float


@jax.jit
def _relative_error(ours, ref):
    """tests/tolerances.relative_error on the device, in float32: ||ours - ref|| / max(||ref||, 1e-2 sqrt(size))."""
    ours, ref = ours.astype(jnp.float32), ref.astype(jnp.float32)
    floor = 1e-2 * jnp.sqrt(jnp.float32(ref.size))
    error = jnp.linalg.norm(ours - ref) / jnp.maximum(jnp.linalg.norm(ref), floor)
    return jnp.where(jnp.all(jnp.isfinite(ours)), error, jnp.inf)


def relative_error(ours, ref, device) -> float:
    """The largest relative error over the leaves of `ours` against `ref` (pytrees of arrays), on `device`."""
    leaves = zip(jax.tree.leaves(ours), jax.tree.leaves(ref))
    return max(float(_relative_error(jax.device_put(a, device), jax.device_put(b, device))) for a, b in leaves)


def whole(implementation):
    """(q, k, v) -> out: one device on the whole sequence."""
    return lambda q, k, v: pf.flash_attention(q, k, v, is_causal=True, implementation=implementation)


def sharded(mesh, variant: Variant, implementation):
    """(q, k, v) -> out: the sequence split over `mesh`'s devices along AXIS."""
    return lambda q, k, v: parallel.context_parallel_attention(
        q,
        k,
        v,
        mesh=mesh,
        axis=AXIS,
        is_causal=True,
        layout=variant.layout,
        strategy=variant.strategy,
        implementation=implementation,
    )


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def build(fn, pass_, input_sets, expected, device, tolerance) -> Built:
    """`fn`'s pass compiled for these (already placed) input sets and checked on the first against `expected`
    (its outputs, `benchmarks.inputs.outputs`; None: unchecked); a ValueError above the tolerance."""
    compiled, args = compile_pass(fn, pass_, input_sets)
    if expected is None:
        return Built(compiled, args, None)
    error = relative_error(outputs(pass_, compiled(*args[0])), expected, device)
    if not error <= tolerance:
        raise ValueError(f"relative error {error:.1e} > {tolerance:.0e} against the single-device call")
    return Built(compiled, args, error)


def record(stamp, *, point, devices, seq_per_gpu, variant, pass_, status="ok", note="", **fields) -> dict:
    """One row of results.json, with the run's `stamp`."""
    rec = dict(
        suite="ring",
        variant=variant,
        layout=None,
        strategy=None,
        point=point.key(),
        devices=devices,
        seq_per_gpu=seq_per_gpu,
        batch=point.batch,
        seq_q=point.seq_q,
        seq_k=point.seq_k,
        heads=point.heads,
        kv_heads=point.kv_heads,
        head_dim=point.head_dim,
        causal=point.causal,
        dtype=point.dtype,
        ms=None,
        tflops=None,
        single_ms=None,
        speedup=None,
        speedup_interval=None,
        efficiency=None,
        efficiency_interval=None,
        target=None,
        ratio_to_contiguous=None,
        contiguous_interval=None,
        contiguous_target=None,
        rel_err=None,
        tolerance=None,
        status=status,
        note=note,
        **stamp,
    )
    rec["pass"] = pass_
    rec.update(fields)
    return rec


def _failure(error: BaseException) -> dict:
    note = error_note(error)
    if note == "out of memory":
        return dict(status="oom", note=note)
    return dict(status="fail" if isinstance(error, ValueError) and "relative error" in note else "skip", note=note)


def measure_point(point, mesh, pass_, sizes, settings, emit) -> None:
    """Every variant at one point and pass; `emit(variant, **fields)` receives each row."""
    n = mesh.devices.size
    device = mesh.devices.flat[0]
    tolerance = (tolerances.OUTPUT if pass_ == "fwd" else tolerances.GRADIENT)[jnp.dtype(DTYPES[point.dtype]).type]
    flops = fwd_flops(point) * FLOP_FACTOR[pass_]
    reps, min_sample_s = settings["reps"], settings["min_sample_ms"] / 1e3
    on_one = [[jax.device_put(x, device) for x in random_inputs(point, seed)] for seed in range(settings["rotate"])]
    spread = NamedSharding(mesh, P(None, AXIS))
    zigzag = parallel.zigzag_order(point.seq_q, n)
    placed = {  # layout -> the input sets, sharded over the mesh
        "contiguous": [[jax.device_put(x, spread) for x in xs] for xs in on_one],
        "zigzag": [[jax.device_put(x[:, zigzag], spread) for x in xs] for xs in on_one],
    }
    try:
        single, single_args = compile_pass(whole(sizes.implementation), pass_, on_one)
        expected = outputs(pass_, single(*single_args[0]))
    except Exception as e:  # noqa: BLE001 - out of memory on one device: the sharded rows are timed alone
        emit("single", **_failure(e))
        single, expected = None, None
    single_ms = []
    built = {}
    for variant in SHARDED:
        fields = dict(layout=variant.layout, strategy=variant.strategy, tolerance=tolerance)
        try:
            want = expected
            if expected is not None and variant.layout == "zigzag":
                want = jax.tree.map(lambda x: x[:, zigzag], expected)
            b = build(
                sharded(mesh, variant, sizes.implementation), pass_, placed[variant.layout], want, device, tolerance
            )
            if single is None:
                ms = timing.median_ms(b.fn, b.args, reps=reps, min_sample_s=min_sample_s).ms
                note = "unchecked and unpaired: the single-device call did not run"
                built[variant.name] = (b, dict(fields, ms=ms, note=note))
                continue
            p = timing.paired_ratio(b.fn, b.args, single, single_args, reps=reps, min_sample_s=min_sample_s)
        except Exception as e:  # noqa: BLE001 - out of memory, a refusal or a wrong result: a row says which
            emit(variant.name, **fields, **_failure(e))
            continue
        single_ms.append(p.theirs_ms)
        target = EFFICIENCY_TARGETS[pass_] if point.seq_q // n >= TARGET_MIN_SEQ else None
        built[variant.name] = (
            b,
            dict(
                fields,
                ms=p.ours_ms,
                single_ms=p.theirs_ms,
                speedup=p.ratio,
                speedup_interval=[p.low, p.high],
                efficiency=p.ratio / n,
                efficiency_interval=[p.low / n, p.high / n],
                target=target,
                rel_err=b.rel_err,
                calls_per_sample=p.calls,
            ),
        )
    if "ring_zigzag" in built and "ring_contiguous" in built:
        zz, contiguous = built["ring_zigzag"][0], built["ring_contiguous"][0]
        try:
            p = timing.paired_ratio(
                zz.fn, zz.args, contiguous.fn, contiguous.args, reps=reps, min_sample_s=min_sample_s
            )
            built["ring_zigzag"][1].update(
                ratio_to_contiguous=p.ratio, contiguous_interval=[p.low, p.high], contiguous_target=ZIGZAG_TARGET
            )
        except Exception as e:  # noqa: BLE001 - e.g. both rings' buffers at once do not fit
            built["ring_zigzag"][1]["note"] = f"not paired with the contiguous ring: {error_note(e)}"
    for name, (_, fields) in built.items():
        emit(name, tflops=flops / (fields["ms"] * 1e-3) / 1e12, **fields)
    del built, placed
    if single is None:
        return
    try:
        if not on_nvidia_gpu():
            raise RuntimeError("cuDNN needs an NVIDIA GPU")
        b = build(cudnn, pass_, on_one, expected, device, tolerance)
        p = timing.paired_ratio(single, single_args, b.fn, b.args, reps=reps, min_sample_s=min_sample_s)
    except Exception as e:  # noqa: BLE001 - no GPU, a refusal, out of memory or a wrong result
        emit("cudnn", tolerance=tolerance, **_failure(e))
    else:
        single_ms.append(p.ours_ms)
        emit(
            "cudnn",
            ms=p.theirs_ms,
            tflops=flops / (p.theirs_ms * 1e-3) / 1e12,
            single_ms=p.ours_ms,
            speedup=1 / p.ratio,
            speedup_interval=[1 / p.high, 1 / p.low],
            rel_err=b.rel_err,
            tolerance=tolerance,
            calls_per_sample=p.calls,
        )
    ms = (
        float(np.median(single_ms))
        if single_ms
        else timing.median_ms(single, single_args, reps=reps, min_sample_s=min_sample_s).ms
    )
    emit("single", ms=ms, tflops=flops / (ms * 1e-3) / 1e12, note="the reference of every check")


def mesh_of(devices: int | None) -> Mesh:
    """A one-axis mesh (AXIS) over the first `devices` local devices (None: all of them)."""
    local = jax.local_devices()
    count = len(local) if devices is None else devices
    if len(local) < max(count, 2):
        raise RuntimeError(f"context parallelism needs at least 2 devices; this process sees {len(local)}")
    return Mesh(np.array(local[:count]), (AXIS,))


def run(
    *,
    seqs_per_gpu,
    passes,
    reps=None,
    min_sample_ms=None,
    time_budget=None,
    smoke=False,
    stamp=None,
    on_record=None,
) -> list[dict]:
    """Measure the suite; returns its records (each with the fields of `stamp`). `on_record(records)` is called
    after each (the caller writes them, so a cut-off run keeps what it measured)."""
    sizes = SMOKE if smoke else Sizes()
    settings = dict(
        reps=reps or (3 if smoke else 15),
        min_sample_ms=0.0 if smoke else 10.0 if min_sample_ms is None else min_sample_ms,
        rotate=1 if smoke else ROTATE,
    )
    records, start = [], time.perf_counter()
    print("\n".join(report.ring_header()), flush=True)

    def emit(point, devices, seq_per_gpu, pass_, variant, **fields):
        records.append(
            record(
                dict(stamp or {}, smoke=smoke),
                point=point,
                devices=devices,
                seq_per_gpu=seq_per_gpu,
                variant=variant,
                pass_=pass_,
                **fields,
            )
        )
        print(report.ring_row(records[-1]), flush=True)
        if on_record:
            on_record(records)

    try:
        mesh = mesh_of(sizes.devices)
    except RuntimeError as e:
        point = Point("ring", 1, 0, 0, *sizes.heads[0], sizes.head_dim, True, sizes.dtype)
        emit(point, len(jax.local_devices()), None, passes[0], "ring_zigzag", status="skip", note=str(e))
        return records
    n = mesh.devices.size
    for seq_per_gpu in seqs_per_gpu:
        for heads, kv_heads in sizes.heads:
            seq = n * seq_per_gpu
            point = Point("ring", 1, seq, seq, heads, kv_heads, sizes.head_dim, True, sizes.dtype)
            for pass_ in passes:
                if time_budget and time.perf_counter() - start > time_budget:
                    print(f"time budget of {time_budget:.0f} s spent: stopped before {seq_per_gpu} tokens per GPU")
                    return records
                row = functools.partial(emit, point, n, seq_per_gpu, pass_)
                try:
                    measure_point(point, mesh, pass_, sizes, settings, row)
                except Exception as e:  # noqa: BLE001 - the inputs themselves do not fit: an OOM row, not a crash
                    row("single", **_failure(e))
    return records
