"""The training loop, read top to bottom: build, (resume), compile, step, log, evaluate, checkpoint.

The model is split once into (graphdef, params, rest) and the steps are plain `jax.jit` functions over
those pytrees, so a step costs no Python graph traversal. `rest` is the model's non-parameter state (its
dropout RNG), threaded through the step and checkpointed with the parameters.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from models.gpt import GPT
from train import data as data_lib
from train.checkpoint import Checkpointer
from train.config import TrainConfig


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay, after global-norm clipping; no decay on vectors."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps, decay_steps=cfg.steps,
        end_value=cfg.learning_rate * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask))


def init_model(cfg: TrainConfig, attention: str, seq_len: int | None = None):
    """(graphdef, params, rest) for the run's model; parameters depend on the seed only, not the attention."""
    params_key, dropout_key = jax.random.split(jax.random.key(cfg.seed))
    model = GPT(cfg.model_config(attention, seq_len), rngs=nnx.Rngs(params=params_key, dropout=dropout_key))
    return nnx.split(model, nnx.Param, ...)


def _token_losses(model, batch, *, deterministic):
    logits = model(batch["inputs"], deterministic=deterministic)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]), logits


def answer_groups(distances: jax.Array, far_distance: int) -> dict[str, jax.Array]:
    """Masks [batch, seq] of the recalled values a recall evaluation scores, by name.

    `answer`: all of them; `near_answer` / `far_answer`: bound at most / more than `far_distance` tokens
    back; `seen_answer` / `unseen_answer`: the key's last showing inside / before the window, so recallable /
    not recallable at this context (target t is the window's token t + 1, so the showing's key is at t - d);
    `answer_d{lo}_{hi}`: lo < distance <= hi, edges at 1/4, 1/2, 1 and 2 times `far_distance`.
    """
    is_answer = distances > 0
    seen = distances <= jnp.arange(distances.shape[-1])
    groups = {"answer": is_answer, "near_answer": is_answer & (distances <= far_distance),
              "far_answer": distances > far_distance, "seen_answer": is_answer & seen,
              "unseen_answer": is_answer & ~seen}
    edges = [0, far_distance // 4, far_distance // 2, far_distance, 2 * far_distance]
    for lo, hi in zip(edges, edges[1:]):
        groups[f"answer_d{lo}_{hi}"] = (distances > lo) & (distances <= hi)
    groups[f"answer_d{edges[-1]}_inf"] = distances > edges[-1]
    return groups


def make_steps(graphdef, tx, far_distance: int = 0):
    """jit-compiled (train_step, eval_step) for one model structure.

    On the recall task the eval step also scores the recalled values, in the groups of `answer_groups`.
    """

    def train_step(params, opt_state, rest, batch):
        # Merged outside the gradient: nnx.value_and_grad carries the dropout RNG's update out of the
        # differentiated function, which a plain jax.grad over a merge inside it cannot.
        model = nnx.merge(graphdef, params, rest)
        batch = {k: batch[k] for k in ("inputs", "targets")}
        loss, grads = nnx.value_and_grad(lambda m: _token_losses(m, batch, deterministic=False)[0].mean())(model)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, nnx.split(model, nnx.Param, ...)[2], {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    def eval_step(params, rest, batch):
        losses, logits = _token_losses(nnx.merge(graphdef, params, rest), batch, deterministic=True)
        window_losses = losses.mean(axis=-1)
        sums = {"loss": losses.sum(), "tokens": jnp.float32(losses.size), "windows": jnp.float32(losses.shape[0]),
                "window_loss": window_losses.sum(), "window_loss_sq": jnp.square(window_losses).sum()}
        if "distances" in batch:
            correct = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
            for name, mask in answer_groups(batch["distances"], far_distance).items():
                mask = mask.astype(jnp.float32)
                sums |= {f"{name}_loss": (losses * mask).sum(), f"{name}_correct": (correct * mask).sum(),
                         f"{name}s": mask.sum()}
        return sums

    return jax.jit(train_step, donate_argnums=(0, 1, 2)), jax.jit(eval_step)


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
    metrics = {"val_loss": totals["loss"] / totals["tokens"], "val_tokens": int(totals["tokens"]),
               "val_windows": int(windows)}
    if windows >= 2:
        variance = (totals["window_loss_sq"] - totals["window_loss"] ** 2 / windows) / (windows - 1)
        metrics["val_loss_se"] = math.sqrt(max(variance, 0.0) / windows)
    for group in (k.removesuffix("_correct") for k in totals if k.endswith("_correct")):
        count = totals[f"{group}s"]
        metrics[f"val_{group}s"] = int(count)
        if count:
            metrics |= {f"val_{group}_loss": totals[f"{group}_loss"] / count,
                        f"val_{group}_accuracy": totals[f"{group}_correct"] / count}
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
    attention: str
    steps: list[int]
    losses: list[float]
    evals: list[dict]
    tokens_per_s: float | None          # median over log intervals, the first (warm-up) interval excluded
    compile_s: float
    step_bytes: int | None              # XLA's plan for one train step
    peak_bytes: int | None              # allocator peak (process-wide, so a later run includes earlier ones)
    wall_s: float


def train(cfg: TrainConfig, attention: str, run_dir: pathlib.Path) -> RunResult:
    """Trains `cfg` with one attention, writing metrics.jsonl and checkpoints under `run_dir`."""
    start_time = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    # Written first, so a run cut short (its time limit, a crash) still says what it was; run.json comes
    # only at the end.
    (run_dir / "config.json").write_text(json.dumps({**_jsonable(dataclasses.asdict(cfg)), "attention": attention},
                                                    indent=1))
    dataset = data_lib.make_dataset(cfg)
    eval_batches = dataset.eval_batches()
    graphdef, params, rest = init_model(cfg, attention)
    tx = make_optimizer(cfg)
    opt_state = tx.init(params)
    train_step, eval_step = make_steps(graphdef, tx, cfg.recall_far_distance)

    start_step = 0
    checkpointer = None
    if cfg.checkpoint_every or cfg.resume:
        if not cfg.resume:
            Checkpointer.clear(run_dir / "checkpoints")
        checkpointer = Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
        if cfg.resume:
            state, record = checkpointer.restore({"params": params, "opt_state": opt_state, "rest": rest})
            if record["model"] != _jsonable(dataclasses.asdict(cfg.model_config(attention))):
                raise ValueError(f"the checkpoint in {run_dir} was written for another model: {record['model']}")
            params, opt_state, rest, start_step = state["params"], state["opt_state"], state["rest"], record["data_step"]
    metrics_file = (run_dir / "metrics.jsonl").open("a" if cfg.resume else "w")

    compile_start = time.perf_counter()
    train_step = train_step.lower(params, opt_state, rest, dataset.train_batch(start_step)).compile()
    compile_s = time.perf_counter() - compile_start
    step_bytes = compiled_bytes(train_step)
    tokens_per_step = cfg.batch_size * cfg.seq_len

    result = RunResult(attention, [], [], [], None, compile_s, step_bytes, None, 0.0)
    interval_rates, pending = [], []
    bar = tqdm(total=cfg.steps, initial=start_step, disable=not cfg.progress, desc=attention, unit="step")
    last_time = time.perf_counter()
    for step in range(start_step, cfg.steps):
        params, opt_state, rest, metrics = train_step(params, opt_state, rest, dataset.train_batch(step))
        pending.append(metrics)
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            fetched = jax.device_get(pending)   # one sync per interval keeps the device queue full
            now = time.perf_counter()
            rate = len(pending) * tokens_per_step / (now - last_time)
            interval_rates.append(rate)
            for offset, values in enumerate(fetched):
                record = {"step": done - len(fetched) + offset + 1, "loss": float(values["loss"]),
                          "grad_norm": float(values["grad_norm"])}
                result.steps.append(record["step"])
                result.losses.append(record["loss"])
                metrics_file.write(json.dumps(record) + "\n")
            metrics_file.write(json.dumps({"step": done, "tokens_per_s": rate}) + "\n")
            bar.set_postfix(loss=f"{result.losses[-1]:.3f}", tok_s=f"{rate:,.0f}")
            bar.update(len(pending))
            pending = []
            last_time = now
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
            val = {"step": done, **evaluate(eval_step, params, rest, eval_batches)}
            result.evals.append(val)
            metrics_file.write(json.dumps(val) + "\n")
            # The log line keeps the loss and the accuracies; metrics.jsonl has every count and loss.
            message = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in val.items()
                               if k in ("step", "val_loss") or k.endswith("_accuracy"))
            bar.write(f"[{attention}] {message}")
            last_time = time.perf_counter()   # evaluation time is not training time
        if checkpointer and cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            checkpointer.save(done, {"params": params, "opt_state": opt_state, "rest": rest},
                              {"step": done, "data_step": done, "seed": cfg.seed,
                               "model": _jsonable(dataclasses.asdict(cfg.model_config(attention)))})
        metrics_file.flush()
    bar.close()
    metrics_file.close()
    if checkpointer:
        checkpointer.close()
    steady = interval_rates[1:] or interval_rates
    result.tokens_per_s = statistics.median(steady) if steady else None
    result.peak_bytes = peak_device_bytes()
    result.wall_s = time.perf_counter() - start_time
    return result


def _jsonable(value):
    return json.loads(json.dumps(value, default=repr))


def try_context(cfg: TrainConfig, attention: str, seq_len: int) -> dict:
    """Compiles and runs one train step at `seq_len` x `search_batch_size`; out-of-memory is an answer."""
    probe = {"seq_len": seq_len, "fits": False}
    try:
        graphdef, params, rest = init_model(cfg, attention, seq_len)
        tx = make_optimizer(cfg)
        opt_state = tx.init(params)
        train_step, _ = make_steps(graphdef, tx)
        rng = np.random.default_rng((cfg.seed, seq_len))
        tokens = rng.integers(1, data_lib.VOCAB_SIZE, size=(cfg.search_batch_size, seq_len + 1), dtype=np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
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
    """Doubles the context from `seq_len` until a step runs out of memory or `max_context` is passed."""
    probes, seq_len = [], cfg.seq_len
    while seq_len <= cfg.max_context:
        probe = try_context(cfg, attention, seq_len)
        probes.append(probe)
        log(f"[{attention}] context {seq_len}: " + ("fits" if probe["fits"] else probe.get("error", "failed")))
        if not probe["fits"]:
            break
        seq_len *= 2
    fitting = [p["seq_len"] for p in probes if p["fits"]]
    return {"attention": attention, "batch_size": cfg.search_batch_size, "longest": max(fitting, default=None),
            "limit_reached": bool(probes) and probes[-1]["fits"], "limit": cfg.max_context, "probes": probes}
