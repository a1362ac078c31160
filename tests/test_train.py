"""CPU smoke tests of the trainer: config/CLI, data, loss decreases, exact resume, Ctrl-C, run folders and
what each run writes, the `both` report, and training on a device mesh (the test session's 8 CPU devices,
tests/conftest.py; the same on two GPUs is `gpu`)."""

import dataclasses
import datetime
import json
import re
import shlex
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.gpt import GPTConfig
from pallas_flash import parallel
from tests.tolerances import assert_close
from train import __main__ as train_main
from train import data as data_lib
from train import loop, report
from train.config import TRAINER_SET_MODEL_FIELDS, TrainConfig, choose_run_dir, parse_args

# A model small enough for a few CPU steps; every run below compiles in seconds.
SMALL = [
    "--model.num_layers",
    "1",
    "--model.num_heads",
    "2",
    "--model.num_kv_heads",
    "2",
    "--model.embed_dim",
    "64",
    "--model.mlp_dim",
    "128",
    "--seq_len",
    "64",
    "--batch_size",
    "8",
    "--corpus_bytes",
    "400000",
    "--eval_tokens",
    "1024",
    "--progress",
    "false",
    "--log_every",
    "5",
]


def _losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def _steps(path, key):
    """The steps of a metrics.jsonl's records that hold `key`, in file order."""
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if key in r]


def test_cli_overrides_every_level():
    cfg = parse_args(
        [
            "--steps",
            "50",
            "--model.num_layers",
            "4",
            "--seq-len",
            "256",
            "--attention",
            "both",
            "--model.remat",
            "--resume",
            "false",
            "--model.attention_implementation",
            "none",
        ]
    )
    assert (cfg.steps, cfg.model.num_layers, cfg.seq_len, cfg.attention) == (50, 4, 256, "both")
    assert cfg.model.remat is True and cfg.resume is False and cfg.model.attention_implementation is None
    assert cfg.model_config("dense").attention == "dense" and cfg.model_config("dense").max_seq_len == 256


@pytest.mark.parametrize(
    "args, field",
    [
        (["--steps", "0"], "steps"),
        (["--attention", "sparse"], "attention"),
        (["--data", "/no/such/file.txt"], "data"),
        (["--warmup_steps", "500", "--steps", "100"], "warmup_steps"),
        (["--min_lr_ratio", "1.5"], "min_lr_ratio"),
        (["--recall_doc_len", "31"], "recall_doc_len"),
        (["--recall_num_keys", "16", "--recall_values_per_key", "16"], "recall_num_keys"),
        (["--recall_fact_probability", "0"], "recall_fact_probability"),
        (["--mesh", "data=2,model=2"], "mesh"),
        (["--mesh", "data=0"], "mesh"),
        (["--mesh", "data=2,data=2"], "mesh"),
        (["--mesh", "data=3"], "batch_size"),
        (["--mesh", "context=3"], "seq_len"),
        (["--mesh", "context=2", "--seq_len", "66"], "seq_len"),  # zig-zag: 2 chunks per device
        (["--context_layout", "striped"], "context_layout"),
    ],
)
def test_bad_values_name_the_field(args, field, capsys):
    with pytest.raises(SystemExit):
        parse_args(args)
    assert f"{field}=" in capsys.readouterr().err


RECALL = dict(num_keys=4, values_per_key=16, fact_probability=1 / 16)


def test_recall_documents_repeat_each_keys_value_and_measure_the_distance():
    tokens, distances = data_lib.recall_document(np.random.default_rng(3), 4096, **RECALL)
    slots, slot_distances = tokens.reshape(-1, 2), distances.reshape(-1, 2)
    value_of, last_seen = {}, {}
    for index, ((key, value), (_, distance)) in enumerate(zip(slots, slot_distances)):
        assert not slot_distances[index, 0]
        if key == data_lib.FILLER:
            assert value == data_lib.FILLER and not distance
            continue
        assert 1 <= key <= 4
        family_start = 1 + 4 + (key - 1) * 16
        assert family_start <= value < family_start + 16, (key, value)
        if key in value_of:
            assert value == value_of[key] and distance == 2 * (index - last_seen[key])
        else:
            assert not distance
        value_of[key], last_seen[key] = value, index
    assert 0.04 < (slots[:, 0] != data_lib.FILLER).mean() < 0.09


def test_recall_distances_follow_the_designed_distribution():
    # A key's showings are num_keys / fact_probability = 64 slots = 128 tokens apart on average (geometric),
    # so exp(-1) of the repeats reach back more than 128 tokens and exp(-4) more than 512.
    rng = np.random.default_rng(0)
    distances = np.concatenate([data_lib.recall_document(rng, 4096, **RECALL)[1] for _ in range(200)])
    repeats = distances[distances > 0]
    assert len(repeats) > 5000 and (repeats % 2 == 0).all()
    assert abs(repeats.mean() - 128) < 8
    assert abs((repeats > 128).mean() - np.exp(-1)) < 0.03
    assert abs((repeats > 512).mean() - np.exp(-4)) < 0.01
    assert repeats.max() > 1024


def test_recall_documents_are_a_function_of_the_seed():
    def batch(seed, step):
        args = [
            "--data",
            "recall",
            "--recall_doc_len",
            "256",
            "--recall_fact_probability",
            "0.5",
            "--seq_len",
            "64",
            "--batch_size",
            "4",
            "--seed",
            str(seed),
            "--eval_tokens",
            "512",
        ]
        dataset = data_lib.make_dataset(parse_args(args))
        return dataset.train_batch(step), dataset.eval_batches()

    (train_a, val_a), (train_b, _), (train_c, val_c) = batch(0, 3), batch(0, 3), batch(1, 3)
    assert all(np.array_equal(train_a[k], train_b[k]) for k in train_a)
    assert not np.array_equal(train_a["inputs"], train_c["inputs"])
    assert all(np.array_equal(a[k], c[k]) for a, c in zip(val_a, val_c) for k in a)  # validation: seed-free


def test_answer_groups_split_by_window_and_distance():
    # Targets 0..7 of one window; target t's key showing is t - d tokens into the window.
    distances = np.array([[0, 1, 0, 3, 0, 8, 2, 20]])
    groups = {k: np.asarray(v)[0].tolist() for k, v in loop.answer_groups(distances, far_distance=8).items()}
    assert groups["seen_answer"] == [0, 1, 0, 1, 0, 0, 1, 0]
    order = np.array([0, 1, 6, 7, 2, 3, 4, 5])  # a permuted window (zig-zag over 2 devices) with its positions
    permuted = {k: np.asarray(v)[0].tolist() for k, v in loop.answer_groups(distances[:, order], 8, order).items()}
    assert permuted == {k: np.asarray(v)[order].tolist() for k, v in groups.items()}
    assert groups["unseen_answer"] == [0, 0, 0, 0, 0, 1, 0, 1]
    assert groups["far_answer"] == [0, 0, 0, 0, 0, 0, 0, 1]
    buckets = [name for name in groups if name.startswith("answer_d")]
    assert buckets == ["answer_d0_2", "answer_d2_4", "answer_d4_8", "answer_d8_16", "answer_d16_inf"]
    assert (np.sum([groups[b] for b in buckets], axis=0) == groups["answer"]).all()


def test_recall_batches_do_not_depend_on_the_window_layout():
    dense_facts = ["--data", "recall", "--recall_doc_len", "64", "--recall_fact_probability", "0.5"]
    cfg = parse_args(dense_facts + ["--seq_len", "32", "--batch_size", "4", "--eval_tokens", "256"])
    short = data_lib.make_dataset(cfg)
    long = data_lib.make_dataset(
        parse_args(dense_facts + ["--seq_len", "128", "--batch_size", "1", "--eval_tokens", "256"])
    )
    for step in (0, 5):
        a, b = short.train_batch(step), long.train_batch(step)
        assert np.array_equal(a["inputs"].reshape(-1), b["inputs"].reshape(-1))
        assert np.array_equal(a["distances"].reshape(-1), b["distances"].reshape(-1))
    val_a = np.concatenate([x["targets"].reshape(-1) for x in short.eval_batches()])
    val_b = np.concatenate([x["targets"].reshape(-1) for x in long.eval_batches()])
    assert np.array_equal(val_a, val_b) and len(val_a) == 256
    assert not np.array_equal(short.train_batch(1)["inputs"], short.train_batch(2)["inputs"])


def test_stdlib_split_is_deterministic_and_disjoint():
    train_a, val_a = data_lib.stdlib_files(400_000, 0.1)
    train_b, val_b = data_lib.stdlib_files(400_000, 0.1)
    assert train_a == train_b and val_a == val_b and val_a and not set(train_a) & set(val_a)
    cfg = parse_args(SMALL)
    batch = data_lib.make_dataset(cfg).train_batch(7)
    assert np.array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert np.array_equal(batch["inputs"], data_lib.make_dataset(cfg).train_batch(7)["inputs"])


def test_tiny_steps_lower_the_loss(tmp_path):
    cfg = parse_args(
        SMALL + ["--steps", "30", "--warmup_steps", "3", "--checkpoint_every", "0", "--run_dir", str(tmp_path)]
    )
    result = loop.train(cfg, "flash", tmp_path)
    assert np.mean(result.losses[-5:]) < result.losses[0] - 1.0
    assert result.evals[-1]["val_loss"] < np.log(256) - 1.0
    config = json.loads((tmp_path / "config.json").read_text())  # written before the first step
    assert config["attention"] == "flash" and config["steps"] == 30 and config["seq_len"] == 64


@pytest.mark.parametrize(
    ("eval_every", "rate_steps"),
    [(0, [4, 9, 12]), (5, [5, 10, 12])],
)
def test_log_intervals_leave_the_newest_step_queued(eval_every, rate_steps, tmp_path):
    """Each log interval syncs on the step before the newest (the newest is read with the next interval), unless
    an evaluation syncs everything at that step: every step's loss is written once and in order, and each
    tokens/s record says the last step it counted."""
    cfg = parse_args(
        SMALL
        + ["--steps", "12", "--warmup_steps", "1", "--checkpoint_every", "0", "--eval_every", str(eval_every)]
        + ["--run_dir", str(tmp_path)]
    )
    loop.train(cfg, "flash", tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    assert _steps(metrics, "loss") == list(range(1, 13))
    assert _steps(metrics, "tokens_per_s") == rate_steps


def test_evaluation_records_the_standard_error_over_windows():
    from flax import nnx

    cfg = parse_args(SMALL)
    graphdef, params, rest = loop.init_model(cfg, "flash")
    _, eval_step = loop.make_steps(graphdef, loop.make_optimizer(cfg))
    batches = data_lib.make_dataset(cfg).eval_batches()
    metrics = loop.evaluate(eval_step, params, rest, batches)
    model = nnx.merge(graphdef, params, rest)
    window_means = np.concatenate(
        [np.asarray(loop._token_losses(model, b, deterministic=True)[0]).mean(axis=-1) for b in batches]
    )
    assert metrics["val_windows"] == len(window_means) == 1024 // 64 and metrics["val_tokens"] == 1024
    assert metrics["val_loss"] == pytest.approx(window_means.mean(), rel=1e-5)
    assert metrics["val_loss_se"] == pytest.approx(window_means.std(ddof=1) / len(window_means) ** 0.5, rel=1e-3)
    assert metrics["val_loss_se"] > 0


def test_resume_reproduces_the_next_loss_exactly(tmp_path):
    args = SMALL + [
        "--steps",
        "6",
        "--warmup_steps",
        "2",
        "--checkpoint_every",
        "3",
        "--run_dir",
        str(tmp_path),
        "--model.dropout_rate",
        "0.1",
    ]
    train_main.main(args)
    reference = _losses(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").rename(tmp_path / "first.jsonl")
    shutil.rmtree(tmp_path / "checkpoints" / "6")  # a crash after step 3's checkpoint: no later one, no run.json
    (tmp_path / "run.json").unlink()
    train_main.main(args + ["--resume"])
    resumed = _losses(tmp_path / "metrics.jsonl")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == reference[s] for s in resumed), (resumed, reference)
    assert reference[4] != reference[3]


@pytest.fixture(scope="module")
def both_run(tmp_path_factory):
    """The folder of one `--attention both` run with the context search (one real probe step per attention, at
    the run's context 64: its doubling is test_context_search_doubles_until_a_step_fails's), shared by the tests
    of what such a run writes."""
    run_dir = tmp_path_factory.mktemp("both")
    train_main.main(
        SMALL
        + [
            "--attention",
            "both",
            "--steps",
            "4",
            "--warmup_steps",
            "1",
            "--checkpoint_every",
            "0",
            "--max_context",
            "64",
            "--run_dir",
            str(run_dir),
        ]
    )
    return run_dir


def test_context_search_doubles_until_a_step_fails(monkeypatch):
    """`find_max_context` doubles the context from seq_len while a probe step fits and the limit allows: it
    stops at the first step that does not fit (the longest is the one before) or past the limit."""
    tried = []

    def probe(cfg, attention, seq_len):
        tried.append((attention, seq_len))
        return {"seq_len": seq_len, "fits": seq_len <= 256}

    monkeypatch.setattr(loop, "try_context", probe)
    cfg = parse_args(SMALL)  # seq_len 64
    for limit, probes, longest, reached in (
        (1024, [64, 128, 256, 512], 256, False),
        (128, [64, 128], 128, True),
        (32, [], None, False),
    ):
        tried.clear()
        search = loop.find_max_context(dataclasses.replace(cfg, max_context=limit), "dense", log=lambda _: None)
        assert tried == [("dense", s) for s in probes] and [p["seq_len"] for p in search["probes"]] == probes
        assert (search["longest"], search["limit_reached"], search["limit"]) == (longest, reached, limit)


def test_both_writes_the_report(both_run):
    tmp_path = both_run
    for name in ("report.md", "report.json", "loss.png", "flash/metrics.jsonl", "dense/metrics.jsonl"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(p["seq_len"], p["fits"]) for p in report["max_context"]["flash"]["probes"]] == [(64, True)]
    assert report["max_context"]["dense"]["longest"] == 64
    assert report["agreement"]["max_abs_diff"] < 1e-2
    assert set(report["runs"]) == {"flash", "dense"} and report["runs"]["dense"]["tokens_per_s"] > 0


def _help_by_flag(text):
    """{flag: its help text, metavar first} from `python -m train --help`, each on one line."""
    blocks = re.split(r"\n  (?=--)", text.split("options:", 1)[1].split("\n\n")[0])
    return {block.split()[0]: " ".join(block.split()[1:]) for block in blocks}


def test_help_gives_every_flag_a_meaning_a_default_and_its_choices(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_info:
        train_main.main(["--help"])
    assert exit_info.value.code == 0
    helps = _help_by_flag(capsys.readouterr().out)
    flags = [f"--{f.name}" for f in dataclasses.fields(TrainConfig) if f.name != "model"]
    flags += [f"--model.{f.name}" for f in dataclasses.fields(GPTConfig) if f.name not in TRAINER_SET_MODEL_FIELDS]
    for flag in ["--preset", *flags]:
        _, _, rest = helps[flag].partition(" ")  # after the metavar
        description, _, default = rest.partition("(default: ")
        assert len(description.split()) >= 2 and default.endswith(")"), (flag, helps[flag])
    assert helps["--attention"].startswith("{flash,dense,both} ") and "(default: flash)" in helps["--attention"]
    assert helps["--preset"].startswith("{tiny,small,long} ") and "(default: tiny)" in helps["--preset"]
    assert helps["--data"].startswith("{stdlib,recall,PATH} ")
    assert helps["--model.norm"].startswith("{rmsnorm,layernorm} normalisation layer (default: rmsnorm)")
    assert helps["--steps"].endswith("(default: 200; preset long: 1000)")
    assert "(default: float32; preset small: bfloat16, long: bfloat16)" in helps["--model.dtype"]
    assert "--seq-len" not in helps  # the dashed spelling works but is not listed twice
    assert parse_args(["--seq-len", "32"]).seq_len == 32


def _interrupt_at(monkeypatch, step):
    """Make the training data send the process a Ctrl-C (SIGINT) while it makes batch `step`."""
    make_dataset = data_lib.make_dataset

    def interrupting(cfg):
        dataset = make_dataset(cfg)
        train_batch = dataset.train_batch

        def batch(index):
            if index == step:
                signal.raise_signal(signal.SIGINT)
            return train_batch(index)

        dataset.train_batch = batch
        return dataset

    monkeypatch.setattr(data_lib, "make_dataset", interrupting)


def test_ctrl_c_saves_a_checkpoint_and_prints_the_command_that_resumes(tmp_path, monkeypatch, capsys):
    args = SMALL + ["--steps", "6", "--warmup_steps", "1", "--checkpoint_every", "0"]
    train_main.main(args + ["--run_dir", str(tmp_path / "reference")])
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        _interrupt_at(patch, 2)  # while step 3 (batch 2) runs
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            try:
                train_main.main(args + ["--run_dir", str(run)])
            except KeyboardInterrupt:
                pytest.fail("Ctrl-C escaped as a KeyboardInterrupt (a traceback)")
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted after step 3 of 6" in err
    command = err.strip().splitlines()[-1].split("Resume with: ")[1]
    assert command == shlex.join(["python", "-m", "train", *args, "--run_dir", str(run), "--resume"])
    assert (run / "checkpoints" / "3").is_dir() and not (run / "run.json").exists()
    assert _steps(run / "metrics.jsonl", "loss") == [1, 2, 3]

    train_main.main(shlex.split(command)[3:])
    assert _losses(run / "metrics.jsonl") == _losses(tmp_path / "reference" / "metrics.jsonl")  # bit-exact
    result = json.loads((run / "run.json").read_text())["result"]
    assert [(s["start_step"], s["end_step"]) for s in result["sessions"]] == [(0, 3), (3, 6)]


def test_resume_appends_without_duplicates_and_reports_the_whole_run(tmp_path, capsys):
    args = SMALL + [
        "--warmup_steps",
        "1",
        "--checkpoint_every",
        "2",
        "--keep_checkpoints",
        "3",
        "--run_dir",
        str(tmp_path),
    ]
    train_main.main(args + ["--steps", "4"])
    shutil.rmtree(tmp_path / "checkpoints" / "4")  # a crash after step 4, before its checkpoint and run.json
    (tmp_path / "run.json").unlink()
    capsys.readouterr()
    train_main.main(args + ["--steps", "8", "--resume"])  # from step 2's checkpoint, on to twice the steps
    metrics = tmp_path / "metrics.jsonl"
    for key in ("loss", "tokens_per_s", "val_loss"):
        steps = _steps(metrics, key)
        assert steps == sorted(set(steps)), (key, steps)
    assert _steps(metrics, "loss") == list(range(1, 9))
    result = json.loads((tmp_path / "run.json").read_text())["result"]
    assert result["steps"] == list(range(1, 9)) and result["tokens"] == 8 * 8 * 64
    assert result["final_loss"] == _losses(metrics)[8] and result["final_eval"]["step"] == 8
    assert [(s["start_step"], s["end_step"]) for s in result["sessions"]] == [(0, 2), (2, 8)]
    assert result["wall_s"] == pytest.approx(sum(s["wall_s"] for s in result["sessions"]))
    assert result["losses"][0] == _losses(metrics)[1]
    done = capsys.readouterr().out
    assert "done: 8 steps, 4,096 tokens" in done and "in 2 sessions" in done, done


def test_every_run_writes_its_own_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # One attention per run (what `--attention both` writes in its folder: both_run's tests).
    args = SMALL + ["--name", "t", "--steps", "2", "--warmup_steps", "1", "--checkpoint_every", "0"]
    train_main.main(args)
    train_main.main(args)
    runs = sorted((tmp_path / "runs" / "t").iterdir())
    assert len(runs) == 2, runs
    for run in runs:
        assert {p.name for p in run.iterdir()} >= {"metrics.jsonl", "run.json", "config.json", "loss.png"}
        assert _steps(run / "metrics.jsonl", "loss") == [1, 2]
    with pytest.raises(SystemExit) as exit_info:  # a folder that holds a run is not written again
        train_main.main(args + ["--run_dir", str(runs[0])])
    assert exit_info.value.code == 2 and "already holds files" in capsys.readouterr().err
    cfg = parse_args(["--name", "t"])
    now = datetime.datetime(2026, 1, 2, 3, 4, 5)
    (tmp_path / "runs" / "t" / "20260102-030405").mkdir()  # a run started in the same second
    assert choose_run_dir(cfg, now).name == "20260102-030405-2"
    assert choose_run_dir(dataclasses.replace(cfg, resume=True)) == runs[-1].relative_to(tmp_path)  # the newest


def test_both_saves_the_config_each_attention_ran(both_run):
    tmp_path = both_run
    for attention in ("dense", "flash"):
        for name in ("config.json", "run.json"):
            saved = json.loads((tmp_path / attention / name).read_text())
            config = saved["config"] if name == "run.json" else saved
            assert config["attention"] == config["model"]["attention"] == attention, (name, config)
            assert config["model"]["max_seq_len"] == 64 and config["run_dir"] == str(tmp_path / attention)
        assert (tmp_path / attention / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_single_run_writes_its_loss_plot(tmp_path):
    train_main.main(
        SMALL + ["--steps", "2", "--warmup_steps", "1", "--checkpoint_every", "0", "--run_dir", str(tmp_path)]
    )
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert {"metrics.jsonl", "run.json", "config.json"} <= {p.name for p in tmp_path.iterdir()}


def _fake_result(attention, tokens_per_s):
    return loop.RunResult(
        attention=attention,
        steps=[1, 2],
        losses=[5.0, 4.0],
        evals=[{"step": 2, "val_loss": 4.1}],
        tokens_per_s=tokens_per_s,
        compile_s=1.0,
        step_bytes=None,
        peak_bytes=None,
        wall_s=3.0,
    )


def test_the_report_says_a_speed_up_measured_on_cpu_is_not_the_kernels(tmp_path):
    cfg = parse_args(SMALL + ["--attention", "both", "--steps", "2", "--warmup_steps", "1"])
    results = {"flash": _fake_result("flash", 2000.0), "dense": _fake_result("dense", 1000.0)}
    summary = report.write_comparison(tmp_path, cfg, results, {})
    text = (tmp_path / "report.md").read_text()
    on_cpu = jax.default_backend() == "cpu"
    assert "Speed-up (tokens/s, flash / dense): 2.00x" in text
    assert ("measured on CPU" in text and "the flash kernels' speed is a GPU property" in text) == on_cpu
    assert ("speedup_note" in summary) == on_cpu and summary["backend"] == jax.default_backend()
    run = report.write_run(tmp_path, cfg, results["flash"])
    assert run["backend"] == jax.devices()[0].platform and run["device_kind"] == jax.devices()[0].device_kind
    assert json.loads((tmp_path / "run.json").read_text())["backend"] == run["backend"]


def test_long_range_verdict_says_no_to_noise():
    from train.report import long_range_verdict

    chance = 1 / 64  # the first runs' task: a guess among 64 symbols
    # The first H100 run: nothing learned, the 4k run 0.0003 nats "better".
    noise = long_range_verdict(
        {"val_loss": 3.7263, "val_answer_accuracy": 0.0167}, {"val_loss": 3.7260, "val_answer_accuracy": 0.0169}, chance
    )
    assert not noise["met"] and "3.7263" in noise["why"]
    # A clear loss gain without far answers recalled above chance is still no.
    assert not long_range_verdict(
        {"val_loss": 3.70, "val_far_answer_accuracy": 0.016},
        {"val_loss": 3.50, "val_far_answer_accuracy": 0.03},
        chance,
    )["met"]
    assert long_range_verdict(
        {"val_loss": 3.70, "val_far_answer_accuracy": 0.016},
        {"val_loss": 3.50, "val_far_answer_accuracy": 0.60},
        chance,
    )["met"]


# 2026-11-23 H100 run 5 at step 875 (train/results/2026-11-23-h100-run5-recall): 1k vs 4k context.
RUN5_1K = {"val_loss": 0.0665, "val_far_answer_accuracy": 0.0590}
RUN5_4K = {"val_loss": 0.0598, "val_far_answer_accuracy": 0.9851}


def test_long_range_loss_gain_beyond_three_standard_errors_is_met():
    from train.report import LOSS_MARGIN, long_range_verdict

    # Gain 0.0067, below the stdlib margin, but 3 combined standard errors are 3 * hypot(5e-4, 4e-4) = 0.0019.
    verdict = long_range_verdict({**RUN5_1K, "val_loss_se": 5e-4}, {**RUN5_4K, "val_loss_se": 4e-4}, 1 / 16)
    assert 0.0067 < LOSS_MARGIN
    assert verdict["loss_method"] == "standard_error" and verdict["loss_met"] and verdict["met"], verdict["why"]
    assert verdict["loss_needed"] == pytest.approx(3 * (5e-4**2 + 4e-4**2) ** 0.5)
    assert "3 combined standard errors = 0.0019" in verdict["why"]


def test_long_range_loss_gain_within_three_standard_errors_is_not_met():
    from train.report import long_range_verdict

    # 3 * hypot(0.002, 0.002) = 0.0085 > 0.0067: not met, though far answers are recalled far above chance.
    verdict = long_range_verdict({**RUN5_1K, "val_loss_se": 0.002}, {**RUN5_4K, "val_loss_se": 0.002}, 1 / 16)
    assert verdict["loss_method"] == "standard_error"
    assert not verdict["loss_met"] and verdict["accuracy_met"] and not verdict["met"]


def test_long_range_loss_without_standard_errors_falls_back_to_the_stdlib_margin():
    from train.report import LOSS_MARGIN, long_range_verdict

    for short, long in ((RUN5_1K, RUN5_4K), ({**RUN5_1K, "val_loss_se": 5e-4}, RUN5_4K)):  # none, or one run only
        verdict = long_range_verdict(short, long, 1 / 16)
        assert verdict["loss_method"] == "fixed_margin" and verdict["loss_needed"] == LOSS_MARGIN
        assert not verdict["loss_met"] and verdict["accuracy_met"] and not verdict["met"]
        assert "stdlib corpus" in verdict["why"] and "no standard error" in verdict["why"]
    bigger = long_range_verdict(RUN5_1K, {**RUN5_4K, "val_loss": 0.0665 - LOSS_MARGIN}, 1 / 16)
    assert bigger["loss_method"] == "fixed_margin" and bigger["loss_met"] and bigger["met"]


def _cut_recall_run(out_dir, name, seq_len, batch_size, evals, last_step, *, config_json):
    """A recall run that gpu_experiments.sh's time limit cut: metrics.jsonl and its log, no run.json."""
    run_dir = out_dir / name
    run_dir.mkdir(parents=True)
    lines = [{"step": s, "loss": 0.07, "grad_norm": 0.1} for s in range(1, last_step + 1)]
    lines += [{"step": step, **values} for step, values in evals.items()]
    lines.sort(key=lambda r: r["step"])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if config_json:
        config = json.loads(
            json.dumps(
                dataclasses.asdict(
                    parse_args(
                        [
                            "--preset",
                            "long",
                            "--seq_len",
                            str(seq_len),
                            "--batch_size",
                            str(batch_size),
                            "--steps",
                            "3500",
                            "--recall_values_per_key",
                            "8",
                        ]
                    )
                ),
                default=repr,
            )
        )
        (run_dir / "config.json").write_text(json.dumps({**config, "attention": "flash"}))
    (out_dir / "logs").mkdir(exist_ok=True)
    command = f"python -m train --preset long --seq_len {seq_len} --batch_size {batch_size}"
    (out_dir / "logs" / f"{name}.log").write_text(
        f"== {name}: {command}\nrun long: flash attention, data recall, context {seq_len}, batch {batch_size}, "
        f"3500 steps -> {run_dir}\n== {name} exit 124\n"
    )


def test_summary_compares_cut_recall_runs_at_their_last_common_evaluation(tmp_path):
    from train.report import summarize

    se = {"val_loss_se": 4e-4}
    # long_1k evaluated at 875 and 1750, long_4k at 875 only: the 1750 numbers must not be compared.
    _cut_recall_run(
        tmp_path,
        "long_1k",
        1024,
        32,
        {875: {**RUN5_1K, **se}, 1750: {"val_loss": 0.0590, **se}},
        1800,
        config_json=False,
    )
    _cut_recall_run(tmp_path, "long_4k", 4096, 8, {875: {**RUN5_4K, **se}}, 1100, config_json=True)
    claim = summarize(tmp_path)["claims"]["longer_context_lower_val_loss"]
    assert claim["compared_step"] == 875 and claim["compared_eval"]["long_1k"]["val_loss"] == 0.0665
    assert claim["met"] and claim["loss_method"] == "standard_error"
    assert claim["chance"] == 1 / 8  # long_4k's config.json, not the preset's 16
    assert claim["runs"]["long_1k"]["config_source"] == "logs/long_1k.log"
    assert claim["runs"]["long_4k"]["config_source"] == "config.json"
    results_md = (tmp_path / "results.md").read_text()
    assert (
        "runs cut by their time limit at steps 1,800 and 1,100 of 3,500; compared at step 875, the last "
        "evaluation both reached"
    ) in results_md
    assert "long_1k stored no config" in results_md and "long_4k stored no config" not in results_md
    assert (tmp_path / "long_range.png").stat().st_size > 0 and "small_both/loss.png" not in results_md


def test_context_and_curve_verdicts():
    from train.report import context_verdict, curves_verdict

    search = lambda longest, reached: {"longest": longest, "limit_reached": reached, "limit": 262144}  # noqa: E731
    assert not context_verdict({"flash": search(131072, True), "dense": search(16384, False)})["met"]
    assert context_verdict({"flash": search(262144, True), "dense": search(16384, False)})["met"]
    assert not context_verdict({"flash": search(262144, True), "dense": search(262144, True)})["met"]
    assert not context_verdict({"flash": search(262144, True)})["met"]
    agreement = {"mean_abs_diff_second_half": 0.0119}
    assert curves_verdict(agreement, {"flash": 1.8704, "dense": 1.8681})["met"]
    assert not curves_verdict(agreement, {"flash": 1.9704, "dense": 1.8681})["met"]


# Final val losses by seed: {seed: (flash, dense)}.
def _finals(pairs):
    return {seed: {"flash": flash, "dense": dense} for seed, (flash, dense) in pairs.items()}


def test_seed_paired_verdict_meets_differences_within_the_noise():
    from train.report import curves_agree_verdict

    # The H100 runs 1-3 (seed 0 each, so run-to-run noise only) as if they were seeds: d = +0.0023, -0.0277,
    # +0.0475 straddle 0.
    verdict = curves_agree_verdict(_finals({0: (1.8704, 1.8681), 1: (1.8658, 1.8935), 2: (1.9481, 1.9006)}), {})
    assert verdict["method"] == "seed_paired" and verdict["met"], verdict["why"]
    assert verdict["mean_diff"] == pytest.approx((0.0023 - 0.0277 + 0.0475) / 3)
    assert verdict["diffs"] == pytest.approx([0.0023, -0.0277, 0.0475])


def test_seed_paired_verdict_fails_a_consistent_offset():
    from train.report import curves_agree_verdict

    # flash 0.08 above dense on every seed, give or take 0.01: d = 0.07, 0.08, 0.09, so the mean 0.08 has a
    # standard error of 0.01 / sqrt(3) = 0.0058; dense's seed-to-seed std is 0.03.
    verdict = curves_agree_verdict(_finals({0: (1.97, 1.90), 1: (2.01, 1.93), 2: (1.96, 1.87)}), {})
    assert not verdict["met"]
    assert verdict["mean_diff"] == pytest.approx(0.08)
    assert verdict["standard_error"] == pytest.approx(0.01 / 3**0.5)
    assert verdict["seed_std"]["dense"] == pytest.approx(0.03)
    assert not verdict["within_standard_errors"] and not verdict["within_seed_noise"]
    assert "+0.0800" in verdict["why"]


def test_seed_paired_verdict_fails_a_mean_difference_beyond_one_seeds_spread():
    from train.report import seed_paired_verdict

    # d = 0.10, -0.02, 0.20 scatter too much to resolve their mean 0.093 (2 standard errors: 0.127), but it
    # is more than one model differs from another seed's (typical std 0.074): not "within bf16 noise".
    verdict = seed_paired_verdict(_finals({0: (2.00, 1.90), 1: (1.89, 1.91), 2: (2.10, 1.90)}))
    assert verdict["within_standard_errors"] and not verdict["within_seed_noise"] and not verdict["met"]
    assert verdict["noise"] == pytest.approx(((0.105**2 + 0.01**2 / 3) / 2) ** 0.5, rel=1e-3)


def test_one_seed_keeps_the_fixed_margins_and_says_it_cannot_tell():
    from train.report import curves_agree_verdict, seed_paired_verdict

    run4 = curves_agree_verdict(_finals({0: (1.8541, 1.9337)}), {"mean_abs_diff_second_half": 0.0789})
    assert run4["method"] == "fixed_margins" and not run4["met"] and "one seed cannot" in run4["why"]
    close = curves_agree_verdict(_finals({0: (1.8704, 1.8681)}), {"mean_abs_diff_second_half": 0.0119})
    assert close["met"] and "one seed cannot" in close["why"]
    with pytest.raises(ValueError, match="at least 2 seeds"):
        seed_paired_verdict(_finals({0: (1.8704, 1.8681)}))


def _comparison_report(seed, flash, dense):
    """A report.json of `--attention both` with only what train.report.summarize reads."""
    runs = {
        name: {"steps": [1, 2, 3, 4], "losses": [5.0, 3.0, 2.5, final + 0.3], "final_eval": {"val_loss": final}}
        for name, final in (("flash", flash), ("dense", dense))
    }
    return {
        "date": "2026-11-23",
        "device": "gpu: test",
        "jax": "0",
        "command": f"python -m train --seed {seed}",
        "config": {"seed": seed, "seq_len": 4096},
        "runs": runs,
        "max_context": {},
        "agreement": {"mean_abs_diff": 0.01, "max_abs_diff": 0.02, "mean_abs_diff_second_half": 0.01},
    }


def test_summary_pairs_the_seeds(tmp_path):
    from train.report import summarize

    for name, (seed, flash, dense) in {
        "small_both": (0, 1.8704, 1.8681),
        "small_both_seed1": (1, 1.8658, 1.8935),
        "small_both_seed2": (2, 1.9481, 1.9006),
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(_comparison_report(seed, flash, dense)))
    claim = summarize(tmp_path)["claims"]["curves_agree"]
    assert claim["method"] == "seed_paired" and claim["seeds"] == [0, 1, 2] and claim["met"]
    results_md = (tmp_path / "results.md").read_text()
    assert "| 1 | 1.8658 | 1.8935 | -0.0277 |" in results_md and "(agreement.png)" in results_md
    assert (tmp_path / "agreement.png").stat().st_size > 0
    assert json.loads((tmp_path / "results.json").read_text())["claims"]["curves_agree"]["seeds"] == [0, 1, 2]


# Mesh runs: 4 steps of SMALL with a loss record per step, and 17 validation windows (eval_tokens 1088), so the
# last validation batch holds one window and a data axis of 2 pads it.
MESH_RUN = SMALL + ["--steps", "4", "--warmup_steps", "1", "--log_every", "1", "--eval_tokens", "1088"]


def _train_records(run_dir, *args):
    """metrics.jsonl's records of a run of MESH_RUN with `args`, without checkpoints."""
    train_main.main(MESH_RUN + ["--checkpoint_every", "0", "--run_dir", str(run_dir), *args])
    return loop.read_metrics(run_dir / "metrics.jsonl")


def _curves(records):
    """(train losses by step, validation losses) of a run's records."""
    return np.array([r["loss"] for r in records if "loss" in r]), np.array(
        [r["val_loss"] for r in records if "val_loss" in r]
    )


@pytest.fixture(scope="module")
def one_device_records(tmp_path_factory):
    """The records of MESH_RUN without a mesh, by attention (trained on first use): what every mesh must
    reproduce."""
    cache = {}

    def records(attention):
        if attention not in cache:
            cache[attention] = _train_records(tmp_path_factory.mktemp(attention), "--attention", attention)
        return cache[attention]

    return records


@pytest.mark.parametrize(
    "attention, mesh, strategy, layout",
    [
        pytest.param("flash", "data=1,context=2", None, "contiguous", marks=pytest.mark.slow),
        ("flash", "data=2,context=2", "ring", "zigzag"),
        pytest.param("dense", "data=2,context=2", None, "zigzag", marks=pytest.mark.slow),
    ],
)
def test_a_mesh_trains_the_losses_of_one_device(
    attention, mesh, strategy, layout, one_device_records, tmp_path, monkeypatch
):
    """Batch over "data", sequence over "context" (for flash in `layout`; dense keeps natural order): the same
    train and validation losses as one device, up to float32 summation order. Flash's default strategy at this
    length gathers K/V; "ring" forces the ring."""
    if strategy:
        monkeypatch.setattr(parallel, "choose_strategy", lambda *_: strategy)
    records = _train_records(tmp_path, "--attention", attention, "--mesh", mesh, "--context_layout", layout)
    for ours, reference in zip(_curves(records), _curves(one_device_records(attention))):
        assert ours.shape == reference.shape
        assert_close(ours, reference, np.float32)
    assert json.loads((tmp_path / "config.json").read_text())["mesh"] == mesh
    assert json.loads((tmp_path / "run.json").read_text())["config"]["mesh"] == mesh


@pytest.mark.slow  # CI's time: resuming keeps test_resume_reproduces_the_next_loss_exactly in CI
def test_a_checkpoint_resumes_on_another_mesh(tmp_path):
    """Checkpoints hold replicated parameters and record the model without its mesh: a one-device run continues
    on a mesh, with dropout drawing the same masks (the RNG is partitionable; in natural token order: the zig-zag
    layout draws the same masks for its permuted tokens, so other tokens get them)."""
    args = MESH_RUN + ["--checkpoint_every", "2", "--run_dir", str(tmp_path), "--model.dropout_rate", "0.1"]
    train_main.main(args)
    reference = _losses(tmp_path / "metrics.jsonl")
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    (tmp_path / "run.json").unlink()
    train_main.main(args + ["--mesh", "data=2,context=2", "--context_layout", "contiguous", "--resume"])
    resumed = _losses(tmp_path / "metrics.jsonl")
    assert sorted(resumed) == [1, 2, 3, 4]
    assert_close([resumed[s] for s in (3, 4)], [reference[s] for s in (3, 4)], np.float32)


def test_a_mesh_needs_its_devices(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main.main(MESH_RUN + ["--mesh", "context=16", "--run_dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2 and "mesh='context=16': needs 16 devices" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # CI's time: test_context_search_doubles_until_a_step_fails keeps the search itself in CI
def test_the_context_search_runs_on_the_mesh():
    """Each probe is a real train step on the run's mesh, its batch rounded up to the data axis."""
    cfg = parse_args(SMALL + ["--mesh", "data=2,context=2", "--max_context", "128"])
    search = loop.find_max_context(cfg, "flash", log=lambda _: None)
    assert [p["fits"] for p in search["probes"]] == [True, True] and search["longest"] == 128
    assert (search["batch_size"], search["devices"], search["mesh"]) == (2, 4, "data=2,context=2")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mesh, strategy", [("data=1,context=2", "ring"), ("data=1,context=2", "all_gather"), ("data=2,context=1", None)]
)
def test_two_gpus_train_the_losses_of_one(mesh, strategy, tmp_path, monkeypatch):
    """The GPU presets' bfloat16 at a context the kernels tile (512, head_dim 64): two GPUs against one, within
    bfloat16's output tolerance (each device's kernels see other tiles than the one-device call)."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    if strategy:
        monkeypatch.setattr(parallel, "choose_strategy", lambda *_: strategy)
    # The default corpus size: SMALL's 400 kB of another machine's standard library can hold less than one window.
    gpu = ["--seq_len", "512", "--model.embed_dim", "128", "--model.dtype", "bfloat16", "--corpus_bytes", "4000000"]
    reference = _curves(_train_records(tmp_path / "one", *gpu))
    for ours, want in zip(_curves(_train_records(tmp_path / "two", *gpu, "--mesh", mesh)), reference):
        assert_close(ours, want, jnp.bfloat16)
