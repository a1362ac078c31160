"""GPU check of the Hopper backward (`pallas_flash/kernels/hopper_bwd.py`, issue 7) on an H100.

  PYTHONPATH=. python benchmarks/hopper_bwd_check.py            # correctness grid, then fwd+bwd timings
  PYTHONPATH=. python benchmarks/hopper_bwd_check.py --sweep    # correctness of the first cases, then a tile sweep
  PYTHONPATH=. python benchmarks/hopper_bwd_check.py --dq-atomic  # the one-pass backward (dQ by fp32 TMA
                                                                  # reduce-add) on GRID_ATOMIC, timed beside the
                                                                  # two-pass (N = 8k and 16k first)

The grid runs in a few processes with a timeout each, so a kernel that hangs shows up as TIMEOUT for its
cases and the grid goes on.
(1) CHECK lines: dq, dk, dv of `hopper_backward` (on residuals of the Hopper forward, with random cotangents
on out and lse) against the float32 reference's `jax.vjp`, as relative Frobenius errors; PASS under 4e-2
(bf16) / 8e-3 (fp16). An exception is printed, truncated, as FAIL and the grid goes on.
(2) TIME lines (only if no CHECK failed; a process cut by its timeout is reported and does not stop them):
`jax.grad` of `flash_attention(implementation="mosaic")` with the
Hopper backward vs the portable backward vs cuDNN, bf16, B*N = 16k tokens, H*D = 2048; TFLOP/s count
3.5 * 4*B*H*N^2*D (halved when causal); the ratio is cuDNN time / ours.
(3) SWEEP lines (--sweep): `hopper_backward` alone per tile config at N = 8192; bwd FLOPs 2.5 * 4*B*H*N^2*D.
The timing phase gets what is left of 7.5 minutes (with --dq-atomic the checks are 3 processes of at most
130 s, so that the run stays under 8 minutes with some timings in it).
"""
import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from pallas_flash import reference
from pallas_flash.config import HopperBwdConfig, KernelConfig
from pallas_flash.kernels import hopper_bwd, hopper_fwd

TOLERANCE = {"bfloat16": 4e-2, "float16": 8e-3}
TOTAL_S = 7.5 * 60  # the whole run, checks included
BUDGET_S = 6.5 * 60  # a timing process starts no new measurement after this many seconds of its own
CASES_PER_PROCESS = 3  # a process per 3 grid cases: JAX's start-up is paid 4 times, a hang costs at most 3 cases
CASE_TIMEOUT_S = 150  # one process's cases, both dtypes each, compiles included; more means a hang
START = time.perf_counter()
DQ_ATOMIC = False  # --dq-atomic: check the one-pass backward, and time it beside the two-pass one
# (batch, q_len, kv_len, heads, kv_heads, head_dim, causal)
GRID = [(1, 256, 256, 2, 2, 64, False), (1, 256, 256, 2, 2, 64, True), (2, 1024, 1024, 4, 4, 128, False),
        (2, 1024, 1024, 4, 4, 128, True), (1, 1000, 1000, 4, 2, 128, True), (1, 1000, 1000, 4, 1, 64, False),
        (1, 777, 1531, 4, 2, 64, True), (1, 777, 1531, 4, 4, 128, False), (1, 1531, 513, 4, 2, 128, True),
        (1, 1531, 513, 4, 4, 64, False), (1, 300, 300, 2, 2, 96, True)]
# --dq-atomic: one of each kind, two per process (the full grid took 475 s there, two processes cut at 150 s):
# head_dim 64 (dQ split by query rows), 128 and padded 96 (by columns); causal and not; GQA; ragged both ways.
GRID_ATOMIC = [(1, 256, 256, 2, 2, 64, True), (2, 1024, 1024, 4, 4, 128, False), (1, 1000, 1000, 4, 2, 128, True),
               (1, 777, 1531, 4, 2, 64, True), (1, 1531, 513, 4, 4, 64, False), (1, 300, 300, 2, 2, 96, True)]


def elapsed():
    return time.perf_counter() - START


def inputs(B, Tq, Tk, H, Hkv, D, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    return (jax.random.normal(ks[0], (B, Tq, H, D), dtype), jax.random.normal(ks[1], (B, Tk, Hkv, D), dtype),
            jax.random.normal(ks[2], (B, Tk, Hkv, D), dtype), jax.random.normal(ks[3], (B, Tq, H, D), dtype),
            0.1 * jax.random.normal(ks[4], (B, H, Tq), jnp.float32))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def check(case, dtype, config=None):
    B, Tq, Tk, H, Hkv, D, causal = case
    name = f"{B}x{Tq}x{Tk} H={H}/{Hkv} D={D} causal={causal} {jnp.dtype(dtype).name}"
    try:
        q, k, v, d_out, d_lse = inputs(B, Tq, Tk, H, Hkv, D, dtype)
        scale = D ** -0.5
        out, lse = hopper_fwd.hopper_forward(q, k, v, scale=scale, is_causal=causal)
        if DQ_ATOMIC:
            name += " dq_atomic"
            config = dataclasses.replace(config or HopperBwdConfig.default(hopper_fwd.padded_head_dim(D)),
                                         dq_atomic=True, dq_ordered=False, num_stages_dkv=2)
        grads = hopper_bwd.hopper_backward(q, k, v, out, lse, d_out, d_lse, scale=scale, is_causal=causal,
                                           config=config)
        grads = jax.block_until_ready(grads)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        with jax.default_matmul_precision("highest"):  # not tf32: the oracle must be float32
            _, vjp = jax.vjp(lambda q, k, v: reference.attention_reference(q, k, v, scale=scale, is_causal=causal),
                             *f32)
            want = vjp((d_out.astype(jnp.float32), d_lse))
        errors = [rel(g, w) for g, w in zip(grads, want)]
        shapes_ok = all(g.shape == x.shape and g.dtype == x.dtype for g, x in zip(grads, (q, k, v)))
        ok = shapes_ok and all(e <= TOLERANCE[jnp.dtype(dtype).name] for e in errors)
        print(f"CHECK {name}: dq {errors[0]:.2e} dk {errors[1]:.2e} dv {errors[2]:.2e}"
              f"{'' if shapes_ok else ' (wrong shape/dtype)'} {'PASS' if ok else 'FAIL'}", flush=True)
        return ok
    except Exception as e:  # noqa: BLE001 - one case's failure must not stop the grid
        print(f"CHECK {name}: FAIL {type(e).__name__}: {str(e)[:1500]}", flush=True)
        if dtype == jnp.bfloat16:  # once per case: where in our code it failed
            traceback.print_exc(limit=4)
        return False


def bench(fn, args, reps=10):
    jax.block_until_ready(fn(*args[0]))
    samples = []
    for r in range(reps):
        a = args[r % len(args)]
        t = time.perf_counter()
        jax.block_until_ready(fn(*a))
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def fwd_bwd(kind, causal, head_dim):
    """A fresh jitted fwd+bwd; the Hopper/portable backward switch is read when it is traced (first call)."""
    if kind == "cudnn":
        def attend(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    else:
        # Distinct static configs, so no cache can hand one variant's backward to the other.
        config = KernelConfig.default(head_dim)
        if kind == "hopper":
            config = dataclasses.replace(config, hopper_bwd=HopperBwdConfig.default(head_dim))
        if kind == "hopper_atomic":
            config = dataclasses.replace(config, hopper_bwd=dataclasses.replace(HopperBwdConfig.default(head_dim),
                                                                                dq_atomic=True, dq_ordered=False,
                                                                                num_stages_dkv=2))

        def attend(q, k, v):
            return pf.flash_attention(q, k, v, is_causal=causal, implementation="mosaic", config=config)

    def loss(q, k, v, ct):
        return jnp.vdot(attend(q, k, v).astype(jnp.float32), ct.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    if kind == "cudnn":
        return grad

    def traced_with_switch(*args):
        previous = os.environ.get("PALLAS_FLASH_HOPPER_BWD")
        os.environ["PALLAS_FLASH_HOPPER_BWD"] = "0" if kind == "portable" else "1"
        try:
            return grad(*args)
        finally:
            if previous is None:
                os.environ.pop("PALLAS_FLASH_HOPPER_BWD")
            else:
                os.environ["PALLAS_FLASH_HOPPER_BWD"] = previous

    return traced_with_switch


def timings():
    points = ((128, 8192), (64, 8192), (128, 2048), (64, 2048), (128, 16384), (64, 16384))  # most telling first
    if DQ_ATOMIC:  # the one-pass kernel is meant for long rows
        points = ((128, 8192), (64, 8192), (128, 16384), (64, 16384), (128, 2048), (64, 2048))
    for D, N in points:
        for causal in (False, True):
            if elapsed() > BUDGET_S:
                print(f"TIME D={D} N={N} causal={causal}: skipped (time budget)", flush=True)
                continue
            B, H = 16384 // N, 2048 // D
            args = []
            for seed in range(2):
                q, k, v, d_out, _ = inputs(B, N, N, H, H, D, jnp.bfloat16, seed)
                args.append((q, k, v, d_out))
            flops = 3.5 * 4 * B * H * N * N * D / (2 if causal else 1)
            res = {}
            for kind in ("hopper", "hopper_atomic" if DQ_ATOMIC else "portable", "cudnn"):
                try:
                    res[kind] = bench(fwd_bwd(kind, causal, D), args)
                except Exception as e:  # noqa: BLE001
                    res[kind] = float("nan")
                    print(f"  {kind} FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
            print(f"TIME fwd+bwd D={D} N={N} B={B} H={H} causal={causal}: " + " ".join(
                f"{kind} {ms:.3f}ms {flops / ms / 1e9:.0f}TF/s" for kind, ms in res.items())
                + " | " + " ".join(f"{kind}/cudnn {res['cudnn'] / ms:.3f}x" for kind, ms in res.items()
                                   if kind != "cudnn"), flush=True)


SWEEP = {128: [HopperBwdConfig(64, 64, 3, 64, 64, 3), HopperBwdConfig(64, 64, 2, 64, 64, 2),
               HopperBwdConfig(128, 64, 2, 64, 64, 3), HopperBwdConfig(64, 64, 3, 64, 128, 2)],
         64: [HopperBwdConfig(128, 64, 3, 64, 128, 3), HopperBwdConfig(64, 64, 3, 64, 64, 3),
              HopperBwdConfig(128, 64, 2, 64, 128, 2), HopperBwdConfig(128, 64, 4, 64, 64, 4)]}


def sweep():
    N = 8192
    for D, configs in SWEEP.items():
        B, H = 16384 // N, 2048 // D
        for causal in (False, True):
            q, k, v, d_out, d_lse = inputs(B, N, N, H, H, D, jnp.bfloat16)
            try:
                out, lse = hopper_fwd.hopper_forward(q, k, v, scale=D ** -0.5, is_causal=causal)
            except Exception as e:  # noqa: BLE001
                print(f"SWEEP D={D} causal={causal}: forward FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
                continue
            flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
            for config in configs:
                if elapsed() > BUDGET_S:
                    print(f"SWEEP D={D} causal={causal} {config}: skipped (time budget)", flush=True)
                    continue
                try:
                    fn = jax.jit(lambda *a, config=config: hopper_bwd.hopper_backward(
                        *a, scale=D ** -0.5, is_causal=causal, config=config))
                    ms = bench(fn, [(q, k, v, out, lse, d_out, d_lse)])
                    print(f"SWEEP bwd D={D} N={N} causal={causal} {config}: {ms:.3f}ms {flops / ms / 1e9:.0f}TF/s",
                          flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"SWEEP D={D} causal={causal} {config}: FAILED {type(e).__name__}: {str(e)[:500]}",
                          flush=True)


def _child(flags, timeout_s, capture=True):
    """Runs this script with `flags` in a fresh process, so that a kernel that hangs costs one case, not the
    run. Returns the (PASS, FAIL) counts it printed (captured output, echoed), or None on a timeout."""
    command = [sys.executable, os.path.abspath(__file__), *flags]
    try:
        result = subprocess.run(command, timeout=timeout_s, text=True,
                                **(dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT) if capture else {}))
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(output, end="")
        print(f"TIMEOUT after {timeout_s:.0f}s: {' '.join(flags)} (a hang? the lines above are what it printed)",
              flush=True)
        return None
    if not capture:
        return None
    print(result.stdout, end="", flush=True)
    return result.stdout.count(" PASS"), result.stdout.count(" FAIL")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="tile sweep of the backward alone at N=8192")
    parser.add_argument("--no-time", action="store_true", help="correctness only")
    parser.add_argument("--dq-atomic", action="store_true",
                        help="check the one-pass backward (dQ by fp32 reduce-add); time it beside the two-pass one")
    parser.add_argument("--cases", type=int, nargs=2, help="(internal) run the checks of GRID[a:b] here")
    parser.add_argument("--phase", choices=("time", "sweep"), help="(internal) run the timings in this process")
    parser.add_argument("--budget", type=float, help="(internal) seconds for new timings")
    args = parser.parse_args()
    global BUDGET_S, DQ_ATOMIC
    DQ_ATOMIC = args.dq_atomic
    atomic_flag = ["--dq-atomic"] if DQ_ATOMIC else []
    if args.budget is not None:
        BUDGET_S = args.budget
    grid = GRID_ATOMIC if DQ_ATOMIC else GRID
    if args.cases is not None:
        for case in grid[args.cases[0]:args.cases[1]]:
            for dtype in (jnp.bfloat16, jnp.float16):
                check(case, dtype)
        return
    if args.phase == "time":
        timings()
        return
    if args.phase == "sweep":
        sweep()
        return
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    num_cases = 2 if args.sweep else len(grid)
    per_process, timeout_s = (2, 130) if DQ_ATOMIC else (CASES_PER_PROCESS, CASE_TIMEOUT_S)
    chunks = [(i, min(i + per_process, num_cases)) for i in range(0, num_cases, per_process)]
    counts = [_child(["--cases", str(a), str(b), *atomic_flag], timeout_s) for a, b in chunks]
    passed = sum(c[0] for c in counts if c is not None)
    failed = sum(c[1] for c in counts if c is not None)
    cut = sum(c is None for c in counts)
    print(f"CHECK SUMMARY {passed}/{2 * num_cases} passed, {failed} failed, {cut} process(es) cut by the timeout "
          f"({elapsed():.0f}s)", flush=True)
    if failed or not passed:
        print("not timing: some checks failed", flush=True)
        return
    if args.sweep or not args.no_time:
        left = max(30.0, TOTAL_S - elapsed())
        _child(["--phase", "sweep" if args.sweep else "time", "--budget", str(left - 45), *atomic_flag], left,
               capture=False)
    print(f"done in {elapsed():.0f}s", flush=True)


if __name__ == "__main__":
    main()
