"""Training configuration: a frozen dataclass over a model preset, presets, and a command line made from it.

Every field is a flag (`--steps 50`, `--seq_len 256`, `--model.num_layers 4`; dashes work too) whose
`--help` line is the field's one-line meaning, its default (the tiny preset's, and the other presets' where
they differ) and its choices. Four model fields are not flags because the trainer sets them: `attention` (from
`--attention`), `max_seq_len` (the context the run trains at, `--seq_len`, or a probe's context in the
longest-context search), `mesh` (the devices of `--mesh`) and `context_layout` (`--context_layout`, for flash
attention on a mesh); records leave the last two out, so a checkpoint resumes on any mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import types
import typing

from models.gpt import PRESETS as MODEL_PRESETS
from models.gpt import GPTConfig
from models.transformer import CONTEXT_AXIS, DATA_AXIS, MLPS, NORMS
from pallas_flash.api import IMPLEMENTATIONS
from pallas_flash.parallel import LAYOUTS
from train.data import SLOT_LEN, VOCAB_SIZE

ATTENTIONS = ("flash", "dense", "both")
BUILTIN_DATA = ("stdlib", "recall")
DTYPES = ("float32", "bfloat16", "float16")
TRAINER_SET_MODEL_FIELDS = ("attention", "max_seq_len", "mesh", "context_layout")
MESH_AXES = (DATA_AXIS, CONTEXT_AXIS)
RUNS_ROOT = pathlib.Path("runs")


def _field(default, help: str, choices: tuple[str, ...] = ()):
    """A config field with its one-line meaning (`help`) and, for an enum-like string, its `choices`."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What one `python -m train` run does; every field but `model` is a flag, and model fields are
    `--model.<field>`."""

    name: str = _field("tiny", "run name: outputs go to runs/<name>/<date>-<time>/ unless run_dir is set")
    model: GPTConfig = _field(GPTConfig(), "the GPT trained (its fields: --model.<field>)")
    data: str = _field(
        "stdlib",
        "training data: the Python standard library's sources, the synthetic recall "
        "task (train/data.py) or a text file's path",
        BUILTIN_DATA + ("PATH",),
    )
    seq_len: int = _field(128, "training context in tokens")
    batch_size: int = _field(16, "sequences per training step")
    steps: int = _field(200, "training steps of the whole run; a resumed run continues up to this")
    learning_rate: float = _field(2e-3, "peak learning rate, after linear warm-up; cosine decay to min_lr_ratio * peak")
    warmup_steps: int = _field(20, "steps of linear learning-rate warm-up from 0")
    min_lr_ratio: float = _field(0.1, "final learning rate as a fraction of the peak")
    weight_decay: float = _field(0.1, "AdamW weight decay, on matrices only (ndim >= 2): not on norm scales")
    b1: float = _field(0.9, "AdamW's first-moment decay rate")
    b2: float = _field(0.95, "AdamW's second-moment decay rate")
    grad_clip: float = _field(1.0, "global gradient-norm clipping threshold")
    eval_every: int = _field(50, "steps between validation evaluations; 0: evaluate only at the end")
    eval_tokens: int = _field(16384, "validation tokens per evaluation, the same tokens every time")
    log_every: int = _field(10, "steps between writes of the train loss and tokens/s to metrics.jsonl")
    checkpoint_every: int = _field(100, "steps between checkpoints; 0: none (Ctrl-C still saves one)")
    keep_checkpoints: int = _field(2, "how many of the newest checkpoints to keep")
    resume: bool = _field(
        False, "continue the run in run_dir (without run_dir: the newest run of this name) from its latest checkpoint"
    )
    seed: int = _field(0, "seed of the parameters, data order and dropout")
    mesh: str | None = _field(
        None,
        "devices to train on, data=D,context=C (D*C devices; an axis left out is 1): each batch split over D, "
        "each sequence over C by ring attention (batch_size a multiple of D, seq_len of C); none: one device",
        ("data=D,context=C",),
    )
    context_layout: str = _field(
        "zigzag",
        "order of each sequence on the mesh's context axis (flash attention; dense keeps natural order): zigzag "
        "gives every device the same causal work (device r holds chunks r and 2C-1-r of 2C), contiguous the r-th slice",
        LAYOUTS,
    )
    attention: str = _field(
        "flash", "attention to train with; both: flash and dense on the same data, then a comparison report", ATTENTIONS
    )
    find_max_context: bool = _field(
        False, "also search the longest trainable context; always on with --attention both unless max_context is 0"
    )
    max_context: int = _field(1024, "the context search doubles the context from seq_len up to this")
    search_batch_size: int = _field(1, "batch size of the context search's probe steps")
    run_dir: str = _field(
        "", "output folder, which must be new or empty unless resuming; empty: a new runs/<name>/<date>-<time>/"
    )
    progress: bool = _field(True, "show a tqdm progress bar")
    corpus_bytes: int = _field(4_000_000, "stdlib corpus size in bytes; 0: all of it")
    val_fraction: float = _field(0.05, "fraction of the data held out for validation")
    recall_doc_len: int = _field(4096, "recall task (train/data.py): tokens per document, in 2-token slots")
    recall_num_keys: int = _field(4, "recall task: keys per document")
    recall_values_per_key: int = _field(
        16, "recall task: value symbols of each key; a value out of sight is a guess among them"
    )
    # With the default 4 keys, a key's showings are 4 * 64 slots (512 tokens) apart on average.
    recall_fact_probability: float = _field(1 / 64, "recall task: chance a slot is a fact, not filler")
    recall_far_distance: int = _field(1024, "recall task: values bound further back than this many tokens score as far")

    def __post_init__(self):
        def require(ok, field, message):
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r}: {message}")

        if not isinstance(self.model, GPTConfig):
            raise TypeError(f"model must be a GPTConfig, got {type(self.model).__name__}")
        for field in (
            "seq_len",
            "batch_size",
            "steps",
            "eval_tokens",
            "log_every",
            "keep_checkpoints",
            "search_batch_size",
            "recall_doc_len",
        ):
            require(
                isinstance(getattr(self, field), int) and getattr(self, field) >= 1, field, "must be a positive integer"
            )
        for field in ("warmup_steps", "eval_every", "checkpoint_every", "corpus_bytes", "max_context", "seed"):
            require(
                isinstance(getattr(self, field), int) and getattr(self, field) >= 0,
                field,
                "must be a non-negative integer",
            )
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
        require(self.context_layout in LAYOUTS, "context_layout", f"must be one of {LAYOUTS}")
        require(
            self.data in BUILTIN_DATA or pathlib.Path(self.data).is_file(),
            "data",
            f"must be one of {BUILTIN_DATA} or the path of an existing text file",
        )
        for field in ("recall_num_keys", "recall_values_per_key"):
            require(
                isinstance(getattr(self, field), int) and getattr(self, field) >= 1, field, "must be a positive integer"
            )
        require(
            1 + self.recall_num_keys * (1 + self.recall_values_per_key) <= VOCAB_SIZE,
            "recall_num_keys",
            f"with recall_values_per_key={self.recall_values_per_key} needs more than {VOCAB_SIZE} tokens",
        )
        require(0 < self.recall_fact_probability <= 1, "recall_fact_probability", "must be in (0, 1]")
        require(
            isinstance(self.recall_far_distance, int) and self.recall_far_distance >= 1,
            "recall_far_distance",
            "must be a positive integer",
        )
        require(
            self.recall_doc_len % SLOT_LEN == 0, "recall_doc_len", f"must be a multiple of the slot length {SLOT_LEN}"
        )
        if self.mesh is not None:
            shape = parse_mesh(self.mesh)  # a malformed mesh raises naming the field
            require(
                self.batch_size % shape[DATA_AXIS] == 0,
                "batch_size",
                f"must be a multiple of mesh data={shape[DATA_AXIS]}",
            )
            shards = shape[CONTEXT_AXIS]
            chunks = 2 * shards if self.context_layout == "zigzag" and shards > 1 else shards
            require(
                self.seq_len % chunks == 0,
                "seq_len",
                f"must be a multiple of {chunks} (mesh context={shards}, context_layout {self.context_layout})",
            )
        if self.model.vocab_size < 256:
            raise ValueError(f"model.vocab_size={self.model.vocab_size}: must be at least 256 for byte-level data")
        for field in TRAINER_SET_MODEL_FIELDS:
            if getattr(self.model, field) != getattr(GPTConfig(), field):
                raise ValueError(
                    f"model.{field} is set by the trainer (--attention, --seq_len, --mesh, --context_layout); "
                    f"leave it at its default {getattr(GPTConfig(), field)!r}"
                )

    @property
    def mesh_shape(self) -> dict[str, int]:
        """{"data": D, "context": C} of `mesh`; one device on each axis without one."""
        return parse_mesh(self.mesh) if self.mesh is not None else dict.fromkeys(MESH_AXES, 1)

    def model_config(self, attention: str, seq_len: int | None = None, mesh=None) -> GPTConfig:
        """The model this run trains: the preset with the attention, context, device mesh and (flash on a mesh)
        the context layout filled in."""
        layout = self.context_layout if mesh is not None and attention == "flash" else "contiguous"
        return dataclasses.replace(
            self.model, attention=attention, max_seq_len=seq_len or self.seq_len, mesh=mesh, context_layout=layout
        )

    def model_record(self, attention: str) -> dict:
        """The model as JSON, as records and checkpoints hold it: without the mesh, which `mesh` records, so a
        checkpoint continues on any mesh."""
        record = to_json(dataclasses.asdict(self.model_config(attention)))
        del record["mesh"], record["context_layout"]
        return record

    def run_record(self, attention: str, run_dir: pathlib.Path | str) -> dict:
        """This config as JSON, as the run with one `attention` in `run_dir` ran it (model fields filled in)."""
        return {
            **to_json(dataclasses.asdict(self)),
            "attention": attention,
            "run_dir": str(run_dir),
            "model": self.model_record(attention),
        }


def parse_mesh(text: str) -> dict[str, int]:
    """{"data": D, "context": C} of a --mesh value "data=D,context=C"; an axis left out is 1."""
    shape = dict.fromkeys(MESH_AXES, 1)
    named = set()
    for part in text.split(","):
        name, _, size = part.strip().partition("=")
        if name not in MESH_AXES or name in named or not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"mesh={text!r}: must be data=D,context=C with positive integers (each axis once; one left out is 1)"
            )
        named.add(name)
        shape[name] = int(size)
    return shape


def to_json(value):
    """`value` as plain JSON types; what JSON cannot hold (a callable attention) becomes its repr."""
    return json.loads(json.dumps(value, default=repr))


_STAMP_FORMAT = "%Y%m%d-%H%M%S"


def _stamp_key(path: pathlib.Path) -> tuple[datetime.datetime, int] | None:
    """(time, suffix) of a run folder named <date>-<time>[-n] by `choose_run_dir`; None for other names."""
    stamp, separator, suffix = path.name[:15], path.name[15:16], path.name[16:]
    try:
        key = datetime.datetime.strptime(stamp, _STAMP_FORMAT), int(suffix or 1)
    except ValueError:
        return None
    return key if separator == "-" or not (separator or suffix) else None


def choose_run_dir(cfg: TrainConfig, now: datetime.datetime | None = None) -> pathlib.Path:
    """The folder a run writes: `run_dir` if set, else a new runs/<name>/<date>-<time>[-n]/, one per run.

    A fresh run never writes into an earlier run's folder: a `run_dir` that holds files is refused. With
    `resume` the folder must hold a run: `run_dir`, or without it the newest runs/<name>/<date>-<time>/.
    """
    if cfg.run_dir:
        out = pathlib.Path(cfg.run_dir)
        if cfg.resume and not (out.is_dir() and any(out.iterdir())):
            raise ValueError(f"run_dir={cfg.run_dir!r}: no run to resume there")
        if not cfg.resume and out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(
                f"run_dir={cfg.run_dir!r}: already holds files (an earlier run?); add --resume to "
                "continue that run, or name a new or empty folder"
            )
        return out
    base = RUNS_ROOT / cfg.name
    runs = sorted((p for p in base.glob("*") if p.is_dir() and _stamp_key(p)), key=_stamp_key)
    if cfg.resume:
        if not runs:
            raise ValueError(f"resume=True: no run of name {cfg.name!r} in {base} to resume; pass its --run_dir")
        return runs[-1]
    stamp = (now or datetime.datetime.now()).strftime(_STAMP_FORMAT)
    out, n = base / stamp, 1
    while out.exists():
        n += 1
        out = base / f"{stamp}-{n}"
    return out


def _model(preset: str, **overrides) -> GPTConfig:
    base = dataclasses.replace(
        MODEL_PRESETS[preset], attention=GPTConfig().attention, max_seq_len=GPTConfig().max_seq_len
    )
    return dataclasses.replace(base, **overrides)


PRESETS: dict[str, TrainConfig] = {
    # CPU, about a minute and a half on two cores: the README's main job.
    "tiny": TrainConfig(
        name="tiny",
        model=_model("tiny", num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128, mlp_dim=256),
        seq_len=128,
        batch_size=16,
        steps=200,
        max_context=512,
    ),
    # GPU: flash vs dense at 4k context on the stdlib corpus. The search doubles up to 64x the context: on the
    # H100 dense's longest is 8k (16k out of memory; train/results/speed), so 16x needs flash
    # at 128k and 32x at 256k (a 131k step planned 14 GB, one step ~1.2 s; 256k ~28 GB, ~5 s).
    "small": TrainConfig(
        name="small",
        model=_model("small", dtype="bfloat16"),
        seq_len=4096,
        batch_size=4,
        steps=200,
        learning_rate=1e-3,
        warmup_steps=20,
        eval_every=100,
        eval_tokens=65536,
        corpus_bytes=0,
        max_context=262144,
        progress=False,
    ),
    # GPU: the long-range recall task with the defaults above; compare --seq_len 1024 --batch_size 32 with the
    # default 4096 x 8 (the same 33M tokens, 1,000 steps of 32,768, and the same 2M validation tokens: ~1,400
    # answers whose key was last shown more than 1k tokens back). On the H100 each run takes ~40 s (8.4-9.5M
    # tokens/s; train/results/recall); the 4k run recalled far answers at 99.7% by step 500
    # and 100% at 1,000, the 1k run at chance (4.5%). It is the CPU comparison in train/results/cpu_recall
    # scaled 8x: documents, contexts and the gaps between a key's showings 8x longer (facts 8x sparser), so a
    # context holds as many facts as there; its learning rate.
    "long": TrainConfig(
        name="long",
        model=_model("small", num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=256, mlp_dim=512, dtype="bfloat16"),
        data="recall",
        seq_len=4096,
        batch_size=8,
        steps=1000,
        learning_rate=3e-3,
        warmup_steps=60,
        eval_every=250,
        eval_tokens=2_097_152,
        max_context=4096,
        progress=False,
    ),
}
DEFAULT_PRESET = "tiny"


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_optional_str(text: str) -> str | None:
    return None if text.lower() == "none" else text


def _parse_optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _converter(hint):
    """argparse `type` for a dataclass field's annotation (bool, int, float, str, `int | None`, `str | None`,
    unions)."""
    if hint is bool:
        return _parse_bool
    if hint in (int, float, str):
        return hint
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if type(None) in args:
            return _parse_optional_int if int in args else _parse_optional_str
        return str  # e.g. `str | Callable`: only the string form exists on a command line
    raise TypeError(f"no command-line form for a field of type {hint!r}")


# The one-line meaning and choices of each GPTConfig field on the command line (models/ is not the trainer's).
MODEL_FIELD_HELP: dict[str, tuple[str, tuple[str, ...]]] = {
    "num_layers": ("Transformer blocks", ()),
    "num_heads": ("query heads per attention layer", ()),
    "num_kv_heads": ("key/value heads; fewer than num_heads (a divisor): grouped-query attention", ()),
    "embed_dim": ("width of the residual stream: num_heads * head_dim", ()),
    "mlp_dim": ("hidden width of each MLP", ()),
    "dropout_rate": ("dropout probability on the embeddings and each block's residual branches", ()),
    "norm": ("normalisation layer", NORMS),
    "mlp": ("MLP type", MLPS),
    "attention_implementation": (
        "flash only: pallas_flash's implementation; none: the best available",
        ("none", *IMPLEMENTATIONS),
    ),
    "deterministic_gradients": (
        (
            "flash only: false lets the backward sum dQ with float32 atomics where faster, "
            "so gradients vary in their last bits between runs"
        ),
        (),
    ),
    "dtype": ("compute dtype", DTYPES),
    "param_dtype": ("parameter dtype", DTYPES),
    "remat": ("recompute each block's activations in the backward pass: less memory, more compute", ()),
    "value_head_dim": ("width of the value heads (as DeepSeek's MLA); none: head_dim", ()),
    "vocab_size": ("vocabulary size; at least 256, as the data are bytes", ()),
}


def _show(value) -> str:
    """A default as it is typed on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if value == "":
        return '""'
    return f"{value:g}" if isinstance(value, float) else str(value)


def _default_text(values: dict[str, object]) -> str:
    """ "default: X", X the default preset's value, then each other preset whose value differs."""
    default = _show(values[DEFAULT_PRESET])
    others = [
        f"{name}: {_show(value)}"
        for name, value in values.items()
        if name != DEFAULT_PRESET and _show(value) != default
    ]
    return f"default: {default}" + (f"; preset {', '.join(others)}" if others else "")


def _add_fields(parser, cls, prefix: str, presets: dict, help_of, skip=()):
    """One flag per field of dataclass `cls` (nested dataclasses aside): its meaning, default and choices."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip or dataclasses.is_dataclass(hints[field.name]):
            continue
        convert = _converter(hints[field.name])
        description, choices = help_of(field)
        values = {name: getattr(preset, field.name) for name, preset in presets.items()}
        help_text = f"{description} ({_default_text(values)})".replace("%", "%%")
        flag, dest = f"--{prefix}{field.name}", f"{prefix}{field.name}"
        options = dict(
            dest=dest,
            type=convert,
            default=argparse.SUPPRESS,
            metavar="{" + ",".join(choices) + "}" if choices else field.name.upper(),
            **({"nargs": "?", "const": True} if convert is _parse_bool else {}),
        )
        parser.add_argument(flag, help=help_text, **options)
        if "_" in field.name:  # the dashed spelling works too; --help lists the flag once
            parser.add_argument(flag.replace("_", "-"), help=argparse.SUPPRESS, **options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train",
        usage="%(prog)s [--preset {" + ",".join(PRESETS) + "}] [--attention "
        "{" + ",".join(ATTENTIONS) + "}] [--FIELD VALUE ...] [--model.FIELD VALUE ...]",
        description="Train a byte-level GPT with flash or dense attention. Every flag but --preset sets a field "
        "of the preset's config; dashes work for underscores (--seq-len). A flag whose default "
        "differs between presets lists the others' values.",
        epilog="Outputs: config.json, metrics.jsonl, run.json, loss.png and checkpoints/ in the run's folder "
        "(with --attention both: flash/ and dense/ in it, and report.md, report.json, loss.png). Ctrl-C "
        "saves a checkpoint and prints the command that resumes the run.",
    )
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=DEFAULT_PRESET,
        help="the configuration the other flags change (default: " + DEFAULT_PRESET + ")",
    )
    _add_fields(parser, TrainConfig, "", PRESETS, lambda f: (f.metadata["help"], f.metadata["choices"]))
    _add_fields(
        parser,
        GPTConfig,
        "model.",
        {name: preset.model for name, preset in PRESETS.items()},
        lambda f: MODEL_FIELD_HELP[f.name],
        skip=TRAINER_SET_MODEL_FIELDS,
    )
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
