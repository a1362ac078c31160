"""The training loop, read top to bottom: build, (resume), compile, step, log, evaluate, checkpoint.

The model is split once into (graphdef, params, rest) and the steps are plain `jax.jit` functions over
those pytrees, so a step costs no Python graph traversal. `rest` is the model's non-parameter state (its
dropout RNG), threaded through the step and checkpointed with the parameters.

On a device mesh (`--mesh data=D,context=C`) the same step runs as one `jax.jit` over sharded inputs: batches
split along "data" (rows) and "context" (positions), parameters and optimizer state replicated; GSPMD
partitions the model from that, and flash attention runs as ring attention (`models.transformer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import pathlib
import signal
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from models.gpt import GPT, GPTConfig
from train import data as data_lib
from train.checkpoint import Checkpointer
from train.config import MESH_AXES, TrainConfig


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay, after global-norm clipping; no decay on vectors."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps,
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


def make_mesh(cfg: TrainConfig) -> Mesh | None:
    """The ("data", "context") mesh of `cfg.mesh` over the first D * C devices; None without --mesh."""
    if cfg.mesh is None:
        return None
    shape = [cfg.mesh_shape[axis] for axis in MESH_AXES]
    devices = jax.devices()
    if math.prod(shape) > len(devices):
        raise ValueError(
            f"mesh={cfg.mesh!r}: needs {math.prod(shape)} devices, {len(devices)} {devices[0].platform} "
            "device(s) available"
        )
    return Mesh(np.array(devices[: math.prod(shape)]).reshape(shape), MESH_AXES)


def replicate(tree, mesh: Mesh | None):
    """`tree` on every device of `mesh` (unchanged without one): parameters and optimizer state."""
    return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, P()))


def shard_batch(batch: dict, mesh: Mesh | None, model: GPTConfig | None = None) -> dict:
    """A batch's arrays, [batch, seq] or [batch], split along the mesh's data and context axes (as they are
    without a mesh); where the `model` takes its sequences permuted (`permutes_sequences`: zig-zag on a mesh) every
    [batch, seq] array's tokens are first put in that order. Losses and scores are sums over tokens, so the
    permutation changes none of them."""
    if mesh is None:
        return batch
    if model is not None and model.permutes_sequences:  # a permuted window's token order is its positions
        batch = {k: v[:, model.sequence_positions(v.shape[1])] if np.ndim(v) == 2 else v
                 for k, v in batch.items()}  # fmt: skip
    return {k: jax.device_put(v, NamedSharding(mesh, P(*MESH_AXES[: np.ndim(v)]))) for k, v in batch.items()}


def pad_batch(batch: dict, multiple: int) -> dict:
    """`batch` with its rows repeated up to a multiple of `multiple` (the mesh's data axis) and `weights`
    [batch] 0 on the repeats: a validation set's last batch may be short, and the data axis splits rows evenly."""
    rows = len(batch["inputs"])
    padded = rows + -rows % multiple
    if padded == rows:
        return batch
    index = np.arange(padded) % rows
    return {**{k: v[index] for k, v in batch.items()}, "weights": (np.arange(padded) < rows).astype(np.float32)}


def init_model(cfg: TrainConfig, attention: str, seq_len: int | None = None, mesh: Mesh | None = None):
    """(graphdef, params, rest) for the run's model, replicated over `mesh`; parameters depend on the seed
    only, not the attention or the mesh."""
    params_key, dropout_key = jax.random.split(jax.random.key(cfg.seed))
    model = GPT(cfg.model_config(attention, seq_len, mesh), rngs=nnx.Rngs(params=params_key, dropout=dropout_key))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, replicate(params, mesh), replicate(rest, mesh)


def _token_losses(model, batch, *, deterministic):
    logits = model(batch["inputs"], deterministic=deterministic)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]), logits


def answer_groups(distances: jax.Array, far_distance: int, positions=None) -> dict[str, jax.Array]:
    """Masks [batch, seq] of the recalled values a recall evaluation scores, by name.

    `answer`: all of them; `near_answer` / `far_answer`: bound at most / more than `far_distance` tokens
    back; `seen_answer` / `unseen_answer`: the key's last showing inside / before the window, so recallable /
    not recallable at this context (target t is the window's token t + 1, so the showing's key is at t - d);
    `answer_d{lo}_{hi}`: lo < distance <= hi, edges at 1/4, 1/2, 1 and 2 times `far_distance`.
    `positions`: each target's position in its window, int [seq] (None: 0..seq-1; permuted batches pass theirs).
    """
    is_answer = distances > 0
    seen = distances <= (jnp.arange(distances.shape[-1]) if positions is None else positions)
    groups = {
        "answer": is_answer,
        "near_answer": is_answer & (distances <= far_distance),
        "far_answer": distances > far_distance,
        "seen_answer": is_answer & seen,
        "unseen_answer": is_answer & ~seen,
    }
    edges = [0, far_distance // 4, far_distance // 2, far_distance, 2 * far_distance]
    for lo, hi in zip(edges, edges[1:]):
        groups[f"answer_d{lo}_{hi}"] = (distances > lo) & (distances <= hi)
    groups[f"answer_d{edges[-1]}_inf"] = distances > edges[-1]
    return groups


def make_steps(graphdef, tx, far_distance: int = 0, mesh: Mesh | None = None):
    """jit-compiled (train_step, eval_step) for one model structure, over batches placed by `shard_batch`.

    On the recall task the eval step also scores the recalled values, in the groups of `answer_groups`. On a
    mesh the train step's outputs stay replicated, as its parameter and optimizer-state inputs are.
    """

    def train_step(params, opt_state, rest, batch):
        # Merged outside the gradient: nnx.value_and_grad carries the dropout RNG's update out of the
        # differentiated function, which a plain jax.grad over a merge inside it cannot.
        model = nnx.merge(graphdef, params, rest)
        batch = {k: batch[k] for k in ("inputs", "targets")}
        loss, grads = nnx.value_and_grad(lambda m: _token_losses(m, batch, deterministic=False)[0].mean())(model)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (
            params,
            opt_state,
            nnx.split(model, nnx.Param, ...)[2],
            {"loss": loss, "grad_norm": optax.tree.norm(grads)},
        )

    def eval_step(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        losses, logits = _token_losses(model, batch, deterministic=True)
        weights = batch.get("weights", jnp.ones(losses.shape[:1], jnp.float32))  # 0: a `pad_batch` repeat
        token_weights = jnp.broadcast_to(weights[:, None], losses.shape)
        window_losses = losses.mean(axis=-1)
        sums = {
            "loss": (losses * token_weights).sum(),
            "tokens": token_weights.sum(),
            "windows": weights.sum(),
            "window_loss": (window_losses * weights).sum(),
            "window_loss_sq": (jnp.square(window_losses) * weights).sum(),
        }
        if "distances" in batch:
            correct = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
            positions = model.config.sequence_positions(losses.shape[1])
            for name, mask in answer_groups(batch["distances"], far_distance, positions).items():
                mask = mask.astype(jnp.float32) * token_weights
                sums |= {
                    f"{name}_loss": (losses * mask).sum(),
                    f"{name}_correct": (correct * mask).sum(),
                    f"{name}s": mask.sum(),
                }
        return sums

    replicated = {} if mesh is None else {"out_shardings": NamedSharding(mesh, P())}
    return jax.jit(train_step, donate_argnums=(0, 1, 2), **replicated), jax.jit(eval_step)


def evaluate(eval_step, params, rest, batches) -> dict[str, float]:
    """Validation loss, its standard error, and on the recall task the answer groups' losses and accuracies.

    The standard error is over validation windows, not tokens: the tokens of one window share its key-value
    bindings (and on text, its file), so their losses are not independent samples, while the windows are
    (nearly) so. All windows have seq_len tokens, so val_loss is also the mean of the window means.
    """
    totals: dict[str, float] = {}
    for batch in batches:
        for name, value in jax.device_get(eval_step(params, rest, batch)).items():
            totals[name] = totals.get(name, 0.0) + float(value)
    windows = totals["windows"]
    metrics = {
        "val_loss": totals["loss"] / totals["tokens"],
        "val_tokens": int(totals["tokens"]),
        "val_windows": int(windows),
    }
    if windows >= 2:
        variance = (totals["window_loss_sq"] - totals["window_loss"] ** 2 / windows) / (windows - 1)
        metrics["val_loss_se"] = math.sqrt(max(variance, 0.0) / windows)
    for group in (k.removesuffix("_correct") for k in totals if k.endswith("_correct")):
        count = totals[f"{group}s"]
        metrics[f"val_{group}s"] = int(count)
        if count:
            metrics |= {
                f"val_{group}_loss": totals[f"{group}_loss"] / count,
                f"val_{group}_accuracy": totals[f"{group}_correct"] / count,
            }
    return metrics


def compiled_bytes(compiled) -> int | None:
    """The device memory XLA planned for one compiled step (arguments, outputs and temporaries)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    planned = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    return int(max(getattr(stats, "peak_memory_in_bytes", 0), planned + stats.temp_size_in_bytes))


def peak_device_bytes() -> int | None:
    """The allocator's peak since the process started; None where the backend keeps no statistics (CPU)."""
    stats = jax.devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def is_out_of_memory(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


@dataclasses.dataclass
class RunResult:
    """One attention's run as a whole, over every session a resume added."""

    attention: str
    steps: list[int]
    losses: list[float]
    evals: list[dict]
    tokens_per_s: float | None  # median over log intervals, each session's first (warm-up) one excluded
    compile_s: float  # the last session's train-step compile
    step_bytes: int | None  # XLA's plan for one train step
    peak_bytes: int | None  # allocator peak (process-wide, so a later run includes earlier ones)
    wall_s: float  # all sessions together
    tokens: int = 0  # tokens trained on, all sessions together
    sessions: list[dict] = dataclasses.field(default_factory=list)  # each: start_step, end_step, wall_s, ...

    @classmethod
    def from_json(cls, summary: dict) -> RunResult:
        """The result a run.json's "result" holds."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in summary.items() if k in names})


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training between steps, after a checkpoint of `step` was saved in `run_dir`."""

    def __init__(self, step: int, run_dir: pathlib.Path):
        super().__init__(f"interrupted after step {step}; checkpoint in {run_dir / 'checkpoints'}")
        self.step, self.run_dir = step, run_dir


@contextlib.contextmanager
def stop_requests():
    """A list the first Ctrl-C (SIGINT) appends to, for the loop to stop between steps; a second Ctrl-C raises
    KeyboardInterrupt at once. Off the main thread, where Python delivers no signals, it stays empty."""
    requests: list[bool] = []

    def handler(signum, frame):
        if requests:
            raise KeyboardInterrupt
        requests.append(True)
        print(
            "\nCtrl-C: stopping after this step to save a checkpoint (Ctrl-C again quits without one)",
            file=sys.stderr,
            flush=True,
        )

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield requests
        return
    try:
        yield requests
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


def read_metrics(path: pathlib.Path) -> list[dict]:
    """The records of a metrics.jsonl; none when it does not exist."""
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def stored_result(cfg: TrainConfig, attention: str, run_dir: pathlib.Path) -> RunResult | None:
    """The result in `run_dir`/run.json when that run trained `attention` up to `cfg.steps`, else None."""
    path = run_dir / "run.json"
    summary = json.loads(path.read_text()).get("result") if path.is_file() else None
    if not summary or summary.get("attention") != attention or not summary.get("steps"):
        return None
    return RunResult.from_json(summary) if summary["steps"][-1] == cfg.steps else None


def _result(
    attention: str, records: list[dict], sessions: list[dict], compile_s: float, step_bytes: int | None
) -> RunResult:
    """A RunResult from a run's metrics.jsonl records and its sessions."""
    losses = [r for r in records if "loss" in r]
    rates = [r for r in records if "tokens_per_s" in r]
    steady = [r["tokens_per_s"] for r in rates if not r.get("warmup")] or [r["tokens_per_s"] for r in rates]
    return RunResult(
        attention,
        [r["step"] for r in losses],
        [r["loss"] for r in losses],
        [r for r in records if "val_loss" in r],
        statistics.median(steady) if steady else None,
        compile_s,
        step_bytes,
        peak_device_bytes(),
        sum(s["wall_s"] for s in sessions),
        sum(s["tokens"] for s in sessions),
        sessions,
    )


def train(cfg: TrainConfig, attention: str, run_dir: pathlib.Path) -> RunResult:
    """Trains `cfg` with one attention, writing config.json, metrics.jsonl and checkpoints under `run_dir`.

    With `cfg.resume` it continues from the latest checkpoint (from step 0 without one): metrics.jsonl keeps
    its records up to that step, and the result covers the whole run; a run that run.json shows trained to
    `cfg.steps` is returned as it is. Ctrl-C stops training between steps: a checkpoint of the last step is
    saved and TrainingInterrupted raised.
    """
    if cfg.resume and (finished := stored_result(cfg, attention, run_dir)):
        print(f"[{attention}] {run_dir} already trained {cfg.steps} steps", file=sys.stderr)
        return finished
    start_time = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = run_dir / "checkpoints"
    if not cfg.resume:
        Checkpointer.clear(checkpoint_dir)
    checkpointer = (
        Checkpointer(checkpoint_dir, keep=cfg.keep_checkpoints)
        if cfg.checkpoint_every or (cfg.resume and checkpoint_dir.is_dir())
        else None
    )
    latest = checkpointer.latest_step() if cfg.resume and checkpointer else None
    # Written first, so a run cut short (its time limit, a crash) still says what it was; run.json comes
    # only at the end.
    (run_dir / "config.json").write_text(json.dumps(cfg.run_record(attention, run_dir), indent=1))
    mesh = make_mesh(cfg)
    model = cfg.model_config(attention, mesh=mesh)
    dataset = data_lib.make_dataset(cfg)
    eval_batches = [shard_batch(pad_batch(b, cfg.mesh_shape["data"]), mesh, model) for b in dataset.eval_batches()]
    graphdef, params, rest = init_model(cfg, attention, mesh=mesh)
    tx = make_optimizer(cfg)
    opt_state = replicate(tx.init(params), mesh)
    train_step, eval_step = make_steps(graphdef, tx, cfg.recall_far_distance, mesh)
    model_record = cfg.model_record(attention)

    start_step, sessions = 0, []
    if cfg.resume and latest is None:
        print(f"[{attention}] no checkpoint in {run_dir}: training from step 0", file=sys.stderr)
    elif cfg.resume:
        if latest > cfg.steps:
            raise ValueError(f"the latest checkpoint in {run_dir} is at step {latest}, past steps={cfg.steps}")
        state, record = checkpointer.restore({"params": params, "opt_state": opt_state, "rest": rest})
        if record["model"] != model_record:
            raise ValueError(f"the checkpoint in {run_dir} was written for another model: {record['model']}")
        params, opt_state, rest, start_step = state["params"], state["opt_state"], state["rest"], record["data_step"]
        sessions = record.get("sessions", [])
    # A resumed run's steps after its checkpoint are trained again: their earlier records go.
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] <= start_step] if cfg.resume else []
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics_file = (run_dir / "metrics.jsonl").open("a")

    def write(new_records):
        records.extend(new_records)
        metrics_file.writelines(json.dumps(r) + "\n" for r in new_records)
        metrics_file.flush()

    def loss_records(pending, done):
        return [
            {
                "step": done - len(pending) + offset + 1,
                "loss": float(values["loss"]),
                "grad_norm": float(values["grad_norm"]),
            }
            for offset, values in enumerate(jax.device_get(pending))
        ]

    compile_start = time.perf_counter()
    train_step = train_step.lower(
        params, opt_state, rest, shard_batch(dataset.train_batch(start_step), mesh, model)
    ).compile()
    compile_s = time.perf_counter() - compile_start
    step_bytes = compiled_bytes(train_step)
    tokens_per_step = cfg.batch_size * cfg.seq_len

    def session(done):
        return {
            "start_step": start_step,
            "end_step": done,
            "tokens": (done - start_step) * tokens_per_step,
            "wall_s": time.perf_counter() - start_time,
            "compile_s": compile_s,
        }

    def save(done):
        nonlocal checkpointer
        checkpointer = checkpointer or Checkpointer(checkpoint_dir, keep=cfg.keep_checkpoints)
        if checkpointer.latest_step() != done:
            checkpointer.save(
                done,
                {"params": params, "opt_state": opt_state, "rest": rest},
                {
                    "step": done,
                    "data_step": done,
                    "seed": cfg.seed,
                    "model": model_record,
                    "sessions": [*sessions, session(done)],
                },
            )

    pending, done, warmup = [], start_step, True
    bar = tqdm(total=cfg.steps, initial=start_step, disable=not cfg.progress, desc=attention, unit="step")
    with stop_requests() as stop:
        last_time = time.perf_counter()
        for step in range(start_step, cfg.steps):
            batch = shard_batch(dataset.train_batch(step), mesh, model)
            params, opt_state, rest, metrics = train_step(params, opt_state, rest, batch)
            pending.append(metrics)
            done = step + 1
            evaluate_now = (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps
            checkpoint_now = cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.steps)
            if done % cfg.log_every == 0 or done == cfg.steps:
                # One sync per interval, and on the step before the newest: the newest stays queued while
                # the host reads, logs and dispatches the next, so the device never waits on the host. It is
                # read with the next interval, unless an evaluation or checkpoint syncs everything here.
                keep = 0 if evaluate_now or checkpoint_now or len(pending) < 2 else 1
                ready, pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
                losses = loss_records(ready, done - keep)
                now = time.perf_counter()
                rate = len(ready) * tokens_per_step / (now - last_time)
                record = {"step": done - keep, "tokens_per_s": rate, **({"warmup": True} if warmup else {})}
                write([*losses, record])
                bar.set_postfix(loss=f"{losses[-1]['loss']:.3f}", tok_s=f"{rate:,.0f}")
                bar.update(len(ready))
                last_time, warmup = now, False
            if evaluate_now:
                val = {"step": done, **evaluate(eval_step, params, rest, eval_batches)}
                write([val])
                # The log line keeps the loss and the accuracies; metrics.jsonl has every count and loss.
                message = " ".join(
                    f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in val.items()
                    if k in ("step", "val_loss") or k.endswith("_accuracy")
                )
                bar.write(f"[{attention}] {message}")
                last_time = time.perf_counter()  # evaluation time is not training time
            if checkpoint_now:
                save(done)
            if stop:
                break
    bar.close()
    if stop:
        write(loss_records(pending, done))
        save(done)
    metrics_file.close()
    if checkpointer:
        checkpointer.close()
    if stop:
        raise TrainingInterrupted(done, run_dir)
    return _result(attention, records, [*sessions, session(done)], compile_s, step_bytes)


def search_batch_size(cfg: TrainConfig) -> int:
    """The context search's batch: `search_batch_size` rounded up to a multiple of the mesh's data axis."""
    data = cfg.mesh_shape["data"]
    return -(-cfg.search_batch_size // data) * data


def try_context(cfg: TrainConfig, attention: str, seq_len: int) -> dict:
    """Compiles and runs one train step at `seq_len` x `search_batch_size` on the run's mesh; out-of-memory is
    an answer."""
    probe = {"seq_len": seq_len, "fits": False}
    try:
        mesh = make_mesh(cfg)
        graphdef, params, rest = init_model(cfg, attention, seq_len, mesh)
        tx = make_optimizer(cfg)
        opt_state = replicate(tx.init(params), mesh)
        train_step, _ = make_steps(graphdef, tx, mesh=mesh)
        rng = np.random.default_rng((cfg.seed, seq_len))
        tokens = rng.integers(1, data_lib.VOCAB_SIZE, size=(search_batch_size(cfg), seq_len + 1), dtype=np.int32)
        model = cfg.model_config(attention, seq_len, mesh)
        batch = shard_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh, model)
        compiled = train_step.lower(params, opt_state, rest, batch).compile()
        probe["step_bytes"] = compiled_bytes(compiled)
        start = time.perf_counter()
        params, opt_state, rest, metrics = compiled(params, opt_state, rest, batch)
        loss = float(metrics["loss"])
        probe |= {"fits": math.isfinite(loss), "step_s": time.perf_counter() - start, "loss": loss}
    except jax.errors.JaxRuntimeError as err:
        if not is_out_of_memory(err):
            raise
        probe["error"] = str(err).splitlines()[0][:300]
    finally:
        # Drop every buffer of this probe before the next, larger one.
        params = opt_state = rest = compiled = train_step = None
        gc.collect()
        jax.clear_caches()
    return probe


def find_max_context(cfg: TrainConfig, attention: str, log=print) -> dict:
    """Doubles the context from `seq_len` until a step runs out of memory or `max_context` is passed, on the
    run's mesh: with a context axis of C devices each holds 1/C of the sequence."""
    probes, seq_len = [], cfg.seq_len
    while seq_len <= cfg.max_context:
        probe = try_context(cfg, attention, seq_len)
        probes.append(probe)
        log(f"[{attention}] context {seq_len}: " + ("fits" if probe["fits"] else probe.get("error", "failed")))
        if not probe["fits"]:
            break
        seq_len *= 2
    fitting = [p["seq_len"] for p in probes if p["fits"]]
    return {
        "attention": attention,
        "batch_size": search_batch_size(cfg),
        "mesh": cfg.mesh,
        "devices": math.prod(cfg.mesh_shape.values()),
        "longest": max(fitting, default=None),
        "limit_reached": bool(probes) and probes[-1]["fits"],
        "limit": cfg.max_context,
        "probes": probes,
    }
