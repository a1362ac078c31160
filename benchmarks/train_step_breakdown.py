"""Where a training step of the trainer's `small` preset spends its time, on the GPU (issue 4's 2x bar).

  PYTHONPATH=. python benchmarks/train_step_breakdown.py [--seq-len 4096] [--batch-size 4]

Times the jitted train step (forward, backward, AdamW update) of the `small` GPT at the given context with
three attentions: "flash" (what the trainer runs), "dense" (XLA), and "none" (attention replaced by
returning the values: the cost of everything but attention). Prints ms per step (median of 20 steps, each
synchronised), tokens/s, and XLA's cost analysis of each compiled step (FLOPs, bytes accessed), so that
flash/dense and the non-attention share can be read off one run.
"""
import argparse
import dataclasses
import statistics
import time

import jax

from train import data as data_lib
from train.config import PRESETS
from train.loop import init_model, make_optimizer, make_steps


def values_only(query, key, value, **_):
    """An attention_fn that skips attention: the step's cost without it (shapes and dtypes as flash's)."""
    del query, key
    return value


def time_step(cfg, attention, steps=20):
    dataset = data_lib.make_dataset(cfg)
    graphdef, params, rest = init_model(cfg, attention)
    tx = make_optimizer(cfg)
    opt_state = tx.init(params)
    train_step, _ = make_steps(graphdef, tx)
    batch = dataset.train_batch(0)
    compiled = train_step.lower(params, opt_state, rest, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    batches = [jax.device_put(dataset.train_batch(i)) for i in range(steps + 3)]
    times = []
    for i, b in enumerate(batches):
        start = time.perf_counter()
        params, opt_state, rest, metrics = compiled(params, opt_state, rest, b)
        jax.block_until_ready(metrics["loss"])
        if i >= 3:
            times.append(time.perf_counter() - start)
    ms = 1e3 * statistics.median(times)
    tokens = cfg.batch_size * cfg.seq_len
    flops = (cost or {}).get("flops", float("nan"))
    bytes_accessed = (cost or {}).get("bytes accessed", float("nan"))
    print(f"STEP attention={attention if isinstance(attention, str) else 'none'} seq={cfg.seq_len} "
          f"batch={cfg.batch_size}: {ms:.2f} ms/step (min {1e3 * min(times):.2f}), {tokens / ms * 1e3:,.0f} tokens/s; "
          f"XLA cost: {flops / 1e12:.2f} TFLOP, {bytes_accessed / 1e9:.2f} GB accessed", flush=True)
    return ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    cfg = dataclasses.replace(PRESETS["small"], seq_len=args.seq_len, batch_size=args.batch_size)
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    results = {name: time_step(cfg, attention) for name, attention in
               (("flash", "flash"), ("dense", "dense"), ("none", values_only))}
    print(f"SUMMARY flash/dense speed-up {results['dense'] / results['flash']:.2f}x; without attention "
          f"{results['none']:.2f} ms: attention takes {results['flash'] - results['none']:.2f} ms (flash) and "
          f"{results['dense'] - results['none']:.2f} ms (dense) of a step", flush=True)


if __name__ == "__main__":
    jax.numpy.zeros(())  # initialise the backend before timing
    main()
