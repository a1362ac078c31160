"""Speed of the Hopper kernels with a local window, per-example lengths and segment ids (issue 8), beside the
portable kernels (what `implementation=None` ran for these calls before) and cuDNN where `jax.nn` takes the
same mask; and the portable dbias kernel's band skipping (a causal bias gradient against a full one).

  PYTHONPATH=. python -m benchmarks.hopper_masks --out DIR [--budget S] [--only NAME,...] [--head_dims 128,64]

bf16, B*N = 16k tokens, H*D = 2048 (the anchor shapes), N = 8192. Each line: the scenario, the pass (fwd or
fwd+bwd = grad of <out, ct> in q, k, v), ms (median of `benchmarks.attention.median_ms`), useful TFLOP/s (4*D
per visible (query, key) pair per head, x3.5 for fwd+bwd, counted on the host from the mask), and cuDNN's ms /
ours where cuDNN ran. Every line also goes to DIR/hopper_masks.jsonl with the environment.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from benchmarks.attention import environment, median_ms

N, TOKENS, WIDTH = 8192, 16384, 2048


def scenarios(head_dim: int):
    """(name, flash_attention kwargs, jax.nn kwargs or None where jax.nn has no equivalent)."""
    batch = TOKENS // N
    half = jnp.array([N, N // 2][:batch] + [N] * (batch - 2), jnp.int32)
    packed = jnp.repeat(jnp.arange(4, dtype=jnp.int32), N // 4)[None].repeat(batch, 0)  # 4 documents each
    lengths = dict(query_seq_lengths=half, key_value_seq_lengths=half)
    return [
        ("causal", dict(is_causal=True), dict(is_causal=True)),
        ("causal_window1024", dict(is_causal=True, local_window_size=(1024, 0)),
         dict(is_causal=True, local_window_size=(1024, 0))),
        ("window512x512", dict(local_window_size=(512, 512)), dict(local_window_size=(512, 512))),
        ("lengths_full_half", dict(lengths), dict(lengths)),
        ("causal_lengths_full_half", dict(lengths, is_causal=True), dict(lengths, is_causal=True)),
        ("causal_4_packed_docs", dict(is_causal=True, segment_ids=packed), None),
    ]


def visible_pairs(kwargs, batch: int) -> int:
    """(query, key) pairs the mask lets through, summed over the batch (per head)."""
    from pallas_flash import api, masks
    q = jax.ShapeDtypeStruct((batch, N, 1, 64), jnp.bfloat16)
    q_ids, kv_ids = api._segments(q, q, kwargs.get("segment_ids"), None, kwargs.get("query_seq_lengths"),
                                  kwargs.get("key_value_seq_lengths"))
    band = masks.Band.of(kwargs.get("is_causal", False), kwargs.get("local_window_size"))
    pos = np.arange(N)
    total = 0
    for b in range(batch):
        ids = {} if q_ids is None else dict(q_segment=np.asarray(q_ids[b])[:, None],
                                            kv_segment=np.asarray(kv_ids[b])[None, :])
        seen = masks.visible(pos[:, None], pos[None, :], band=band, **ids)
        total += N * N if seen is None else int(np.asarray(seen).sum())
    return total


def timed(fn, args):
    ms, _, _, _ = median_ms(jax.jit(fn), args, reps=7, min_sample_s=0.05)
    return ms


def run(out_dir: str, budget_s: float, only=None, head_dims=(128, 64)):
    start = time.perf_counter()
    env = environment()
    os.makedirs(out_dir, exist_ok=True)
    log = open(os.path.join(out_dir, "hopper_masks.jsonl"), "a")

    def emit(record):
        record = dict(record, **env, n=N)
        log.write(json.dumps(record) + "\n")
        log.flush()
        print(json.dumps({k: record[k] for k in record if k not in env}), flush=True)

    for head_dim in head_dims:
        batch, heads = TOKENS // N, WIDTH // head_dim
        keys = jax.random.split(jax.random.key(head_dim), 2)
        arg_sets = []
        for key in keys:
            q, k, v, ct = (jax.random.normal(kk, (batch, N, heads, head_dim), jnp.bfloat16)
                           for kk in jax.random.split(key, 4))
            arg_sets.append((q, k, v, ct))
        for name, ours, theirs in scenarios(head_dim):
            if only and name not in only:
                continue
            flops = 4.0 * head_dim * heads * visible_pairs(ours, batch)
            impls = {"mosaic": functools.partial(pf.flash_attention, implementation="mosaic", **ours),
                     "pallas": functools.partial(pf.flash_attention, implementation="pallas", **ours)}
            if theirs is not None:
                impls["cudnn"] = functools.partial(jax.nn.dot_product_attention, implementation="cudnn", **theirs)
            results = {}
            for pass_ in ("fwd", "fwdbwd"):
                for impl, attend in impls.items():
                    if time.perf_counter() - start > budget_s:
                        print(f"skipped {name} {pass_} {impl}: time budget", flush=True)
                        continue
                    if pass_ == "fwd":
                        fn = lambda q, k, v, ct, attend=attend: attend(q, k, v)
                    else:
                        fn = jax.grad(lambda q, k, v, ct, attend=attend: jnp.vdot(
                            attend(q, k, v).astype(jnp.float32), ct.astype(jnp.float32)), argnums=(0, 1, 2))
                    try:
                        ms = timed(fn, arg_sets)
                    except Exception as exc:  # recorded, not fatal: the other lines still run
                        emit(dict(scenario=name, head_dim=head_dim, impl=impl, pass_=pass_, error=repr(exc)[:300]))
                        continue
                    results[(pass_, impl)] = ms
                    tflops = flops * (3.5 if pass_ == "fwdbwd" else 1.0) / ms / 1e9
                    emit(dict(scenario=name, head_dim=head_dim, impl=impl, pass_=pass_, ms=round(ms, 4),
                              useful_tflops=round(tflops, 1), density=round(flops / (4.0 * head_dim * heads *
                                                                                     batch * N * N), 4)))
            for pass_ in ("fwd", "fwdbwd"):  # ratios once all three ran (cuDNN runs last)
                cudnn = results.get((pass_, "cudnn"))
                for impl in ("mosaic", "pallas"):
                    if cudnn and (pass_, impl) in results:
                        print(f"RATIO {name} D={head_dim} {pass_} {impl}/cudnn {cudnn / results[(pass_, impl)]:.3f}x",
                              flush=True)
                if (pass_, "mosaic") in results and (pass_, "pallas") in results:
                    print(f"RATIO {name} D={head_dim} {pass_} mosaic/pallas speedup "
                          f"{results[(pass_, 'pallas')] / results[(pass_, 'mosaic')]:.2f}x", flush=True)

    # The dbias kernel skips tiles outside the band: a causal bias gradient should take about half the time
    # of a full one (the other kernels halve too).
    head_dim, batch, heads = 128, TOKENS // N, WIDTH // 128
    bias = jax.random.normal(jax.random.key(1), (1, heads, N, N), jnp.bfloat16)
    q, k, v, ct = (jax.random.normal(kk, (batch, N, heads, head_dim), jnp.bfloat16)
                   for kk in jax.random.split(jax.random.key(3), 4))
    for causal in (False, True):
        if only and f"bias_{'causal' if causal else 'full'}" not in only:
            continue
        if time.perf_counter() - start > budget_s:
            print(f"skipped dbias causal={causal}: time budget", flush=True)
            continue
        grad = jax.grad(lambda q, k, v, bias, ct, causal=causal: jnp.vdot(
            pf.flash_attention(q, k, v, bias=bias, is_causal=causal, implementation="pallas").astype(jnp.float32),
            ct.astype(jnp.float32)), argnums=(0, 1, 2, 3))
        ms = timed(grad, [(q, k, v, bias, ct)])
        emit(dict(scenario=f"bias_{'causal' if causal else 'full'}", head_dim=head_dim, impl="pallas",
                  pass_="fwdbwd_with_dbias", ms=round(ms, 4)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=480.0, help="start no new measurement after S seconds")
    parser.add_argument("--only", default="", help="comma list of scenario names (bias_full, bias_causal too)")
    parser.add_argument("--head_dims", default="128,64", help="comma list")
    args = parser.parse_args()
    run(args.out, args.budget, [name for name in args.only.split(",") if name],
        tuple(int(d) for d in args.head_dims.split(",")))


if __name__ == "__main__":
    main()
