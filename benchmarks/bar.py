"""The bar suite: `flash_attention` with its defaults against cuDNN, timed in interleaved pairs.

The bar: at least 1.0x cuDNN at head_dim 64 and 128, N = 2k, 8k and 16k, causal and not, forward and
forward+backward; bf16, B*N = 16k tokens, H*D = 2048. For each point both functions are compiled, their outputs
(gradients included) compared (max abs difference), each checked for bitwise repeatability over 5 calls on one
input set (cuDNN's backward may sum with atomics unless XLA_FLAGS has --xla_gpu_deterministic_ops=true, recorded
in each record: it decides whether our deterministic default or `--nondeterministic` is the like-for-like run),
then timed by `benchmarks.timing.paired_ratio`. Each record holds the median ratio cuDNN ms / ours (> 1: ours is
faster), its ~95% interval and the verdict: "ahead" (interval above 1), "behind" (below 1) or "parity".

Baselines (`--baselines`, each its own rows): "cudnn", `jax.nn.dot_product_attention(implementation="cudnn")`;
"torch_cudnn", PyTorch's `scaled_dot_product_attention` held to its cuDNN backend (`sdpa_kernel`), in the same
process on [B, H, N, D] copies of the inputs (its own layout), a sample of calls ended by a CUDA synchronize; its
rows are skipped without torch or CUDA.

`--head-dims` items are D or D:Dv, a value head_dim of its own (MLA's 192:128; FLOPs 2*B*H*N^2*(D + Dv)). A peer
that cannot take one (jax.nn's cuDNN) leaves ours timed alone, checked against the float32 XLA chunked path
(verdict "unpaired"), so its TFLOP/s can be set beside a square run's.

Variants, each its own row: `--hopper` forward tiles instead of the default; `--bwd` HopperBwdConfig field
overrides of the call's default backward; `--one-pass`, `--dq-ordered`, `--two-pass` force a Hopper backward at
every head_dim; `--nondeterministic` passes `deterministic=False`. With `--smoke` (CPU): tiny shapes, float32,
`xla_chunked` against XLA's dense attention.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from benchmarks import report, timing
from benchmarks.inputs import FLOP_FACTOR, anchor_point, compile_pass, fwd_flops, outputs, random_inputs
from pallas_flash.hopper.config import HopperBwdConfig, HopperConfig

REPEAT_CALLS = 5  # calls per side on one input set for the bitwise-repeatability column
FORCED_BACKWARDS = {  # --one-pass / --dq-ordered / --two-pass: HopperBwdConfig fields over the head_dim's default
    "one-pass": dict(dq_atomic=True, dq_ordered=False, num_stages_dkv=2),
    "dq-ordered": dict(dq_atomic=True, dq_ordered=True, num_stages_dkv=2),
    "two-pass": dict(dq_atomic=False, dq_ordered=False, num_stages_dkv=2),
}


def attend(implementation, causal: bool, deterministic: bool = True, config: pf.KernelConfig | None = None):
    """(q, k, v) -> out: cuDNN or XLA's dense attention by `jax.nn` ("cudnn", "xla"), else `flash_attention`
    with this implementation (None: the dispatcher's choice) and config (None: its default)."""
    if implementation in ("cudnn", "xla"):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)
    return lambda q, k, v: pf.flash_attention(
        q, k, v, is_causal=causal, implementation=implementation, deterministic=deterministic, config=config
    )


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


def parse_head_dims(text: str | None) -> list[tuple[int, int | None]] | None:
    """`--head-dims` as (head_dim, value head_dim or None): ","-separated items "D" or "D:Dv" (a value head_dim
    of its own, e.g. MLA's "192:128"); None (no flag): None."""
    if not text:
        return None
    dims = []
    for item in text.split(","):
        fields = item.split(":")
        if len(fields) > 2 or not all(x.isdigit() for x in fields):
            raise ValueError(f"--head-dims: want D or D:Dv items, got {item!r}")
        dims.append((int(fields[0]), int(fields[1]) if len(fields) == 2 else None))
    return dims


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


def overridden_bwd_config(
    head_dim: int, deterministic: bool, seq: int, causal: bool, overrides: dict, head_dim_v: int | None = None
) -> HopperBwdConfig:
    """The backward this call takes by default (`HopperBwdConfig.default` for its head dims, key length and mask)
    with one `--bwd` item's field overrides."""
    default = HopperBwdConfig.default(head_dim, deterministic, kv_len=seq, is_causal=causal, head_dim_v=head_dim_v)
    return dataclasses.replace(default, **overrides)


def describe(config: HopperConfig | None) -> str:
    if config is None:
        return "default"
    flags = "".join(f",{name}" for name in ("persistent", "overlap") if getattr(config, name))
    return f"{config.block_q},{config.block_kv},{config.num_stages}{flags}"


def describe_bwd(overrides: dict | None) -> str:
    return "" if not overrides else " bwd:" + ",".join(f"{k}={int(v)}" for k, v in overrides.items())


def kernel_config(head_dim, seq, causal, deterministic, hopper=None, bwd=None, backward="default", head_dim_v=None):
    """The KernelConfig of one variant (None: the call's defaults)."""
    hopper_bwd = None
    if backward != "default":
        default = HopperBwdConfig.default(head_dim, head_dim_v=head_dim_v)
        hopper_bwd = dataclasses.replace(default, **FORCED_BACKWARDS[backward])
    elif bwd:
        hopper_bwd = overridden_bwd_config(head_dim, deterministic, seq, causal, bwd, head_dim_v)
    if hopper is None and hopper_bwd is None:
        return None
    return dataclasses.replace(pf.KernelConfig.default(head_dim), hopper=hopper, hopper_bwd=hopper_bwd)


class Timed(NamedTuple):
    """A function ready to time: fn(*args[i]) for each argument set, and `arrays(result)`, what its pass checks
    (the output, or dq, dk, dv) as float32 NumPy arrays in our [batch, seq, heads, head_dim] layout."""

    fn: Callable
    args: list
    arrays: Callable
    label: str


def jax_timed(fn, pass_, inputs, label: str) -> Timed:
    compiled, args = compile_pass(fn, pass_, inputs)
    arrays = lambda result: [np.asarray(x, np.float32) for x in jax.tree.leaves(outputs(pass_, result))]
    return Timed(compiled, args, arrays, label)


class NoPeer(Exception):
    """A baseline that cannot run here (no torch, no CUDA)."""


def torch_cudnn_timed(point, pass_, inputs) -> Timed:
    """PyTorch's scaled_dot_product_attention on its cuDNN backend, on [B, H, N, D] copies of `inputs`."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        raise NoPeer(f"torch is not importable ({e})") from None
    if not torch.cuda.is_available():
        raise NoPeer("torch sees no CUDA device")
    if pass_ not in ("fwd", "fwdbwd"):
        raise NoPeer(f"the torch baseline times fwd and fwdbwd, not {pass_}")

    def attend(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=point.causal)

    fn, args = timing.torch_pass(attend, pass_, inputs, point.dtype)
    value = lambda r: r.value if isinstance(r.value, tuple) else (r.value,)
    arrays = lambda r: [x.detach().transpose(1, 2).float().cpu().numpy() for x in value(r)]
    label = f"torch {torch.__version__} SDPA cuDNN {torch.backends.cudnn.version()}"
    return Timed(fn, args, arrays, label)


def baseline_timed(name: str, point, pass_, inputs) -> Timed:
    """A baseline by name: "cudnn" or "xla" (`jax.nn`), "torch_cudnn" (`torch_cudnn_timed`)."""
    if name == "torch_cudnn":
        return torch_cudnn_timed(point, pass_, inputs)
    return jax_timed(attend(name, point.causal), pass_, inputs, name)


def max_abs_difference(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def repeatable(timed: Timed, calls: int = REPEAT_CALLS) -> bool:
    """Whether `calls` calls on the same inputs give bitwise the same outputs (a backward that sums with atomics
    usually does not)."""
    first = timed.arrays(timed.fn(*timed.args[0]))
    for _ in range(calls - 1):
        again = timed.arrays(timed.fn(*timed.args[0]))
        if not all(np.array_equal(a, b) for a, b in zip(first, again)):
            return False
    return True


def measure_alone(point, pass_, ours: Timed, reference: Timed, *, reps, min_sample_s) -> dict:
    """One variant of ours timed without a peer (none runs this point), its outputs compared with `reference`'s.
    Returns the record's measured fields."""
    difference = max_abs_difference(
        ours.arrays(ours.fn(*ours.args[0])), reference.arrays(reference.fn(*reference.args[0]))
    )
    t = timing.median_ms(ours.fn, ours.args, reps=reps, min_sample_s=min_sample_s)
    return dict(
        status="ok",
        ms=t.ms,
        baseline_ms=None,
        tflops=FLOP_FACTOR[pass_] * fwd_flops(point) / (t.ms * 1e-3) / 1e12,
        ratio_to_baseline=None,
        ratio_interval=None,
        verdict="unpaired",
        calls_per_sample=t.calls,
        reps=reps,
        max_abs_difference=difference,
        bitwise_repeatable=dict(ours=repeatable(ours), baseline=None),
    )


def measure_variant(point, pass_, ours: Timed, theirs: Timed, *, reps, min_sample_s) -> dict:
    """One variant of ours at one point and pass against a baseline: outputs compared, bitwise repeatability of
    both, paired timing. Returns the record's measured fields."""
    difference = max_abs_difference(ours.arrays(ours.fn(*ours.args[0])), theirs.arrays(theirs.fn(*theirs.args[0])))
    repeats = dict(ours=repeatable(ours), baseline=repeatable(theirs))
    p = timing.paired_ratio(ours.fn, ours.args, theirs.fn, theirs.args, reps=reps, min_sample_s=min_sample_s)
    return dict(
        status="ok",
        note="",
        ms=p.ours_ms,
        baseline_ms=p.theirs_ms,
        tflops=FLOP_FACTOR[pass_] * fwd_flops(point) / (p.ours_ms * 1e-3) / 1e12,
        ratio_to_baseline=p.ratio,
        ratio_interval=[p.low, p.high],
        verdict=p.verdict,
        calls_per_sample=p.calls,
        reps=reps,
        max_abs_difference=difference,
        bitwise_repeatable=repeats,
    )


def run(
    *,
    passes,
    head_dims,
    seqs,
    causals,
    baselines=None,
    nondeterministic=False,
    backward="default",
    hopper=None,
    bwd=None,
    reps=None,
    min_sample_ms=None,
    time_budget=None,
    smoke=False,
    stamp=None,
    on_record=None,
) -> list[dict]:
    """Measure the bar; returns one record per (pass, head_dim, N, causal, variant, baseline), each with the fields
    of `stamp` (environment, command, date). `head_dims`: ints, or (head_dim, value head_dim or None) pairs; where
    a peer cannot take a value head_dim of its own, ours is timed alone against the float32 XLA chunked path's
    result (verdict "unpaired"). `baselines`: names for `baseline_timed` (None: cuDNN through JAX).
    `on_record(records)` is called after each record (the caller writes them, so a cut-off run keeps what it
    measured). With `smoke`: tiny float32 shapes, xla_chunked against XLA (and any torch baseline skipped)."""
    deterministic = not nondeterministic
    shape, dtype = (dict(tokens=256, width=64), "float32") if smoke else ({}, "bfloat16")
    ours_impl = "xla_chunked" if smoke else None
    baselines = list(baselines or ["cudnn"])
    if smoke:
        baselines = ["xla" if b == "cudnn" else b for b in baselines]
    reps = reps or (5 if smoke else 21)
    min_sample_s = (0.0 if smoke else 20.0 if min_sample_ms is None else min_sample_ms) / 1e3
    variants = [(h, b) for h in parse_hopper_configs(hopper) for b in parse_bwd_overrides(bwd)]
    records, start = [], time.perf_counter()
    for name in baselines:
        print("\n".join(report.bar_header(name)) if len(baselines) == 1 else f"baseline: {name}", flush=True)
    for pass_, dims, seq, causal in itertools.product(passes, head_dims, seqs, causals):
        head_dim, head_dim_v = (dims, None) if isinstance(dims, int) else dims
        if time_budget and time.perf_counter() - start > time_budget:
            print(
                f"time budget of {time_budget:.0f} s spent: stopped before {pass_} D={head_dim} N={seq} causal={causal}"
            )
            break
        point = anchor_point("bar", seq, head_dim, causal, dtype, head_dim_v=head_dim_v, **shape)
        inputs = [random_inputs(point, seed) for seed in range(3)]
        reference = None  # the float32 XLA chunked result, compiled once a point no peer runs needs it
        peers = {}
        for name in baselines:
            try:
                if smoke and name == "torch_cudnn":
                    raise NoPeer("the torch baseline runs on a CUDA GPU only")
                peers[name] = baseline_timed(name, point, pass_, inputs)
            except NoPeer as e:
                peers[name] = e
            except Exception as e:  # a peer without value head dims of their own: its rows say so
                if head_dim_v is None:
                    raise
                peers[name] = e
        for hopper_config, overrides in variants:
            config = kernel_config(head_dim, seq, causal, deterministic, hopper_config, overrides, backward, head_dim_v)
            try:
                ours = jax_timed(attend(ours_impl, causal, deterministic, config), pass_, inputs, "ours")
            except Exception as error:  # a swept variant that does not compile (registers, shared memory)
                if hopper_config is None and not overrides:
                    raise
                ours = error
            for name, theirs in peers.items():
                record = dict(
                    suite="bar",
                    impl=ours_impl or "pallas_flash",
                    baseline=name,
                    baseline_label=None if isinstance(theirs, Exception) else theirs.label,
                    point=point.key(),
                    batch=point.batch,
                    seq_q=seq,
                    seq_k=seq,
                    heads=point.heads,
                    kv_heads=point.kv_heads,
                    head_dim=head_dim,
                    head_dim_v=head_dim_v,
                    causal=causal,
                    dtype=dtype,
                    variant=describe(hopper_config) + describe_bwd(overrides),
                    bwd_overrides=overrides or {},
                    backward=backward,
                    deterministic=deterministic,
                    smoke=smoke,
                    **(stamp or {}),
                )
                record["pass"] = pass_
                unpaired = isinstance(theirs, Exception) and not isinstance(theirs, NoPeer) and head_dim_v is not None
                if unpaired and not isinstance(ours, Exception):
                    if reference is None:
                        f32_inputs = [[x.astype(jnp.float32) for x in inputs[0]]]
                        reference = jax_timed(attend("xla_chunked", causal), pass_, f32_inputs, "float32 XLA chunked")
                    alone = measure_alone(point, pass_, ours, reference, reps=reps, min_sample_s=min_sample_s)
                    note = f"no peer: {type(theirs).__name__}: {str(theirs).splitlines()[0][:120]}"
                    record.update(alone, note=note)
                elif isinstance(theirs, Exception) or isinstance(ours, Exception):
                    error = theirs if isinstance(theirs, Exception) else ours
                    record.update(status="skip", note=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
                else:
                    try:
                        record.update(measure_variant(point, pass_, ours, theirs, reps=reps, min_sample_s=min_sample_s))
                    except Exception as error:  # a swept variant that fails to run
                        if hopper_config is None and not overrides:
                            raise
                        record.update(status="skip", note=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
                records.append(record)
                print(report.bar_row(record) if len(baselines) == 1 else f"[{name}] {report.bar_row(record)}",
                      flush=True)  # fmt: skip
                if on_record:
                    on_record(records)
    return records
