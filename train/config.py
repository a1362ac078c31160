"""Training configuration: a frozen dataclass over a model preset, presets, and a command line made from it.

Every field is a flag (`--steps 50`, `--seq_len 256`, `--model.num_layers 4`; dashes work too). Two model
fields are not flags because the trainer sets them: `attention` (from `--attention`) and `max_seq_len` (the
context the run trains at, `--seq_len`, or a probe's context in the longest-context search).
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import types
import typing

from models.gpt import PRESETS as MODEL_PRESETS
from models.gpt import GPTConfig
from train.data import SLOT_LEN, VOCAB_SIZE

ATTENTIONS = ("flash", "dense", "both")
BUILTIN_DATA = ("stdlib", "recall")
TRAINER_SET_MODEL_FIELDS = ("attention", "max_seq_len")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    name: str = "tiny"                  # run name; outputs go to runs/<name> unless run_dir is set
    model: GPTConfig = GPTConfig()
    data: str = "stdlib"                # "stdlib", "recall" or a path to a text file
    seq_len: int = 128                  # training context
    batch_size: int = 16
    steps: int = 200
    learning_rate: float = 2e-3         # peak, after linear warm-up; cosine decay to min_lr_ratio * peak
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1           # on matrices only (ndim >= 2), not on norm scales
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0              # global-norm clipping
    eval_every: int = 50                # 0: evaluate only at the end
    eval_tokens: int = 16384            # validation tokens per evaluation (the same tokens every time)
    log_every: int = 10
    checkpoint_every: int = 100         # 0: no checkpoints
    keep_checkpoints: int = 2
    resume: bool = False                # continue from the latest checkpoint in run_dir
    seed: int = 0                       # parameters, data order and dropout
    attention: str = "flash"            # "flash", "dense" or "both" (train both, write a comparison report)
    find_max_context: bool = False      # also search the longest trainable context (always on with "both")
    max_context: int = 1024             # the search doubles the context from seq_len up to this
    search_batch_size: int = 1
    run_dir: str = ""
    progress: bool = True               # tqdm progress bar
    corpus_bytes: int = 4_000_000       # stdlib corpus size; 0: all of it
    val_fraction: float = 0.05
    recall_doc_len: int = 4096          # recall task (train/data.py): tokens per document, in 2-token slots
    recall_num_keys: int = 4            # keys per document
    recall_values_per_key: int = 16     # value symbols of each key: a value out of sight is a 1-in-16 guess
    recall_fact_probability: float = 1 / 64  # chance a slot is a fact, not filler: a key's showings are
                                        # 4 * 64 slots (512 tokens) apart on average
    recall_far_distance: int = 1024     # recall task: values bound further back than this score as "far"

    def __post_init__(self):
        def require(ok, field, message):
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r}: {message}")

        if not isinstance(self.model, GPTConfig):
            raise TypeError(f"model must be a GPTConfig, got {type(self.model).__name__}")
        for field in ("seq_len", "batch_size", "steps", "eval_tokens", "log_every", "keep_checkpoints",
                      "search_batch_size", "recall_doc_len"):
            require(isinstance(getattr(self, field), int) and getattr(self, field) >= 1, field,
                    "must be a positive integer")
        for field in ("warmup_steps", "eval_every", "checkpoint_every", "corpus_bytes", "max_context", "seed"):
            require(isinstance(getattr(self, field), int) and getattr(self, field) >= 0, field,
                    "must be a non-negative integer")
        require(self.seq_len >= 2, "seq_len", "must be at least 2")
        require(self.warmup_steps < self.steps, "warmup_steps", f"must be less than steps={self.steps}")
        require(self.learning_rate > 0, "learning_rate", "must be positive")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        require(self.weight_decay >= 0, "weight_decay", "must be non-negative")
        require(0 <= self.b1 < 1, "b1", "must be in [0, 1)")
        require(0 <= self.b2 < 1, "b2", "must be in [0, 1)")
        require(self.grad_clip > 0, "grad_clip", "must be positive")
        require(0 < self.val_fraction < 1, "val_fraction", "must be in (0, 1)")
        require(self.attention in ATTENTIONS, "attention", f"must be one of {ATTENTIONS}")
        require(self.data in BUILTIN_DATA or pathlib.Path(self.data).is_file(), "data",
                f"must be one of {BUILTIN_DATA} or the path of an existing text file")
        for field in ("recall_num_keys", "recall_values_per_key"):
            require(isinstance(getattr(self, field), int) and getattr(self, field) >= 1, field,
                    "must be a positive integer")
        require(1 + self.recall_num_keys * (1 + self.recall_values_per_key) <= VOCAB_SIZE, "recall_num_keys",
                f"with recall_values_per_key={self.recall_values_per_key} needs more than {VOCAB_SIZE} tokens")
        require(0 < self.recall_fact_probability <= 1, "recall_fact_probability", "must be in (0, 1]")
        require(isinstance(self.recall_far_distance, int) and self.recall_far_distance >= 1, "recall_far_distance",
                "must be a positive integer")
        require(self.recall_doc_len % SLOT_LEN == 0, "recall_doc_len", f"must be a multiple of the slot length {SLOT_LEN}")
        if self.model.vocab_size < 256:
            raise ValueError(f"model.vocab_size={self.model.vocab_size}: must be at least 256 for byte-level data")
        for field in TRAINER_SET_MODEL_FIELDS:
            if getattr(self.model, field) != getattr(GPTConfig(), field):
                raise ValueError(f"model.{field} is set by the trainer (--attention, --seq_len); leave it at "
                                 f"its default {getattr(GPTConfig(), field)!r}")

    @property
    def output_dir(self) -> pathlib.Path:
        return pathlib.Path(self.run_dir or f"runs/{self.name}")

    def model_config(self, attention: str, seq_len: int | None = None) -> GPTConfig:
        """The model this run trains: the preset with the attention and context filled in."""
        return dataclasses.replace(self.model, attention=attention, max_seq_len=seq_len or self.seq_len)


def _model(preset: str, **overrides) -> GPTConfig:
    base = dataclasses.replace(MODEL_PRESETS[preset], attention=GPTConfig().attention,
                               max_seq_len=GPTConfig().max_seq_len)
    return dataclasses.replace(base, **overrides)


PRESETS: dict[str, TrainConfig] = {
    # CPU, about a minute and a half on two cores: the README's main job.
    "tiny": TrainConfig(name="tiny", model=_model("tiny", num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128,
                                                  mlp_dim=256), seq_len=128, batch_size=16, steps=200,
                        max_context=512),
    # GPU: flash vs dense at 4k context on the stdlib corpus. The search doubles up to 64x the context: on the
    # H100 dense's longest is 8k (16k out of memory, train/results/2026-11-23-h100-run4-hopper), so 16x needs flash
    # at 128k and 32x at 256k (a 131k step planned 14 GB, one step ~1.2 s; 256k ~28 GB, ~5 s).
    "small": TrainConfig(name="small", model=_model("small", dtype="bfloat16"), seq_len=4096, batch_size=4,
                         steps=200, learning_rate=1e-3, warmup_steps=20, eval_every=100, eval_tokens=65536,
                         corpus_bytes=0, max_context=262144, progress=False),
    # GPU: the long-range recall task with the defaults above; compare --seq_len 1024 --batch_size 32 with the
    # default 4096 x 8 (the same 33M tokens, 1,000 steps of 32,768, and the same 2M validation tokens: ~1,400
    # answers whose key was last shown more than 1k tokens back). On the H100 each run takes ~40 s (8.4-9.5M
    # tokens/s; train/results/2026-11-23-h100-run7-onehot); the 4k run recalled far answers at 99.7% by step 500
    # and 100% at 1,000, the 1k run at chance (4.5%). It is the CPU comparison in train/results/2026-11-23-cpu-recall
    # scaled 8x: documents, contexts and the gaps between a key's showings 8x longer (facts 8x sparser), so a
    # context holds as many facts as there; its learning rate.
    "long": TrainConfig(name="long", model=_model("small", num_layers=2, num_heads=4, num_kv_heads=4,
                                                  embed_dim=256, mlp_dim=512, dtype="bfloat16"),
                        data="recall", seq_len=4096, batch_size=8, steps=1000, learning_rate=3e-3,
                        warmup_steps=60, eval_every=250, eval_tokens=2_097_152, max_context=4096,
                        progress=False),
}


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_optional_str(text: str) -> str | None:
    return None if text.lower() == "none" else text


def _converter(hint):
    """argparse `type` for a dataclass field's annotation (bool, int, float, str, `str | None`, unions)."""
    if hint is bool:
        return _parse_bool
    if hint in (int, float, str):
        return hint
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if type(None) in args:
            return _parse_optional_str
        return str   # e.g. `str | Callable`: only the string form exists on a command line
    raise TypeError(f"no command-line form for a field of type {hint!r}")


def _add_fields(parser: argparse.ArgumentParser, cls, prefix: str, skip=()):
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip or (dataclasses.is_dataclass(hints[field.name])):
            continue
        convert = _converter(hints[field.name])
        names = [f"--{prefix}{field.name}"]
        if "_" in field.name:
            names.append(f"--{prefix}{field.name.replace('_', '-')}")
        parser.add_argument(*names, dest=f"{prefix}{field.name}", type=convert, default=argparse.SUPPRESS,
                            metavar=field.name.upper(),
                            **({"nargs": "?", "const": True} if convert is _parse_bool else {}))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train", description="Train a byte-level GPT with flash or dense attention.",
        epilog="Every TrainConfig field is a flag; model fields are --model.<field>.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    _add_fields(parser, TrainConfig, "")
    _add_fields(parser, GPTConfig, "model.", skip=TRAINER_SET_MODEL_FIELDS)
    return parser


def parse_args(argv=None) -> TrainConfig:
    """The preset named by --preset with every other flag applied on top; errors name the field."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    preset = PRESETS[args.pop("preset")]
    model_overrides = {k.removeprefix("model."): v for k, v in args.items() if k.startswith("model.")}
    overrides = {k: v for k, v in args.items() if not k.startswith("model.")}
    if "name" not in overrides and "run_dir" not in overrides:
        overrides["name"] = preset.name
    try:
        model = dataclasses.replace(preset.model, **model_overrides)
        return dataclasses.replace(preset, model=model, **overrides)
    except (ValueError, TypeError) as err:
        parser.error(str(err))
