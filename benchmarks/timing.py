"""How every suite and tool times a function: samples of back-to-back calls, and paired ratios with an interval.

A sample is `calls` back-to-back calls rotating over a few input sets (so no set stays in L2), ending in
`block_until_ready`, at least `min_sample_s` of host clock; its value is ms per call. `median_ms` times one
function. `paired_ratio` times two in interleaved samples (A B, B A, A B, ...): each adjacent pair sees the same
clocks and temperature, so slow drift cancels in its ratio. Single medians of two functions taken minutes apart
moved by +-5% between runs on the H100, the size of the margins these benchmarks decide; the paired ratio's
median and its distribution-free ~95% interval are what a claim rests on.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import NamedTuple

import jax
import numpy as np


class Timing(NamedTuple):
    ms: float  # median of the samples, ms per call
    ms_min: float
    ms_max: float
    calls: int  # calls per sample


class Paired(NamedTuple):
    ratio: float  # median over pairs of theirs / ours (> 1: ours is faster)
    low: float  # ~95% interval of that median
    high: float
    ours_ms: float  # median sample of each side
    theirs_ms: float
    calls: int  # calls per sample, the same on both sides

    @property
    def verdict(self) -> str:
        return verdict(self.low, self.high)


def verdict(low: float, high: float) -> str:
    """ "ahead" where the interval lies above 1, "behind" below 1, else "parity"."""
    return "ahead" if low > 1.0 else "behind" if high < 1.0 else "parity"


class TorchSynced:
    """A torch result that `jax.block_until_ready` (so every timing here) waits for: it synchronizes CUDA. The
    suites' PyTorch peers return their results in it."""

    def __init__(self, value):
        self.value = value

    def block_until_ready(self):
        import torch

        torch.cuda.synchronize()
        return self


def torch_pass(attend, pass_: str, input_sets, dtype: str):
    """A PyTorch attention `attend(q, k, v)` as a timed pass, on CUDA copies of (q, k, v, cotangent) input sets in
    its own [B, H, N, D] layout and `dtype`: (fn, argument sets); fn returns a `TorchSynced` of the output (fwd),
    or of dq, dk, dv, the vector-Jacobian product of the output with the cotangent (any other pass: autograd
    straight from the output, as the JAX side's fwdbwd pass computes it, `benchmarks.inputs.pass_function`)."""
    import torch

    torch_dtype, grad = getattr(torch, dtype), pass_ != "fwd"

    def tensor(x, requires_grad):  # [B, N, H, D] -> [B, H, N, D], contiguous
        x = torch.from_numpy(np.asarray(x, np.float32)).cuda().to(torch_dtype).transpose(1, 2).contiguous()
        return x.requires_grad_(requires_grad)

    def fwdbwd(q, k, v, ct):
        return TorchSynced(torch.autograd.grad(attend(q, k, v), (q, k, v), grad_outputs=ct))

    args = [tuple(tensor(x, grad and i < 3) for i, x in enumerate(s)) for s in input_sets]
    return ((lambda q, k, v, ct: TorchSynced(attend(q, k, v))) if pass_ == "fwd" else fwdbwd), args


def warm_up(fn, arg_sets) -> None:
    for args in arg_sets:
        jax.block_until_ready(fn(*args))


def calls_per_sample(fn, args, min_sample_s: float) -> int:
    """Calls per sample from the fastest of three single calls: one slow call (a host hiccup) would otherwise
    leave a point timed one call per sample, host launch overhead included."""
    probes = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        probes.append(time.perf_counter() - start)
    return max(1, math.ceil(min_sample_s / max(min(probes), 1e-7)))


def sample_ms(fn, arg_sets, calls: int, r: int = 0) -> float:
    """Sample r: ms per call of `calls` back-to-back calls rotating over `arg_sets`."""
    start = time.perf_counter()
    for i in range(calls):
        out = fn(*arg_sets[(r * calls + i) % len(arg_sets)])
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def median_ms(fn, arg_sets, *, reps: int, min_sample_s: float) -> Timing:
    """Median over `reps` samples of `fn` (compiled), after a warm-up call on every input set."""
    warm_up(fn, arg_sets)
    calls = calls_per_sample(fn, arg_sets[0], min_sample_s)
    samples = [sample_ms(fn, arg_sets, calls, r) for r in range(reps)]
    return Timing(statistics.median(samples), min(samples), max(samples), calls)


def median_interval(sorted_values) -> tuple[float, float]:
    """Order statistics k and n-1-k bound the median with >= ~95% confidence (binomial, normal approximation);
    with few values, the extremes."""
    n = len(sorted_values)
    k = max(0, math.floor((n - 1.96 * math.sqrt(n)) / 2))
    return sorted_values[k], sorted_values[n - 1 - k]


def paired_ratio(ours, ours_args, theirs, theirs_args=None, *, reps: int, min_sample_s: float) -> Paired:
    """Per-pair time ratios theirs / ours from interleaved samples, each side rotating over its own argument
    sets (`theirs_args` defaults to `ours_args`); both sides take the larger of their calls per sample."""
    theirs_args = ours_args if theirs_args is None else theirs_args
    warm_up(ours, ours_args)
    warm_up(theirs, theirs_args)
    calls = max(
        calls_per_sample(ours, ours_args[0], min_sample_s), calls_per_sample(theirs, theirs_args[0], min_sample_s)
    )
    ratios, ours_ms, theirs_ms = [], [], []
    for r in range(reps):
        if r % 2 == 0:
            ours_ms.append(sample_ms(ours, ours_args, calls, r))
            theirs_ms.append(sample_ms(theirs, theirs_args, calls, r))
        else:
            theirs_ms.append(sample_ms(theirs, theirs_args, calls, r))
            ours_ms.append(sample_ms(ours, ours_args, calls, r))
        ratios.append(theirs_ms[-1] / ours_ms[-1])
    ratios.sort()
    low, high = median_interval(ratios)
    return Paired(statistics.median(ratios), low, high, statistics.median(ours_ms), statistics.median(theirs_ms), calls)
