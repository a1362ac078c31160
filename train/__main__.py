"""`python -m train [--preset tiny|small|long] [--attention flash|dense|both] [--<field> VALUE ...]`."""
from __future__ import annotations

import sys

from train import loop, report
from train.config import parse_args


def main(argv=None) -> None:
    cfg = parse_args(argv)
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    print(f"run {cfg.name}: {cfg.attention} attention, data {cfg.data}, context {cfg.seq_len}, batch "
          f"{cfg.batch_size}, {cfg.steps} steps -> {out}", file=sys.stderr)
    if cfg.attention == "both":
        results = {a: loop.train(cfg, a, out / a) for a in ("flash", "dense")}
        searches: dict = {}
        summary = report.write_comparison(out, cfg, results, searches)   # kept if the search is cut short
        for attention in ("flash", "dense") if cfg.max_context else ():
            searches[attention] = loop.find_max_context(cfg, attention)
            summary = report.write_comparison(out, cfg, results, searches)
        print(f"report: {out / 'report.md'} (speed-up {summary.get('speedup', float('nan')):.2f}x)")
        return
    result = loop.train(cfg, cfg.attention, out)
    search = loop.find_max_context(cfg, cfg.attention) if cfg.find_max_context else None
    report.write_run(out, cfg, result, search)
    last = result.evals[-1]
    print(f"done: train loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, val loss {last['val_loss']:.4f}, "
          f"{result.tokens_per_s or 0:,.0f} tokens/s, {result.wall_s:.0f} s")


if __name__ == "__main__":
    main()
