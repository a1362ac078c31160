"""The bar suite (issues 6 and 7): `flash_attention` with its defaults against cuDNN, timed in interleaved pairs.

The bar: at least 1.0x cuDNN at head_dim 64 and 128, N = 2k, 8k and 16k, causal and not, forward and
forward+backward; bf16, B*N = 16k tokens, H*D = 2048. For each point both functions are compiled, their outputs
(gradients included) compared (max abs difference), each checked for bitwise repeatability over 5 calls on one
input set (cuDNN's backward may sum with atomics unless XLA_FLAGS has --xla_gpu_deterministic_ops=true, recorded
in each record: it decides whether our deterministic default or `--nondeterministic` is the like-for-like run),
then timed by `benchmarks.timing.paired_ratio`. Each record holds the median ratio cuDNN ms / ours (> 1: ours is
faster), its ~95% interval and the verdict: "ahead" (interval above 1), "behind" (below 1) or "parity".

Variants, each its own row: `--hopper` forward tiles instead of the default; `--bwd` HopperBwdConfig field
overrides of the call's default backward; `--one-pass`, `--dq-ordered`, `--two-pass` force a Hopper backward at
every head_dim; `--nondeterministic` passes `deterministic=False`. With `--smoke` (CPU): tiny shapes, float32,
`xla_chunked` against XLA's dense attention.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

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
    head_dim: int, deterministic: bool, seq: int, causal: bool, overrides: dict
) -> HopperBwdConfig:
    """The backward this call takes by default (`HopperBwdConfig.default` for its head_dim, key length and mask)
    with one `--bwd` item's field overrides."""
    return dataclasses.replace(
        HopperBwdConfig.default(head_dim, deterministic, kv_len=seq, is_causal=causal), **overrides
    )


def describe(config: HopperConfig | None) -> str:
    if config is None:
        return "default"
    flags = "".join(f",{name}" for name in ("persistent", "overlap") if getattr(config, name))
    return f"{config.block_q},{config.block_kv},{config.num_stages}{flags}"


def describe_bwd(overrides: dict | None) -> str:
    return "" if not overrides else " bwd:" + ",".join(f"{k}={int(v)}" for k, v in overrides.items())


def kernel_config(head_dim, seq, causal, deterministic, hopper=None, bwd=None, backward="default"):
    """The KernelConfig of one variant (None: the call's defaults)."""
    hopper_bwd = None
    if backward != "default":
        hopper_bwd = dataclasses.replace(HopperBwdConfig.default(head_dim), **FORCED_BACKWARDS[backward])
    elif bwd:
        hopper_bwd = overridden_bwd_config(head_dim, deterministic, seq, causal, bwd)
    if hopper is None and hopper_bwd is None:
        return None
    return dataclasses.replace(pf.KernelConfig.default(head_dim), hopper=hopper, hopper_bwd=hopper_bwd)


def max_abs_difference(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def repeatable(compiled, args, calls: int = REPEAT_CALLS) -> bool:
    """Whether `calls` calls on the same inputs give bitwise the same outputs (a backward that sums with atomics
    usually does not)."""
    first = [np.asarray(x) for x in jax.tree.leaves(compiled(*args))]
    for _ in range(calls - 1):
        again = [np.asarray(x) for x in jax.tree.leaves(compiled(*args))]
        if not all(np.array_equal(a, b) for a, b in zip(first, again)):
            return False
    return True


def measure_variant(point, pass_, inputs, theirs, *, ours_impl, config, deterministic, reps, min_sample_s) -> dict:
    """One variant of ours at one point and pass against the compiled baseline `theirs` (compiled, argument
    sets): outputs compared, bitwise repeatability of both, paired timing. Returns the record's measured fields."""
    theirs, theirs_args = theirs
    ours, ours_args = compile_pass(attend(ours_impl, point.causal, deterministic, config), pass_, inputs)
    difference = max_abs_difference(outputs(pass_, ours(*ours_args[0])), outputs(pass_, theirs(*theirs_args[0])))
    repeats = dict(ours=repeatable(ours, ours_args[0]), baseline=repeatable(theirs, theirs_args[0]))
    p = timing.paired_ratio(ours, ours_args, theirs, theirs_args, reps=reps, min_sample_s=min_sample_s)
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
    """Measure the bar; returns one record per (pass, head_dim, N, causal, variant), each with the fields of `stamp`
    (environment, command, date). `on_record(records)` is called after each record (the caller writes them, so a
    cut-off run keeps what it measured). With `smoke`: tiny float32 shapes, xla_chunked against XLA."""
    deterministic = not nondeterministic
    shape, dtype = (dict(tokens=256, width=64), "float32") if smoke else ({}, "bfloat16")
    ours_impl, theirs_impl = ("xla_chunked", "xla") if smoke else (None, "cudnn")
    reps = reps or (5 if smoke else 21)
    min_sample_s = (0.0 if smoke else 20.0 if min_sample_ms is None else min_sample_ms) / 1e3
    variants = [(h, b) for h in parse_hopper_configs(hopper) for b in parse_bwd_overrides(bwd)]
    records, start = [], time.perf_counter()
    print("\n".join(report.bar_header(theirs_impl)), flush=True)
    for pass_, head_dim, seq, causal in itertools.product(passes, head_dims, seqs, causals):
        if time_budget and time.perf_counter() - start > time_budget:
            print(
                f"time budget of {time_budget:.0f} s spent: stopped before {pass_} D={head_dim} N={seq} causal={causal}"
            )
            break
        point = anchor_point("bar", seq, head_dim, causal, dtype, **shape)
        inputs = [random_inputs(point, seed) for seed in range(3)]
        theirs = compile_pass(attend(theirs_impl, causal), pass_, inputs)
        for hopper_config, overrides in variants:
            record = dict(
                suite="bar",
                impl=ours_impl or "pallas_flash",
                baseline=theirs_impl,
                point=point.key(),
                batch=point.batch,
                seq_q=seq,
                seq_k=seq,
                heads=point.heads,
                kv_heads=point.kv_heads,
                head_dim=head_dim,
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
            config = kernel_config(head_dim, seq, causal, deterministic, hopper_config, overrides, backward)
            try:
                record.update(
                    measure_variant(
                        point,
                        pass_,
                        inputs,
                        theirs,
                        ours_impl=ours_impl,
                        config=config,
                        deterministic=deterministic,
                        reps=reps,
                        min_sample_s=min_sample_s,
                    )
                )
            except Exception as error:  # a swept variant that does not compile (registers, shared memory)
                if hopper_config is None and not overrides:
                    raise
                record.update(status="skip", note=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
            records.append(record)
            print(report.bar_row(record), flush=True)
            if on_record:
                on_record(records)
    return records
