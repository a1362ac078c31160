"""Tune the portable kernels on the GPU: time each kernel's block-size variants on its own, pick the best per
kernel, then time the combined config end to end against cuDNN, all in one run.

    python -m benchmarks.portable_tune [--out DIR] [--cases d128_n8192,seed]

Each variant's result is checked against the float32 dense reference (on the first batch element) before it
is timed; a wrong variant gets no number. FLOPs: forward 4*B*H*Nq*Nk*D (halved when causal); forward+backward
3.5x that. The single kernels are reported in ms only.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from pallas_flash.kernels import portable_bwd, portable_fwd, tiles

CASES = {  # name: (batch, seq, heads, head_dim, dtype)
    "d128_n8192": (2, 8192, 16, 128, jnp.bfloat16),
    "seed": (32, 512, 16, 64, jnp.float16),
    "d64_n8192": (2, 8192, 32, 64, jnp.bfloat16),
}
# (block_q, block_kv, num_warps, num_stages) per kernel.
FWD = {128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 3)],
       64: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 32, 4, 4)]}
DKDV = [(64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2),
        (64, 64, 8, 3), (32, 64, 4, 4), (64, 128, 8, 3)]
DQ = [(64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2),
      (128, 32, 8, 2), (64, 64, 8, 3)]


def median_ms(fn, inputs, samples=15):
    for args in inputs:
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs[0]))
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))  # ~20 ms per sample
    times = []
    for i in range(samples):
        args = inputs[i % len(inputs)]
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-2 * np.sqrt(b.size)))


def fwd_flops(batch, seq, heads, head_dim, causal):
    return 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)


def tune_case(name, causal, stamp, records):
    batch, seq, heads, head_dim, dtype = CASES[name]
    scale = head_dim ** -0.5
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-2
    keys = jax.random.split(jax.random.key(0), 12)
    sets = [tuple(jax.random.normal(keys[4 * r + j], (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
                  for j in range(4)) for r in range(3)]
    # Reference on the first batch element, float32.
    f32 = [x[:1].astype(jnp.float32) for x in sets[0]]
    ref_fn = lambda q, k, v: pf.attention_reference(q, k, v, scale=scale, is_causal=causal)[0]
    ref_out, ref_vjp = jax.vjp(ref_fn, *f32[:3])
    ref_dq, ref_dk, ref_dv = ref_vjp(f32[3])
    # Residuals of each input set, from the default forward.
    residuals = []
    for q, k, v, do in sets:
        out, lse = pf.flash_attention(q, k, v, is_causal=causal, return_lse=True, implementation="pallas")
        delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), out.astype(jnp.float32))
        residuals.append((q, k, v, do, lse * tiles.LOG2E, delta))
    base = dict(suite="portable_tune", case=name, batch=batch, seq_q=seq, seq_k=seq, heads=heads, kv_heads=heads,
                head_dim=head_dim, causal=causal, dtype=jnp.dtype(dtype).name, **stamp)
    best = {}
    kernels = {
        "fwd": (FWD[head_dim], lambda v: jax.jit(functools.partial(
            portable_fwd.forward, scale=scale, is_causal=causal, kv_len=seq, block_q=v[0], block_kv=v[1],
            num_warps=v[2], num_stages=v[3], interpret=False)), [r[:3] for r in residuals]),
        "dkdv": (DKDV, lambda v: jax.jit(functools.partial(
            portable_bwd.dkdv, scale=scale, is_causal=causal, kv_len=seq, block_q=v[0], block_kv=v[1],
            num_warps=v[2], num_stages=v[3], interpret=False)), residuals),
        "dq": (DQ, lambda v: jax.jit(functools.partial(
            portable_bwd.dq, scale=scale, is_causal=causal, kv_len=seq, block_q=v[0], block_kv=v[1],
            num_warps=v[2], num_stages=v[3], interpret=False)), residuals),
    }
    checks = {"fwd": lambda r: [rel_err(r[0][:1], ref_out)],
              "dkdv": lambda r: [rel_err(r[0][:1], ref_dk), rel_err(r[1][:1], ref_dv)],
              "dq": lambda r: [rel_err(r[:1], ref_dq)]}
    for kernel, (variants, build, inputs) in kernels.items():
        for variant in variants:
            try:
                fn = build(variant)
                errs = checks[kernel](fn(*inputs[0]))
                if max(errs) > tol:
                    print(f"FAIL {name} causal={int(causal)} {kernel} {variant}: errors {errs}", flush=True)
                    continue
                ms = median_ms(fn, inputs)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported and skipped
                print(f"ERROR {name} causal={int(causal)} {kernel} {variant}: {type(e).__name__}: {str(e)[:160]}")
                continue
            records.append(dict(base, impl=f"pallas:{kernel}", variant=variant, ms=ms, max_rel_err=max(errs),
                                **{"pass": kernel}))
            print(f"{name} causal={int(causal)} {kernel:5s} {str(variant):18s} {ms:8.3f} ms", flush=True)
            if kernel not in best or ms < best[kernel][1]:
                best[kernel] = (variant, ms)
    config = pf.KernelConfig(
        block_q=best["fwd"][0][0], block_kv=best["fwd"][0][1], num_warps=best["fwd"][0][2],
        num_stages=best["fwd"][0][3],
        block_q_dkv=best["dkdv"][0][0], block_kv_dkv=best["dkdv"][0][1], num_warps_dkv=best["dkdv"][0][2],
        num_stages_dkv=best["dkdv"][0][3],
        block_q_dq=best["dq"][0][0], block_kv_dq=best["dq"][0][1], num_warps_dq=best["dq"][0][2],
        num_stages_dq=best["dq"][0][3])
    impls = {
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
        "pallas_default": lambda q, k, v: pf.flash_attention(q, k, v, is_causal=causal, implementation="pallas"),
        "pallas_tuned": lambda q, k, v: pf.flash_attention(q, k, v, is_causal=causal, implementation="pallas",
                                                           config=config),
    }
    cudnn_ms = {}
    for impl, fn in impls.items():
        fwd = jax.jit(fn)

        @jax.jit
        def fwdbwd(q, k, v, do, fn=fn):
            _, vjp = jax.vjp(fn, q, k, v)
            return vjp(do)

        for pass_, f, inputs in (("fwd", fwd, [s[:3] for s in sets]), ("fwdbwd", fwdbwd, sets)):
            ms = median_ms(f, inputs)
            mem = f.lower(*inputs[0]).compile().memory_analysis()
            temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
            cudnn_ms.setdefault(pass_, ms)
            tflops = fwd_flops(batch, seq, heads, head_dim, causal) * (3.5 if pass_ == "fwdbwd" else 1) / ms / 1e9
            rec = dict(base, impl=impl, ms=ms, tflops=tflops, ratio_to_cudnn=cudnn_ms[pass_] / ms, temp_bytes=temp,
                       config=dataclasses.asdict(config) if impl == "pallas_tuned" else None, **{"pass": pass_})
            records.append(rec)
            print(f"{name} causal={int(causal)} {impl:15s} {pass_:6s} {ms:8.3f} ms {tflops:6.1f} TFLOP/s "
                  f"x{rec['ratio_to_cudnn']:.2f} cuDNN temp {temp}", flush=True)
    print(f"BEST {name} causal={int(causal)}: {config}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--cases", default="d128_n8192,seed")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    stamp = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind,
                 jax_version=jax.__version__, command="python -m benchmarks.portable_tune " + " ".join(argv))
    records = []
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"portable_tune-{stamp['date']}.json")
    for name in args.cases.split(","):
        for causal in (True, False):
            tune_case(name, causal, stamp, records)
            with open(path, "w") as f:  # after every case, so a cut-off run keeps what it measured
                json.dump(records, f, indent=1)
    print("\n| case | causal | impl | pass | ms | TFLOP/s | x cuDNN | temp MB |\n|---|---|---|---|---|---|---|---|")
    for r in records:
        if "tflops" in r:
            print(f"| {r['case']} | {int(r['causal'])} | {r['impl']} | {r['pass']} | {r['ms']:.3f} | {r['tflops']:.0f} "
                  f"| {r['ratio_to_cudnn']:.2f} | {(r['temp_bytes'] or 0) / 2**20:.0f} |")
    print(f"\nwrote {path}; {stamp}")


if __name__ == "__main__":
    main()
