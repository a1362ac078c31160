"""`python -m train.sample --checkpoint RUN_DIR --prompt "def " --max-new-tokens 200`: text from a trained run.

RUN_DIR is a run folder of `python -m train` (runs/<preset>/<time>/, holding config.json and checkpoints/), its
checkpoints/ folder, or a `--attention both` folder (its flash/ run is used). The prompt is encoded as UTF-8
bytes (the trainer's byte vocabulary); generation runs `GPT.generate` with a KV cache (a jitted prefill, then
the decode loop under one jit). The prompt and its continuation go to stdout; compile time and the prefill's
and the decode's tokens/s, each timed to completion, go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import jax
from flax import nnx

from models import generate
from models.gpt import GPT, GPTConfig
from train.checkpoint import Checkpointer
from train.config import TrainConfig


def find_run(path: pathlib.Path) -> pathlib.Path:
    """The run folder (with config.json and checkpoints/) that `path` names."""
    for candidate in (path, path.parent if path.name == "checkpoints" else None, path / "flash"):
        if candidate is not None and (candidate / "config.json").is_file() and (candidate / "checkpoints").is_dir():
            return candidate
    raise ValueError(
        f"{path} is not a run folder of `python -m train` (config.json and checkpoints/), nor its checkpoints/ folder"
    )


def load_model(run_dir: pathlib.Path, step: int | None = None) -> tuple[GPT, dict, int]:
    """(the run's GPT with its checkpointed parameters, its config.json, the checkpoint's step)."""
    record = json.loads((run_dir / "config.json").read_text())
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    model_cfg = GPTConfig(**{k: v for k, v in record["model"].items() if k in fields})
    # The checkpoint holds the optimizer state too: restore it whole, shaped like a fresh one (its shape
    # depends on the parameters only).
    params_key, dropout_key = jax.random.split(jax.random.key(record.get("seed", 0)))
    graphdef, params, rest = nnx.split(
        GPT(model_cfg, rngs=nnx.Rngs(params=params_key, dropout=dropout_key)), nnx.Param, ...
    )
    from train.loop import make_optimizer

    opt_state = make_optimizer(TrainConfig()).init(params)
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=1 << 30)
    try:
        step = checkpointer.latest_step() if step is None else step
        state, _ = checkpointer.restore({"params": params, "opt_state": opt_state, "rest": rest}, step)
    finally:
        checkpointer.close()
    return nnx.merge(graphdef, state["params"], state["rest"]), record, step


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.sample", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--checkpoint",
        required=True,
        type=pathlib.Path,
        help="run folder of python -m train (runs/<preset>/<time>/), or its checkpoints/ folder",
    )
    add("--prompt", default="\n", help="text to continue, as UTF-8 bytes (default: a newline)")
    add(
        "--max-new-tokens",
        "--max_new_tokens",
        type=int,
        default=None,
        help="tokens to generate (default: 200, or fewer if the run's context ends sooner)",
    )
    add("--temperature", type=float, default=0.8, help="sampling temperature; 0: greedy (default: 0.8)")
    add("--top-k", "--top_k", type=int, default=None, help="sample among the k most likely tokens (default: all)")
    add("--seed", type=int, default=0, help="sampling seed (default: 0)")
    add("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    add("--page-size", "--page_size", type=int, default=None, help="use a paged KV cache with pages of this size")
    add("--eos", type=int, default=None, help="a byte that ends the text once generated, e.g. 10 (default: none)")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run_dir = find_run(args.checkpoint)
    except ValueError as err:
        parser.error(str(err))
    model, record, step = load_model(run_dir, args.step)
    prompt = list(args.prompt.encode("utf-8"))
    if not prompt:
        parser.error("--prompt must not be empty")
    room = model.config.max_seq_len - len(prompt)
    max_new = min(200, room) if args.max_new_tokens is None else args.max_new_tokens
    if max_new < 1 or max_new > room:
        parser.error(
            f"--max-new-tokens {max_new}: the run's context is {model.config.max_seq_len} tokens and the "
            f"prompt takes {len(prompt)}, so at most {room}"
        )
    stats: dict = {}
    try:
        tokens = generate.generate(
            model,
            prompt,
            max_new,
            temperature=args.temperature,
            top_k=args.top_k,
            rng=jax.random.key(args.seed),
            page_size=args.page_size,
            eos_token=args.eos,
            stats=stats,
        )
    except ValueError as err:
        parser.error(str(err))
    if args.eos is not None:  # the text ends with its eos byte
        tokens, length = tokens
        tokens = tokens[:length]
    print(args.prompt + bytes(tokens.tolist()).decode("utf-8", errors="replace"))
    prefill_rate = stats["prompt_tokens"] / stats["prefill_s"]
    decode_rate = stats["new_tokens"] / stats["decode_s"]
    print(
        f"{run_dir} step {step} ({record['attention']} attention, {model.config.dtype}, {jax.default_backend()}): "
        f"prefill {stats['prompt_tokens']} tokens in {stats['prefill_s'] * 1e3:.1f} ms ({prefill_rate:,.0f} "
        f"tokens/s); decode {stats['new_tokens']} tokens in {stats['decode_s'] * 1e3:.1f} ms ({decode_rate:,.0f} "
        f"tokens/s); compile {stats['compile_s']:.1f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
