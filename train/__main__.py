"""`python -m train [--preset tiny|small|long] [--attention flash|dense|both] [--<field> VALUE ...]`."""

from __future__ import annotations

import dataclasses
import pathlib
import shlex
import sys

from train import loop, report
from train.config import choose_run_dir, parse_args

INTERRUPTED_EXIT = 130  # a shell's status for a program stopped by Ctrl-C (128 + SIGINT)
BOOLS = ("1", "true", "yes", "on", "0", "false", "no", "off")  # the values a bare --resume may be given


def resume_command(argv: list[str], run_dir: pathlib.Path) -> str:
    """The command line that resumes the run `argv` started in `run_dir`: its flags, that folder and --resume."""
    kept, after_resume, tokens = [], False, iter(argv)
    for token in tokens:
        flag = token.split("=", 1)[0]
        if flag in ("--run_dir", "--run-dir") and "=" not in token:
            next(tokens, None)
        elif not (flag in ("--run_dir", "--run-dir", "--resume") or after_resume and token.lower() in BOOLS):
            kept.append(token)
        after_resume = token == "--resume"
    return shlex.join(["python", "-m", "train", *kept, "--run_dir", str(run_dir), "--resume"])


def run_one(cfg, attention: str, run_dir: pathlib.Path) -> loop.RunResult:
    """Trains one attention in `run_dir` and writes its run.json and loss.png."""
    result = loop.train(cfg, attention, run_dir)
    report.write_run(run_dir, cfg, result)
    return result


def main(argv=None) -> None:
    """`python -m train`: exits 2 on a bad flag, mesh or run folder, 130 on Ctrl-C (after saying how to resume)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_args(argv)
    try:
        loop.make_mesh(cfg)  # more devices than there are is a bad flag, refused before any folder is made
        out = choose_run_dir(cfg)
    except ValueError as err:
        print(f"python -m train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    cfg = dataclasses.replace(cfg, run_dir=str(out))
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"run {cfg.name}: {cfg.attention} attention, data {cfg.data}, context {cfg.seq_len}, batch "
        f"{cfg.batch_size}, {cfg.steps} steps{f', mesh {cfg.mesh}' if cfg.mesh else ''} -> {out}",
        file=sys.stderr,
    )
    try:
        train_and_report(cfg, out)
    except KeyboardInterrupt as err:
        where = (
            f"after step {err.step} of {cfg.steps}; checkpoint saved in {err.run_dir / 'checkpoints'}"
            if isinstance(err, loop.TrainingInterrupted)
            else "without saving a checkpoint (a resume continues from the latest one, if any)"
        )
        print(f"\ninterrupted {where}. Resume with: {resume_command(argv, out)}", file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT) from None


def train_and_report(cfg, out: pathlib.Path) -> None:
    """Trains the run's attention(s) in `out`, writes its reports, and prints one line on the whole run."""
    if cfg.attention == "both":
        results = {a: run_one(cfg, a, out / a) for a in ("flash", "dense")}
        searches: dict = {}
        summary = report.write_comparison(out, cfg, results, searches)  # kept if the search is cut short
        for attention in ("flash", "dense") if cfg.max_context else ():
            searches[attention] = loop.find_max_context(cfg, attention)
            summary = report.write_comparison(out, cfg, results, searches)
        where = "; measured on CPU: not the GPU kernels' speed" if summary["backend"] == "cpu" else ""
        print(f"report: {out / 'report.md'} (speed-up {summary.get('speedup', float('nan')):.2f}x{where})")
        return
    result = run_one(cfg, cfg.attention, out)
    if cfg.find_max_context:
        report.write_run(out, cfg, result, loop.find_max_context(cfg, cfg.attention))
    last = result.evals[-1]
    resumed = f" in {len(result.sessions)} sessions" if len(result.sessions) > 1 else ""
    print(
        f"done: {result.steps[-1]} steps, {result.tokens:,} tokens, {result.wall_s:.0f} s{resumed}; train loss "
        f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}, val loss {last['val_loss']:.4f}, "
        f"{result.tokens_per_s or 0:,.0f} tokens/s -> {out}"
    )


if __name__ == "__main__":
    main()
