"""GPU probe of the Hopper forward kernel as first run (2026-11-23): correctness of `hopper_forward` on a grid against
the float32 reference, then single-call median times against cuDNN and the portable kernel. Run:
`PYTHONPATH=. python benchmarks/hopper_probe.py` (log: benchmarks/results/2026-11-23-h100/hopper_probe.log)."""
import sys, time, traceback, statistics
import jax, jax.numpy as jnp, numpy as np
from pallas_flash.kernels import hopper_fwd as hf
from pallas_flash import reference, masks
import pallas_flash as pf
print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)

def inputs(B, Tq, Tk, H, Hkv, D, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, Tq, H, D), dtype), jax.random.normal(ks[1], (B, Tk, Hkv, D), dtype),
            jax.random.normal(ks[2], (B, Tk, Hkv, D), dtype))

def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)): return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))

ok_any = False
grid = [(1, 256, 256, 2, 2, 64, False), (1, 256, 256, 2, 2, 64, True), (2, 1024, 1024, 4, 4, 128, False),
        (2, 1024, 1024, 4, 4, 128, True), (1, 1000, 1000, 4, 2, 128, True), (1, 777, 1531, 4, 1, 64, False),
        (1, 1531, 777, 4, 4, 128, True), (1, 512, 512, 2, 2, 256, False), (1, 300, 300, 2, 2, 96, True)]
for (B, Tq, Tk, H, Hkv, D, causal) in grid:
    for dtype in (jnp.bfloat16, jnp.float16):
        q, k, v = inputs(B, Tq, Tk, H, Hkv, D, dtype)
        try:
            o, l = hf.hopper_forward(q, k, v, scale=D ** -0.5, is_causal=causal)
            jax.block_until_ready(o)
            ro, rl = reference.attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                                   v.astype(jnp.float32), scale=D ** -0.5, band=masks.Band.of(causal))
            print(f"CHECK {B}x{Tq}x{Tk}x{H}x{Hkv}x{D} causal={causal} {jnp.dtype(dtype).name}: "
                  f"out {rel(o, ro):.2e} lse {rel(l, rl):.2e}", flush=True)
            ok_any = True
        except Exception as e:
            print(f"CHECK {B}x{Tq}x{Tk}x{H}x{Hkv}x{D} causal={causal}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            if not ok_any:
                traceback.print_exc()
                break
    else:
        continue
    break

def bench(fn, args, reps=20):
    f = jax.jit(fn)
    jax.block_until_ready(f(*args[0]))
    samples = []
    for r in range(reps):
        a = args[r % len(args)]
        t = time.perf_counter(); jax.block_until_ready(f(*a)); samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)

if ok_any:
    for D in (128, 64):
        for N in (2048, 8192, 16384):
            for causal in (False, True):
                B, H = 16384 // N, 2048 // D
                args = [inputs(B, N, N, H, H, D, jnp.bfloat16, s) for s in range(3)]
                flops = 4 * B * H * N * N * D / (2 if causal else 1)
                res = {}
                for name, fn in [("mosaic", lambda q, k, v: hf.hopper_forward(q, k, v, scale=D ** -0.5, is_causal=causal)[0]),
                                 ("cudnn", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")),
                                 ("pallas", lambda q, k, v: pf.flash_attention(q, k, v, is_causal=causal, implementation="pallas"))]:
                    try:
                        res[name] = bench(fn, args)
                    except Exception as e:
                        res[name] = float("nan"); print(name, "FAILED", str(e)[:300])
                print(f"TIME D={D} N={N} B={B} H={H} causal={causal}: " + " ".join(
                    f"{n} {ms:.3f}ms {flops/ms/1e9:.0f}TF/s" for n, ms in res.items())
                      + f" | mosaic/cudnn speed {res['cudnn']/res['mosaic']:.3f}x", flush=True)
