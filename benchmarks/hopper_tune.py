"""Hopper forward tile sweep (H100): each HopperConfig at N = 2k, 8k, 16k (B*N = 16k tokens, H*D = 2048, bf16),
causal and not, against cuDNN timed in the same run. Run: `PYTHONPATH=. python benchmarks/hopper_tune.py`
(results: benchmarks/results/2026-11-23-h100/hopper_tune*.log). Timing: jit, warm-up call, median of 30 single calls
rotating over 3 input sets; short kernels (N = 2k causal, < 0.6 ms) carry +-15% run-to-run noise here."""
import statistics, time, sys
import jax, jax.numpy as jnp
from pallas_flash.kernels import hopper_fwd as hf
from pallas_flash.config import HopperConfig
print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)

def inputs(B, N, H, D, seed):
    ks = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(kk, (B, N, H, D), jnp.bfloat16) for kk in ks]

def bench(fn, args, reps=30):
    f = jax.jit(fn); jax.block_until_ready(f(*args[0])); s = []
    for r in range(reps):
        a = args[r % len(args)]; t = time.perf_counter(); jax.block_until_ready(f(*a)); s.append((time.perf_counter() - t) * 1e3)
    return statistics.median(s)

configs = {64: [(64, 128, 3), (64, 256, 2), (64, 192, 2), (64, 192, 3), (64, 256, 3), (64, 128, 2)],
           128: [(64, 128, 2), (64, 176, 2), (64, 160, 2), (64, 144, 2), (64, 112, 3)]}
for D, cfgs in configs.items():
    for N in (2048, 8192, 16384):
        B, H = 16384 // N, 2048 // D
        args = [inputs(B, N, H, D, s) for s in range(3)]
        for causal in (False, True):
            flops = 4 * B * H * N * N * D / (2 if causal else 1)
            cud = bench(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"), args)
            line = [f"TUNE D={D} N={N} causal={causal} cudnn {cud:.3f}ms {flops/cud/1e9:.0f}TF/s |"]
            for bq, bkv, st in cfgs:
                cfg = HopperConfig(block_q=bq, block_kv=bkv, num_stages=st)
                try:
                    ms = bench(lambda q, k, v: hf.hopper_forward(q, k, v, scale=D ** -0.5, is_causal=causal, config=cfg)[0], args)
                    line.append(f"({bq},{bkv},{st}) {ms:.3f}ms {cud/ms:.3f}x")
                except Exception as e:
                    line.append(f"({bq},{bkv},{st}) FAIL {type(e).__name__}: {str(e)[:120]!r}")
            print(" ".join(line), flush=True)
