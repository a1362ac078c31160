"""The decode suite: `flash_decode` (`pallas_flash.decode`) against cuDNN, and `GPT.generate` against a dense loop.

Points: one new query per sequence (Tq = 1), bf16, GQA 32 query heads on 8 key heads, D=128, over a KV cache:
  contiguous  B=32, 8k keys per sequence;          long  B=8, 64k keys;          long_b1  B=1, 64k keys;
  paged64, paged256  the contiguous point's cache in pages of 64 / 256 keys, the pages shuffled (a random block
              table), paired with the contiguous point (`ratio_to_partner` = this ms / contiguous ms);
  uniform     B=32, every sequence holding the same number of keys, the ragged point's total spread evenly;
  ragged      B=32, lengths uniform in [1, 8k], paired with uniform (`ratio_to_partner` = this ms / uniform ms).
Variants, each checked against the dense float32 oracle (`implementation="reference"`) before it is timed:
  default  `flash_decode(implementation=None)`; `impl` is the registry entry that ran (`DECODE_REGISTRY`);
  xla      `implementation="xla"` forced (where the default is "xla" too, the pair measures the harness's noise);
  cudnn    `jax.nn.dot_product_attention(q, k, v, implementation="cudnn", key_value_seq_lengths=lengths)` on the
           contiguous cache (no row for paged caches, which it cannot read).
Every other variant is timed in interleaved pairs with default (`benchmarks.timing`): `ratio_to_default` = this
ms / default ms with its ~95% interval; the default row carries cuDNN's as `ratio_to_cudnn` (cuDNN ms / ours).
Bandwidth: the keys and values the queries see (sum of lengths x kv_heads x head_dim x 2 x bytes) over the time,
in TB/s and as a fraction of the device's HBM peak (3.35 TB/s on the H100 SXM; none for other devices).
Last, generation: `GPT.generate`'s decode loop (`models.generate.decode`, attention by `flash_decode` over its
cache of the prompt's bucket plus the new tokens) on the small preset at an 8k context (B=32, greedy), against
the same loop with Flax's decode cache: a cache of the whole context, attended by dense
`nnx.dot_product_attention` with the keys beyond each sequence's length masked (`masked_dense_decode`). Two
scenarios: `generate`, a 1k prompt and 1k new tokens (what a decode cache of the whole context wastes), and
`generate_full`, a 7k prompt and 1k new tokens (the caches alike: only the attention kernels differ). Each loop
from its own prefill, timed to completion in interleaved runs; `ratio_to_dense` = dense s / flash s (target >= 3).
With `--smoke` (CPU): tiny float32 shapes, the xla path, the tiny preset.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import zlib
from collections.abc import Callable
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_flash as pf
from benchmarks import report, timing
from benchmarks.inputs import DTYPES
from benchmarks.suites import error_note
from models import generate, transformer
from models.gpt import GPT, PRESETS
from pallas_flash.api import choose
from pallas_flash.decode import DECODE_REGISTRY, DecodeCall, DecodeParams
from pallas_flash.device import on_nvidia_gpu
from tests import tolerances

# HBM peaks (datasheets) by device kind: the H100 SXM's HBM3, the H200's HBM3e.
HBM_PEAK_TBS = {"H100 80GB HBM3": 3.35, "H200": 4.8}
GENERATION_TARGET = 3.0  # GPT.generate's tokens/s over the dense masked-cache loop's
GENERATION = "generate"  # the generation rows' case: a prompt and its new tokens well inside the context
GENERATION_FULL = "generate_full"  # a prompt and new tokens that fill the context


class Generation(NamedTuple):
    """A generation scenario: its case name, the prompt's tokens and the new tokens."""

    name: str
    prompt: int
    new_tokens: int


def generations(sizes) -> list[Generation]:
    return [Generation(name, *pair) for name, pair in zip((GENERATION, GENERATION_FULL), sizes.generations)]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A run's shapes: the attention points' heads, head_dim, dtype, batch x keys of the 8k and long points and
    page sizes; the generation's preset, context (max_seq_len), (prompt, new tokens) of its two scenarios, batch
    and model dtype."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    batch: int = 32
    seq: int = 8192
    long_batch: int = 8
    long_seq: int = 65536
    page_sizes: tuple = (64, 256)
    preset: str = "small"
    context: int = 8192
    generations: tuple = ((1024, 1024), (7168, 1024))
    generate_batch: int = 32
    model_dtype: str = "bfloat16"


SMOKE = Sizes(
    heads=4,
    kv_heads=2,
    head_dim=32,
    dtype="float32",
    batch=4,
    seq=256,
    long_batch=2,
    long_seq=1024,
    page_sizes=(16,),
    preset="tiny",
    context=64,
    generations=((8, 8),),  # the generate scenario only: generate_full runs the same loop
    generate_batch=2,
    model_dtype="float32",
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One cache: `batch` sequences of capacity `seq`, contiguous or in pages of `page_size`; `lengths`: "full"
    (every sequence holds `seq` keys), "ragged" (uniform in [1, seq]) or "even" (the ragged total spread evenly);
    `partner`: the case this one's default is paired with."""

    name: str
    batch: int
    seq: int
    page_size: int | None = None
    lengths: str = "full"
    partner: str | None = None

    def lengths_of(self) -> np.ndarray:
        """int32 [batch]: the keys each sequence holds (a fixed draw, the same in every run)."""
        if self.lengths == "full":
            return np.full(self.batch, self.seq, np.int32)
        ragged = np.random.default_rng(0).integers(1, self.seq + 1, self.batch).astype(np.int32)
        if self.lengths == "ragged":
            return ragged
        base, extra = divmod(int(ragged.sum()), self.batch)
        return (base + (np.arange(self.batch) < extra)).astype(np.int32)


def cases(sizes: Sizes) -> list[Case]:
    """The suite's caches, each partner before the cases paired with it."""
    b, s = sizes.batch, sizes.seq
    return [
        Case("contiguous", b, s),
        Case("long", sizes.long_batch, sizes.long_seq),
        Case("long_b1", 1, sizes.long_seq),
        *(Case(f"paged{page}", b, s, page_size=page, partner="contiguous") for page in sizes.page_sizes),
        Case("uniform", b, s, lengths="even"),
        Case("ragged", b, s, lengths="ragged", partner="uniform"),
    ]


def case_names(sizes: Sizes = SMOKE) -> list[str]:
    return [case.name for case in cases(sizes)] + [g.name for g in generations(sizes)]


def peak_tbs(device_kind: str) -> float | None:
    """The device's HBM peak in TB/s where HBM_PEAK_TBS knows it."""
    return next((peak for name, peak in HBM_PEAK_TBS.items() if name in device_kind), None)


def paginate(cache, page_size: int, order: np.ndarray):
    """cache [batch, seq, kv_heads, head_dim] as shuffled pages [batch * seq / page_size, page_size, kv_heads,
    head_dim]: logical page j (sequence j // pages_per_sequence) lies at physical page order[j]."""
    batch, seq = cache.shape[:2]
    pages = cache.reshape(batch * seq // page_size, page_size, *cache.shape[2:])
    return pages[np.argsort(order)]


class Timed(NamedTuple):
    """A variant ready to time: what ran, the compiled function, its arguments and its checked error."""

    impl: str
    fn: Callable
    args: tuple
    rel_err: float


def default_impl(query, key_cache, page_size) -> str:
    """The `DECODE_REGISTRY` entry `flash_decode(implementation=None)` runs for these shapes."""
    call = DecodeCall(
        jax.ShapeDtypeStruct(query.shape, query.dtype),
        jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
        page_size,
        DecodeParams(scale=1.0 / math.sqrt(query.shape[-1])),
    )
    return choose(DECODE_REGISTRY, None, call, what="flash_decode ").name


def ours(implementation):
    return lambda q, k, v, lengths, table: pf.flash_decode(
        q, k, v, lengths=lengths, block_table=table, implementation=implementation
    )


def cudnn(q, k, v, lengths, table):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", key_value_seq_lengths=lengths)


def build(impl, fn, args, ref, tolerance) -> Timed:
    """`fn` compiled for `args` and checked against the reference output; a ValueError above the tolerance."""
    compiled = jax.jit(fn).lower(*args).compile()
    out = np.asarray(compiled(*args), np.float32)
    error = tolerances.relative_error(out, ref) if np.all(np.isfinite(out)) else math.inf
    if not error <= tolerance:
        raise ValueError(f"relative error {error:.1e} > {tolerance:.0e} against the dense float32 reference")
    return Timed(impl, compiled, args, error)


def _failure(error: BaseException) -> dict:
    note = error_note(error)
    if note == "out of memory":
        return dict(status="oom", note=note)
    return dict(status="fail" if "relative error" in note else "skip", note=note)


def measure_case(case, sizes, settings, partners, emit) -> None:
    """Every variant of one cache; `partners[name]`: the default's Timed of the cases others pair with (filled
    here); `emit(variant, **fields)` receives each row."""
    dtype = DTYPES[sizes.dtype]
    keys = jax.random.split(jax.random.key(zlib.crc32(case.name.encode())), 3)
    q = jax.random.normal(keys[0], (case.batch, 1, sizes.heads, sizes.head_dim), dtype)
    k, v = (jax.random.normal(x, (case.batch, case.seq, sizes.kv_heads, sizes.head_dim), dtype) for x in keys[1:])
    lengths_np = case.lengths_of()
    lengths = jnp.asarray(lengths_np)
    kv_bytes = int(lengths_np.sum()) * sizes.kv_heads * sizes.head_dim * 2 * jnp.dtype(dtype).itemsize
    tolerance = tolerances.OUTPUT[jnp.dtype(dtype).type]
    ref = np.asarray(jax.jit(ours("reference"))(q, k, v, lengths, None), np.float32)
    args = (q, k, v, lengths, None)
    if case.page_size:
        order = np.random.default_rng(1).permutation(case.batch * case.seq // case.page_size)
        table = jnp.asarray(order.reshape(case.batch, -1), jnp.int32)
        args = (q, paginate(k, case.page_size, order), paginate(v, case.page_size, order), lengths, table)
    del k, v
    peak = peak_tbs(jax.devices()[0].device_kind)
    reps, min_sample_s = settings["reps"], settings["min_sample_ms"] / 1e3
    common = dict(kv_tokens=int(lengths_np.sum()), kv_bytes=kv_bytes, tolerance=tolerance, peak_tbs=peak)

    def bandwidth(ms):
        tbs = kv_bytes / (ms * 1e-3) / 1e12
        return dict(ms=ms, tbs=tbs, fraction_of_peak=None if peak is None else tbs / peak)

    name = default_impl(args[0], args[1], case.page_size)
    try:
        default = build(name, ours(None), args, ref, tolerance)
    except Exception as e:  # noqa: BLE001 - a wrong or failing default: the other variants are timed alone
        emit("default", impl=name, **common, **_failure(e))
        default = None
    others = {"xla": lambda: build("xla", ours("xla"), args, ref, tolerance)}
    if not case.page_size:
        others["cudnn"] = lambda: build("cudnn", cudnn, args, ref, tolerance)
    fields, default_ms = {}, []
    for variant, make in others.items():
        try:
            if variant == "cudnn" and not on_nvidia_gpu():
                raise RuntimeError("cuDNN needs an NVIDIA GPU")
            timed = make()
            if default is None:
                ms = timing.median_ms(timed.fn, [timed.args], reps=reps, min_sample_s=min_sample_s).ms
                emit(variant, impl=timed.impl, **common, **bandwidth(ms), rel_err=timed.rel_err)
                continue
            p = timing.paired_ratio(
                default.fn, [default.args], timed.fn, [timed.args], reps=reps, min_sample_s=min_sample_s
            )
        except Exception as e:  # noqa: BLE001 - not here, a refusal, out of memory or a wrong result
            emit(variant, impl=variant, **common, **_failure(e))
            continue
        default_ms.append(p.ours_ms)
        interval = [p.low, p.high]
        emit(
            variant,
            impl=timed.impl,
            **common,
            **bandwidth(p.theirs_ms),
            default_ms=p.ours_ms,
            ratio_to_default=p.ratio,
            ratio_interval=interval,
            rel_err=timed.rel_err,
            calls_per_sample=p.calls,
        )
        if variant == "cudnn":
            fields.update(ratio_to_cudnn=p.ratio, cudnn_interval=interval)
    if default is None:
        return
    if case.partner in partners:
        partner = partners[case.partner]
        try:
            p = timing.paired_ratio(
                partner.fn, [partner.args], default.fn, [default.args], reps=reps, min_sample_s=min_sample_s
            )
            default_ms.append(p.theirs_ms)
            fields.update(partner=case.partner, ratio_to_partner=p.ratio, partner_interval=[p.low, p.high])
        except Exception as e:  # noqa: BLE001 - e.g. both caches at once do not fit
            fields.update(partner=case.partner, note=f"not paired with {case.partner}: {error_note(e)}")
    if not default_ms:
        default_ms.append(timing.median_ms(default.fn, [default.args], reps=reps, min_sample_s=min_sample_s).ms)
    emit("default", impl=name, **common, **bandwidth(float(np.median(default_ms))), rel_err=default.rel_err, **fields)
    if any(c.partner == case.name for c in cases(sizes)):
        partners[case.name] = default


# ---------------------------------------------------------------------------------------------- generation


def masked_dense_decode(query, key_cache, value_cache, *, lengths, block_table=None):
    """Flax's decode-cache attention with `flash_decode`'s signature: dense `nnx.dot_product_attention` of
    query [batch, Tq, heads, head_dim] over the cache's whole capacity [batch, max_len, kv_heads, head_dim]
    (key heads repeated for GQA, as Flax's attention has none), every key after each query's position masked."""
    if block_table is not None:
        raise ValueError("the dense decode loop reads a contiguous cache")
    batch, q_len, heads, _ = query.shape
    group = heads // key_cache.shape[2]
    key, value = (jnp.repeat(x, group, axis=2) for x in (key_cache, value_cache))
    positions = lengths[:, None] - q_len + jnp.arange(q_len)[None, :]  # [batch, Tq]
    mask = jnp.arange(key_cache.shape[1])[None, None, None, :] <= positions[:, None, :, None]
    return nnx.dot_product_attention(query, key, value, mask=mask)


def compiled_loop(graphdef, loop_args, *, dense: bool):
    """`models.generate.decode`, the loop `GPT.generate` runs, compiled for `loop_args` (abstract), greedy. With
    `dense`, a new jit of it traced while the attention over the cache is `masked_dense_decode`: of a function
    object of its own, since jit reuses a trace of the same function (which would be the flash loop's)."""
    static = dict(greedy=True, top_k=None)
    if not dense:
        return generate.decode.lower(graphdef, *loop_args, **static).compile()
    traced = []

    @functools.wraps(generate.decode.__wrapped__)
    def loop(*args, **kwargs):
        return generate.decode.__wrapped__(*args, **kwargs)

    def attention(*args, **kwargs):
        traced.append(True)
        return masked_dense_decode(*args, **kwargs)

    jitted = jax.jit(loop, static_argnames=("graphdef", "greedy", "top_k"), donate_argnames=("cache",))
    with mock.patch.object(transformer, "flash_decode", attention):
        compiled = jitted.lower(graphdef, *loop_args, **static).compile()
    if not traced:
        raise RuntimeError("the dense loop was not traced with the dense attention")
    return compiled


def measure_generation(sizes, settings, scenario: Generation, emit) -> None:
    """GPT.generate's decode loop over its own cache (the prompt bucket plus the new tokens) against the dense
    loop over a cache of the model's whole context, as Flax's decode cache is; each from its own prefill of the
    same prompts, timed to completion in interleaved runs."""
    config = dataclasses.replace(PRESETS[sizes.preset], max_seq_len=sizes.context, dtype=sizes.model_dtype)
    model = GPT(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    batch, prompt, new_tokens = sizes.generate_batch, scenario.prompt, scenario.new_tokens
    prompt_len = generate.bucket(prompt, config.max_seq_len, generate.MIN_PROMPT_BUCKET)
    cache_lens = dict(flash=generate.bucket(prompt_len + new_tokens, config.max_seq_len), dense=config.max_seq_len)
    tokens = np.zeros((batch, prompt_len), np.int32)
    tokens[:, :prompt] = np.random.default_rng(0).integers(0, config.vocab_size, (batch, prompt))
    prefill_args = (state, jnp.asarray(tokens), jnp.full((batch,), prompt, jnp.int32))
    common = dict(batch=batch, preset=sizes.preset, prompt=prompt, new_tokens=new_tokens, target=GENERATION_TARGET)

    def loop_args(logits, cache):
        return (state, cache, logits, jnp.int32(new_tokens), jnp.float32(1.0), jax.random.key(0))

    prefills, loops = {}, {}
    try:
        for name, cache_len in cache_lens.items():
            static = dict(cache_len=cache_len, page_size=None)
            prefills[name] = generate.prefill.lower(graphdef, *prefill_args, **static).compile()
            abstract = jax.eval_shape(lambda *a, static=static: generate.prefill(graphdef, *a, **static), *prefill_args)
            loops[name] = compiled_loop(graphdef, loop_args(*abstract), dense=name == "dense")
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: no generation rows
        emit("flash", **common, context=cache_lens["flash"], **_failure(e))
        return

    def sample(name):
        logits, cache = jax.block_until_ready(prefills[name](*prefill_args))
        start = time.perf_counter()
        out, *_ = jax.block_until_ready(loops[name](*loop_args(logits, cache)))
        return time.perf_counter() - start, np.asarray(out[:, :new_tokens])

    sample("flash"), sample("dense")  # warm-up
    seconds, ratios, outs = {"flash": [], "dense": []}, [], {}
    for r in range(settings["generate_reps"]):
        for name in ("flash", "dense") if r % 2 == 0 else ("dense", "flash"):
            s, outs[name] = sample(name)
            seconds[name].append(s)
        ratios.append(seconds["dense"][-1] / seconds["flash"][-1])
    ratios.sort()
    low, high = timing.median_interval(ratios)
    agree = float(np.mean(outs["flash"] == outs["dense"]))
    for name in ("flash", "dense"):
        s = float(np.median(seconds[name]))
        fields = dict(ratio_to_dense=float(np.median(ratios)), dense_interval=[low, high]) if name == "flash" else {}
        emit(
            name,
            impl="GPT.generate" if name == "flash" else "dense masked cache",
            **common,
            context=cache_lens[name],
            ms=s * 1e3,
            tokens_per_s=batch * new_tokens / s,
            tokens_agree=agree,
            **fields,
        )


# ---------------------------------------------------------------------------------------------- the suite


def record(stamp, *, case, variant, status="ok", note="", **fields) -> dict:
    """One row of results.json, with the run's `stamp`."""
    rec = dict(
        suite="decode",
        case=case.name if isinstance(case, Case) else case,
        variant=variant,
        impl=None,
        batch=getattr(case, "batch", None),
        seq=getattr(case, "seq", None),
        page_size=getattr(case, "page_size", None),
        lengths=getattr(case, "lengths", None),
        ms=None,
        tbs=None,
        fraction_of_peak=None,
        ratio_to_default=None,
        ratio_interval=None,
        ratio_to_cudnn=None,
        cudnn_interval=None,
        partner=None,
        ratio_to_partner=None,
        partner_interval=None,
        tokens_per_s=None,
        ratio_to_dense=None,
        dense_interval=None,
        target=None,
        rel_err=None,
        tolerance=None,
        status=status,
        note=note,
        **stamp,
    )
    rec.update(fields)
    return rec


def run(
    *,
    names=None,
    reps=None,
    min_sample_ms=None,
    time_budget=None,
    smoke=False,
    stamp=None,
    on_record=None,
) -> list[dict]:
    """Measure the suite (the cases in `names`, default all of `case_names()`); returns its records (each with the
    fields of `stamp`). `on_record(records)` is called after each (the caller writes them, so a cut-off run keeps
    what it measured)."""
    sizes = SMOKE if smoke else Sizes()
    names = names or case_names(sizes)
    settings = dict(
        reps=reps or (3 if smoke else 15),
        min_sample_ms=0.0 if smoke else 10.0 if min_sample_ms is None else min_sample_ms,
        generate_reps=1 if smoke else 5,
    )
    shape = dict(heads=sizes.heads, kv_heads=sizes.kv_heads, head_dim=sizes.head_dim, dtype=sizes.dtype)
    records, start, partners = [], time.perf_counter(), {}
    print("\n".join(report.decode_header()), flush=True)

    def emitter(case, extra):
        def emit(variant, **fields):
            records.append(record(dict(stamp or {}, smoke=smoke), case=case, variant=variant, **extra, **fields))
            print(report.decode_row(records[-1]), flush=True)
            if on_record:
                on_record(records)

        return emit

    for case in cases(sizes):
        if case.name not in names and not any(c.partner == case.name for c in cases(sizes) if c.name in names):
            continue
        if time_budget and time.perf_counter() - start > time_budget:
            print(f"time budget of {time_budget:.0f} s spent: stopped before {case.name}")
            return records
        emit = emitter(case, shape)
        try:
            measure_case(case, sizes, settings, partners, emit)
        except Exception as e:  # noqa: BLE001 - the cache itself does not fit: an OOM row, not a crash
            emit("default", **_failure(e))
    for scenario in generations(sizes):
        if scenario.name in names:
            measure_generation(sizes, settings, scenario, emitter(scenario.name, dict(dtype=sizes.model_dtype)))
    return records
