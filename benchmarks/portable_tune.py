"""Time block-size variants of the portable kernels against cuDNN, in one run (GPU).

    python -m benchmarks.portable_tune [--out DIR] [--quick]

Every variant's output and gradients are checked against the float32 reference before it is timed.
Prints a Markdown table (TFLOP/s, ratio to cuDNN measured in the same run, compiled temp bytes) and writes
the records as JSON. FLOPs: forward 4*B*H*Nq*Nk*D (halved when causal); forward+backward 3.5x that.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf

# (name, batch, seq, heads, head_dim, dtype): the seed case and the D=128, N=8192 case.
CASES = [("seed", 32, 512, 16, 64, jnp.float16), ("d128_n8192", 2, 8192, 16, 128, jnp.bfloat16)]

VARIANTS = {
    64: [
        pf.KernelConfig.default(64),
        pf.KernelConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3, block_q_dkv=64, block_kv_dkv=128,
                        block_q_dq=128, block_kv_dq=64, num_warps_bwd=8, num_stages_bwd=2),
        pf.KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=3, block_q_dkv=32, block_kv_dkv=128,
                        block_q_dq=64, block_kv_dq=64, num_warps_bwd=4, num_stages_bwd=2),
        pf.KernelConfig(block_q=128, block_kv=64, num_warps=4, num_stages=4, block_q_dkv=64, block_kv_dkv=64,
                        block_q_dq=64, block_kv_dq=64, num_warps_bwd=4, num_stages_bwd=3),
    ],
    128: [
        pf.KernelConfig.default(128),
        pf.KernelConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3, block_q_dkv=64, block_kv_dkv=128,
                        block_q_dq=128, block_kv_dq=64, num_warps_bwd=8, num_stages_bwd=2),
        pf.KernelConfig(block_q=128, block_kv=64, num_warps=4, num_stages=3, block_q_dkv=32, block_kv_dkv=128,
                        block_q_dq=128, block_kv_dq=32, num_warps_bwd=4, num_stages_bwd=2),
        pf.KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=3, block_q_dkv=64, block_kv_dkv=64,
                        block_q_dq=64, block_kv_dq=64, num_warps_bwd=4, num_stages_bwd=3),
        pf.KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2, block_q_dkv=32, block_kv_dkv=64,
                        block_q_dq=64, block_kv_dq=32, num_warps_bwd=4, num_stages_bwd=1),
    ],
}


def flops(batch, seq, heads, head_dim, causal, pass_):
    fwd = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    return fwd * (3.5 if pass_ == "fwdbwd" else 1.0)


def median_ms(fn, inputs, samples=15, calls_per_sample=None):
    for args in inputs:  # warm-up: compile and first runs
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs[0]))
    once = time.perf_counter() - start
    calls = calls_per_sample or max(1, int(0.02 / max(once, 1e-6)))  # ~20 ms per sample
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="default configs only")
    args = parser.parse_args(argv)
    device = jax.devices()[0].device_kind
    stamp = dict(date=datetime.date.today().isoformat(), device=device, jax_version=jax.__version__,
                 command="python -m benchmarks.portable_tune " + " ".join(argv if argv is not None else sys.argv[1:]))
    records = []
    for name, batch, seq, heads, head_dim, dtype in CASES:
        keys = jax.random.split(jax.random.key(0), 12)
        inputs = [tuple(jax.random.normal(keys[4 * r + j], (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
                        for j in range(4)) for r in range(3)]
        qkv = [x[:3] for x in inputs]
        variants = VARIANTS[head_dim][:1] if args.quick else VARIANTS[head_dim]
        for causal in (True, False):
            def cudnn(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

            def xla(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

            impls = [("cudnn", cudnn, None), ("xla", xla, None)]
            for i, config in enumerate(variants):
                impls.append((f"pallas[{i}]", lambda q, k, v, c=config: pf.flash_attention(
                    q, k, v, is_causal=causal, implementation="pallas", config=c), config))
            # Check a slice of the batch against the float32 reference, outputs and gradients.
            sub = [x[:1] for x in inputs[0]]
            ref_fn = lambda q, k, v: pf.attention_reference(q, k, v, scale=head_dim ** -0.5, is_causal=causal)[0]
            f32 = [x.astype(jnp.float32) for x in sub]
            ref_out, ref_vjp = jax.vjp(ref_fn, *f32[:3])
            ref_grads = ref_vjp(f32[3])
            cudnn_ms = {}
            for impl_name, fn, config in impls:
                out, vjp = jax.vjp(fn, *sub[:3])
                grads = vjp(sub[3])
                errs = [rel_err(out, ref_out)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
                tol = 3e-2 if dtype == jnp.bfloat16 else 1e-2
                ok = max(errs) <= tol
                fwd = jax.jit(fn)

                @jax.jit
                def fwdbwd(q, k, v, do, fn=fn):
                    _, vjp = jax.vjp(fn, q, k, v)
                    return vjp(do)

                for pass_, f, a in (("fwd", fwd, qkv), ("fwdbwd", fwdbwd, inputs)):
                    rec = dict(suite="portable_tune", case=name, impl=impl_name, **{"pass": pass_}, batch=batch,
                               seq_q=seq, seq_k=seq, heads=heads, kv_heads=heads, head_dim=head_dim, causal=causal,
                               dtype=jnp.dtype(dtype).name, max_rel_err=max(errs), correct=ok,
                               config=dataclasses.asdict(config) if config else None, **stamp)
                    if not ok:
                        rec.update(ms=None, tflops=None, ratio_to_cudnn=None, temp_bytes=None)
                        print(f"FAIL {name} causal={causal} {impl_name} {pass_}: errors {errs}", flush=True)
                        records.append(rec)
                        continue
                    try:
                        ms = median_ms(f, a)
                        mem = f.lower(*a[0]).compile().memory_analysis()
                        temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
                    except Exception as e:  # noqa: BLE001 - report and go on (e.g. XLA out of memory)
                        print(f"ERROR {name} causal={causal} {impl_name} {pass_}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    if impl_name == "cudnn":
                        cudnn_ms[pass_] = ms
                    tflops = flops(batch, seq, heads, head_dim, causal, pass_) / ms / 1e9
                    ratio = cudnn_ms[pass_] / ms if pass_ in cudnn_ms else None
                    rec.update(ms=ms, tflops=tflops, ratio_to_cudnn=ratio, temp_bytes=temp)
                    records.append(rec)
                    print(f"{name:11s} causal={int(causal)} {impl_name:10s} {pass_:6s} {ms:8.3f} ms "
                          f"{tflops:6.1f} TFLOP/s  x{ratio if ratio else 0:.2f} cuDNN  temp {temp}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"portable_tune-{stamp['date']}.json")
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print("\n| case | causal | impl | pass | ms | TFLOP/s | x cuDNN | temp MB |\n|---|---|---|---|---|---|---|---|")
    for r in records:
        if r["ms"] is not None:
            print(f"| {r['case']} | {int(r['causal'])} | {r['impl']} | {r['pass']} | {r['ms']:.3f} | {r['tflops']:.0f} "
                  f"| {r['ratio_to_cudnn'] or 0:.2f} | {(r['temp_bytes'] or 0) / 2**20:.0f} |")
    print(f"\nwrote {path}; {stamp}")


if __name__ == "__main__":
    main()
