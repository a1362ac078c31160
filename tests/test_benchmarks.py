"""The benchmark harness (`python -m benchmarks`): every suite's --smoke run on CPU, so the harness never rots;
its argument errors; where it writes by default; the paired timing."""

import contextlib
import datetime
import gzip
import io
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import __main__ as harness
from benchmarks import bar, decode, flex, report, ring, suites, timing
from benchmarks.inputs import PASSES

REQUIRED = {
    "suite",
    "impl",
    "pass",
    "batch",
    "seq_q",
    "seq_k",
    "heads",
    "kv_heads",
    "head_dim",
    "causal",
    "dtype",
    "ms",
    "tflops",
    "baseline",
    "ratio_to_baseline",
    "ratio_interval",
    "temp_bytes",
    "device",
    "jax_version",
    "command",
    "status",
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """`python -m benchmarks all --smoke` once: {suite: its records}, the folders, and what it printed."""
    out = tmp_path_factory.mktemp("bench")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        folders = harness.main(["all", "--smoke", "--out", str(out)])
    records = {}
    for suite, folder in folders.items():
        with open(os.path.join(folder, "results.json")) as f:
            records[suite] = json.load(f)
    return records, folders, printed.getvalue(), out


def test_every_suite_writes_its_table_plot_and_command(smoke):
    records, folders, printed, out = smoke
    assert set(folders) == set(harness.SUITES)
    for suite, folder in folders.items():
        assert folder == os.path.join(str(out), suite)
        for name in ("results.json", "results.md", f"{suite}.png"):
            assert os.path.getsize(os.path.join(folder, name)) > 0, (suite, name)
        assert f"regenerate: python -m benchmarks {suite} --smoke" in printed
        assert {r["command"] for r in records[suite]} == {f"python -m benchmarks {suite} --smoke"}
    assert "### sweep" in printed and "smoke run" in printed


def test_record_suites_check_before_they_time(smoke):
    records, *_ = smoke
    for suite in suites.SUITES:
        rows = records[suite]
        assert rows and {r["suite"] for r in rows} == {suite}
        for r in rows:
            assert REQUIRED <= set(r), sorted(REQUIRED - set(r))
            assert r["pass"] in PASSES and r["status"] in ("ok", "skip"), r  # no FAIL: all agree with the reference
        ok = [r for r in rows if r["status"] == "ok"]
        assert {(r["pass"]) for r in ok} == {r["pass"] for r in rows}, suite  # every pass measured something
        assert all(r["rel_err"] <= r["tolerance"] for r in ok)
        if suite != "memory":
            assert all(r["ms"] > 0 for r in ok)
    seed = records["seed"]
    assert {"pf:pallas", "pallas_triton_ref"} <= {r["impl"] for r in seed if r["status"] == "ok"}  # interpret mode
    assert {r["impl"] for r in seed} >= {"cudnn", "xla", "pallas_mgpu_ref"}  # present, skipped off the GPU
    # Every timed number but the baseline's own is a paired ratio with an interval around it.
    paired = [
        r for s in ("seed", "sweep", "backends") for r in records[s] if r["status"] == "ok" and r["impl"] != "pf:xla"
    ]
    assert paired
    for r in paired:
        low, high = r["ratio_interval"]
        assert r["baseline"] == "pf:xla" and low <= r["ratio_to_baseline"] <= high, r
    sparse = [r for r in records["sparse"] if r["status"] == "ok"]
    assert {r["pattern"] for r in sparse} == {"full", "local", "strided"}
    for r in sparse:  # every block-sparse time is paired with the same call under a full block mask
        if r["pattern"] != "full":
            low, high = r["dense_ratio_interval"]
            assert 0 < r["density"] < 1 and low <= r["ratio_to_dense_same_impl"] <= high, r


def test_bar_pairs_every_point(smoke):
    records, *_ = smoke
    rows = records["bar"]
    assert {(r["pass"], r["head_dim"], r["causal"]) for r in rows} == {
        (p, 32, c) for p in ("fwd", "fwdbwd") for c in (False, True)
    }
    for r in rows:
        assert r["impl"] == "xla_chunked" and r["baseline"] == "xla"
        assert r["max_abs_difference"] < 1e-4, r  # xla_chunked against the dense attention, float32
        low, high = r["ratio_interval"]
        assert low <= r["ratio_to_baseline"] <= high and r["verdict"] == timing.verdict(low, high)
        assert r["bitwise_repeatable"] == {"ours": True, "baseline": True}  # XLA on CPU: no atomics


def test_bar_takes_several_baselines_and_skips_those_that_cannot_run():
    """Each baseline gets its own row per point; PyTorch's SDPA (GPU only) is a skip row saying why, not a crash,
    and the markdown gives each baseline its own table."""
    rows = bar.run(passes=["fwd"], head_dims=[32], seqs=[128], causals=[False], baselines=["cudnn", "torch_cudnn"],
                   smoke=True)  # fmt: skip
    assert [(r["baseline"], r["status"]) for r in rows] == [("xla", "ok"), ("torch_cudnn", "skip")]
    assert "CUDA GPU" in rows[1]["note"] and rows[0]["max_abs_difference"] < 1e-4
    text = report.markdown([dict(r, device="cpu", jax_version="x", command="c", date="d") for r in rows])
    assert "ours against xla" in text and "ours against torch_cudnn" in text


def test_bar_times_a_value_head_dim_of_its_own_alone_where_no_peer_runs_it():
    """jax.nn refuses a value head_dim unlike query/key's: that point's row is ours alone ("unpaired"), checked
    against the float32 XLA chunked path, at 2*B*H*N^2*(D + Dv) FLOPs (halved for causal); the square point stays
    paired. `--head-dims` takes D:Dv items and says what it wants of a bad one."""
    assert bar.parse_head_dims("192,192:128") == [(192, None), (192, 128)]
    for bad in ("192:128:64", "192:v"):
        with pytest.raises(ValueError, match="D:Dv"):
            bar.parse_head_dims(bad)
    square, mla = bar.run(passes=["fwd"], head_dims=[32, (32, 16)], seqs=[128], causals=[True], smoke=True)
    assert square["verdict"] != "unpaired" and square["ratio_to_baseline"] > 0
    assert (mla["head_dim"], mla["head_dim_v"], mla["verdict"], mla["status"]) == (32, 16, "unpaired", "ok")
    assert mla["note"].startswith("no peer: ValueError") and mla["max_abs_difference"] < 1e-5
    flops = 2 * mla["batch"] * mla["heads"] * 128 * 128 * (32 + 16) / 2
    assert mla["tflops"] == pytest.approx(flops / (mla["ms"] * 1e-3) / 1e12)
    assert report.bar_row(mla).startswith("| fwd | 32/16 | 128 | 1 | default |")
    assert mla["point"].endswith("-d32-dv16-c1-float32")


def test_flex_times_mod_on_other_hopper_tiles_and_backwards():
    """`--hopper` adds a row per tile set and `--bwd` one per backward (an empty item is mod itself): mod forced
    onto those Hopper tiles, paired with mod (off a Hopper GPU a skip row saying that the Mosaic kernels could not
    run); the table lists them after the named variants."""
    rows = flex.run(seqs=[flex.SMOKE_SEQ], head_dims=[32], passes=["fwd"], names=["alibi"], smoke=True,
                    hopper="64,128,2,persistent;64,64,2", bwd=";dq_overlap=0,num_stages_dq=2",
                    stamp=dict(suites.environment(), command="python -m benchmarks flex"))  # fmt: skip
    by = {r["variant"]: r for r in rows}
    bwd = "mod@bwd:dq_overlap=0,num_stages_dq=2"
    assert set(by) == {"mod", "plain", "mod@64,128,2,persistent", "mod@64,64,2", bwd}
    for variant in ("mod@64,128,2,persistent", bwd):
        assert by[variant]["status"] == "skip" and "mosaic" in by[variant]["note"], by[variant]
    table = [line for line in report.markdown(rows).splitlines() if line.startswith("| alibi |")]
    assert [line.split("|")[4].strip() for line in table][-3:] == ["mod@64,128,2,persistent", "mod@64,64,2", bwd]


def test_flex_pairs_every_modifier_with_our_plain_call(smoke):
    """The flex suite's smoke: each of its cases' forward (and the first case's forward+backward) has a checked
    mod row and the plain call (and the built-in band for the window) paired with it; the document and window rows
    carry the kept-work ratio; the block-mask build is timed against its target."""
    records, *_ = smoke
    rows = records["flex"]
    by = {(r["case"], r["pass"], r["variant"]): r for r in rows}
    names = [case.name for case in flex.cases(flex.SMOKE.window) if case.name in flex.SMOKE_CASES]
    assert len(names) == len(flex.SMOKE_CASES) - 1  # every smoke case is a case, but the block-mask build
    assert {r["case"] for r in rows if r["pass"] == "fwdbwd"} == {names[0]}
    for name in names:
        for pass_ in ("fwd", "fwdbwd") if name == names[0] else ("fwd",):
            mod = by[(name, pass_, "mod")]
            assert mod["status"] == "ok" and mod["impl"] == "pf:xla_chunked" and mod["ms"] > 0, mod
            assert pass_ != "fwd" or mod["rel_err"] <= mod["tolerance"]
            partners = ("plain", "band") if name == "sliding_window" else ("plain",)
            for variant in partners:
                r = by[(name, pass_, variant)]
                low, high = r["ratio_interval"]
                assert r["status"] == "ok" and low <= r["ratio_to_mod"] <= high, r
                assert r["mod_ms"] > 0 and r["tflops"] > 0
    assert {r["case"] for r in rows} == {*names, flex.BLOCK_CLASSES}
    assert {r["variant"] for r in rows if r["status"] == "ok"} == {"mod", "plain", "band"}  # no peers in a smoke run
    document = by[("document", "fwd", "plain")]
    assert document["target"] == flex.DOCUMENT_TARGET and by[("document", "fwd", "mod")]["kept_fraction"] == 0.125
    low, high = document["kept_work_interval"]
    assert low <= document["kept_work_ratio"] <= high
    window = by[("sliding_window", "fwd", "plain")]
    assert window["seq_q"] == 2 * flex.SMOKE_SEQ and window["kept_work_ratio"] > 0
    build = by[(flex.BLOCK_CLASSES, "build", "mod")]
    assert build["ms"] > 0 and build["target"] == flex.BLOCK_CLASSES_TARGET_MS


def test_ring_pairs_every_strategy_with_one_device(smoke):
    """The ring suite's smoke: on 2 CPU devices, every strategy and pass (GQA) is checked against the
    one-device call and paired with it; efficiency is the speed-up over the device count; the zig-zag ring is
    paired with the contiguous one; cuDNN is skipped, with its reason, off the GPU."""
    records, *_ = smoke
    rows = records["ring"]
    by = {(r["pass"], r["kv_heads"], r["variant"]): r for r in rows}
    assert len(by) == len(rows) == len(ring.PASSES) * len(ring.SMOKE.heads) * len(ring.VARIANTS)
    for pass_ in ring.PASSES:
        for heads, kv_heads in ring.SMOKE.heads:
            single = by[(pass_, kv_heads, "single")]
            assert single["status"] == "ok" and single["ms"] > 0 and single["heads"] == heads
            assert single["seq_q"] == 2 * single["seq_per_gpu"] == 2 * ring.SMOKE_SEQ_PER_GPU
            for variant in ring.SHARDED:
                r = by[(pass_, kv_heads, variant.name)]
                assert r["status"] == "ok" and r["devices"] == 2 and r["layout"] == variant.layout, r
                assert r["rel_err"] <= r["tolerance"]
                low, high = r["speedup_interval"]
                assert low <= r["speedup"] <= high and r["efficiency"] == pytest.approx(r["speedup"] / 2)
                assert r["target"] is None  # the targets hold from 32k tokens per device
            zigzag = by[(pass_, kv_heads, "ring_zigzag")]
            low, high = zigzag["contiguous_interval"]
            assert low <= zigzag["ratio_to_contiguous"] <= high and zigzag["contiguous_target"] == ring.ZIGZAG_TARGET
            cudnn = by[(pass_, kv_heads, "cudnn")]
            assert cudnn["status"] == "skip" and "NVIDIA" in cudnn["note"]


def test_ring_records_a_single_device_out_of_memory_and_still_times_the_shards(monkeypatch):
    """Where the whole sequence does not fit one device, `single` is an OOM row and the sharded variants are timed
    alone (unchecked, unpaired); nothing crashes."""
    import dataclasses

    def whole(implementation):
        def attend(q, k, v):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0TiB")

        return attend

    monkeypatch.setattr(ring, "whole", whole)
    monkeypatch.setattr(ring, "SMOKE", dataclasses.replace(ring.SMOKE, heads=((2, 2),)))
    with contextlib.redirect_stdout(io.StringIO()):
        rows = ring.run(seqs_per_gpu=[32], passes=["fwd"], smoke=True)
    by = {r["variant"]: r for r in rows}
    assert by["single"]["status"] == "oom" and "cudnn" not in by
    for variant in ring.SHARDED:
        r = by[variant.name]
        assert r["status"] == "ok" and r["ms"] > 0 and r["efficiency"] is None and "unchecked" in r["note"], r


def test_decode_pairs_every_cache_and_the_generation_loop(smoke):
    """The decode suite's smoke: every cache's default (the xla entry on the CPU) is checked and timed, the forced
    xla path paired with it; paged caches are paired with the contiguous one and the ragged batch with the uniform
    batch of the same total; GPT.generate's loop is timed against the dense masked-cache loop."""
    records, *_ = smoke
    rows = records["decode"]
    by = {(r["case"], r["variant"]): r for r in rows}
    for case in decode.cases(decode.SMOKE):
        default = by[(case.name, "default")]
        assert default["status"] == "ok" and default["impl"] == "xla" and default["tbs"] > 0, default
        assert default["rel_err"] <= default["tolerance"] and default["fraction_of_peak"] is None  # no peak: CPU
        forced = by[(case.name, "xla")]
        low, high = forced["ratio_interval"]
        assert forced["status"] == "ok" and low <= forced["ratio_to_default"] <= high
        assert (case.name, "cudnn") in by if not case.page_size else (case.name, "cudnn") not in by
        if case.partner:
            low, high = default["partner_interval"]
            assert default["partner"] == case.partner and low <= default["ratio_to_partner"] <= high
    assert by[("ragged", "default")]["kv_bytes"] == by[("uniform", "default")]["kv_bytes"]
    assert {by[(f"paged{p}", "default")]["page_size"] for p in decode.SMOKE.page_sizes} == set(decode.SMOKE.page_sizes)
    for scenario in decode.generations(decode.SMOKE):
        flash, dense = by[(scenario.name, "flash")], by[(scenario.name, "dense")]
        assert flash["tokens_per_s"] > 0 and dense["tokens_per_s"] > 0 and flash["target"] == decode.GENERATION_TARGET
        assert flash["tokens_agree"] == 1.0  # float32, greedy: the dense loop computes the same model
        assert dense["context"] == decode.SMOKE.context >= flash["context"]  # Flax's cache holds the whole context
        low, high = flash["dense_interval"]
        assert low <= flash["ratio_to_dense"] <= high


def test_paged_cache_holds_the_contiguous_keys():
    """`decode.paginate` with its block table reads back the contiguous cache, page for page."""
    import numpy as np

    cache = np.arange(2 * 8 * 1 * 1, dtype=np.float32).reshape(2, 8, 1, 1)
    order = np.random.default_rng(0).permutation(4)
    pages = decode.paginate(cache, 4, order)
    table = order.reshape(2, 2)
    np.testing.assert_array_equal(pages[table].reshape(cache.shape), cache)


@pytest.mark.parametrize("q_len", [1, 3])
def test_dense_decode_baseline_computes_flash_decode(q_len):
    """The dense loop's attention (Flax's masked full-length cache, GQA by repeated key heads) is flash_decode's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_flash as pf
    from tests import tolerances

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, q_len, 4, 16))
    k, v = (jax.random.normal(x, (2, 32, 2, 16)) for x in keys[1:])
    lengths = jnp.array([5, 32], jnp.int32)
    ours = decode.masked_dense_decode(q, k, v, lengths=lengths)
    want = pf.flash_decode(q, k, v, lengths=lengths, implementation="reference")
    assert tolerances.relative_error(np.asarray(ours), np.asarray(want)) <= tolerances.OUTPUT[jnp.float32]


def test_decode_lengths_spread_the_ragged_total_evenly():
    ragged, even = (decode.Case("c", 8, 100, lengths=kind).lengths_of() for kind in ("ragged", "even"))
    assert ragged.min() >= 1 and ragged.max() <= 100 and ragged.sum() == even.sum() and even.max() - even.min() <= 1


@pytest.mark.parametrize(
    "band, documents, visible",
    [
        ((None, None), 1, 16),  # every key
        ((None, 0), 1, 1 + 2 + 3 + 4),  # causal
        ((1, 0), 1, 1 + 2 + 2 + 2),  # the query and one key before it
        ((None, None), 2, 2 * 4),  # two documents of 2
        ((None, 0), 2, 2 * (1 + 2)),
    ],
)
def test_kept_fraction_counts_visible_logits(band, documents, visible):
    assert flex.kept_fraction(4, *band, documents=documents) == visible / 16


def test_kept_fraction_counts_global_keys_once():
    """A causal band of one key to the left with the first key global: rows 2 and 3 see key 0 besides their band."""
    assert flex.kept_fraction(4, 1, 0, global_keys=1) == (1 + 2 + 3 + 3) / 16
    # and query 0 sees every key
    assert flex.kept_fraction(4, 1, 0, global_keys=1, global_queries=True) == (4 + 2 + 3 + 3) / 16


@pytest.mark.parametrize(
    "name",
    [
        "alibi",
        "alibi_causal",
        "bias_table",
        "document",
        "sliding_window",
        "global_window",
        "global_tokens",
        "block_global_local",
    ],
)
def test_cudnn_peer_says_what_the_modifier_does(name):
    """The bias, mask or window the cuDNN rows are given computes the modifier's attention (run here through
    jax.nn's XLA path, on the host)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_flash as pf
    from benchmarks.inputs import Point, random_inputs
    from tests import tolerances

    case = {c.name: c for c in flex.cases(window=8)}[name].at(192)
    point = Point("flex", 2, 192, 192, 2, 2, 32, case.causal, "float32")  # past the global keys and the window
    q, k, v, _ = random_inputs(point, seed=0)
    arrays = {key: jnp.asarray(x) for key, x in case.arrays(point).items()}
    kwargs = flex.cudnn_kwargs(case, arrays, point)
    ours = jax.nn.dot_product_attention(q, k, v, scale=point.scale, implementation="xla", **kwargs)
    ref = pf.flash_attention(q, k, v, scale=point.scale, implementation="xla", **case.mod(arrays))
    assert tolerances.relative_error(np.asarray(ours), np.asarray(ref)) <= tolerances.OUTPUT[jnp.float32]


def test_render_merges_and_redraws(smoke, tmp_path):
    _, folders, *_ = smoke
    with contextlib.redirect_stdout(io.StringIO()):
        written = harness.main(["render", folders["seed"], folders["bar"], "--out", str(tmp_path)])
    assert set(written) == {"seed", "bar"}
    assert os.path.getsize(tmp_path / "bar" / "bar.png") > 0


def test_default_output_folder_is_under_runs(tmp_path, monkeypatch):
    assert harness.default_out("2026-01-02", "NVIDIA H100 80GB HBM3") == os.path.join(
        "runs", "benchmarks", "2026-01-02-h100"
    )
    monkeypatch.chdir(tmp_path)  # a run without --out writes under ./runs/, ignored by git
    with contextlib.redirect_stdout(io.StringIO()):
        written = harness.main(["memory", "--smoke", "--passes", "fwd", "--seqs", "64"])
    expected = os.path.join("runs", "benchmarks", f"{datetime.date.today().isoformat()}-cpu", "memory")
    assert written == {"memory": expected}
    assert (tmp_path / expected / "results.json").exists()
    assert os.listdir(tmp_path) == ["runs"]


@pytest.mark.parametrize(
    "argv, word",
    [
        (["nope"], "nope"),
        (["sweep", "--impls", "nope"], "nope"),
        (["seed", "--passes", "up"], "up"),
        (["bar", "--passes", "up"], "up"),
        (["bar", "--causal", "maybe"], "maybe"),
        (["bar", "--baselines", "cudnn,flash"], "--baselines takes"),
        (["bar", "--hopper", "64,x,2"], "--hopper: want"),
        (["bar", "--bwd", "dq_overlaps=1"], "--bwd: want"),
        (["bar", "--bwd", "", "--two-pass"], "--bwd excludes"),
        (["bar", "--one-pass", "--two-pass"], "not allowed with"),
        (["seed", "--nondeterministic"], "--nondeterministic"),  # a bar option, not a record suite's
        (["flex", "--passes", "up"], "up"),
        (["flex", "--cases", "alibi,nope"], "nope"),
        (["flex", "--impls", "pf:xla"], "--impls"),  # a record suite's option: flex picks its own rows
        (["flex", "--hopper", "64,128,2,fast"], "--hopper: want"),
        (["flex", "--bwd", "dq_overlap=yes"], "--bwd: want"),
        (["ring", "--passes", "bwd"], "bwd"),
        (["ring", "--seqs-per-gpu", "8k"], "--seqs-per-gpu"),
        (["decode", "--cases", "paged64,nope"], "nope"),
    ],
)
def test_bad_arguments_are_named(argv, word, capsys):
    with pytest.raises(SystemExit) as error:
        harness.main(argv)
    assert error.value.code == 2
    assert word in capsys.readouterr().err


def test_paired_ratio_interval_holds_the_median():
    import jax.numpy as jnp

    x = [(jnp.ones((64, 64)),)]
    p = timing.paired_ratio(lambda a: a @ a, x, lambda a: a + 1, reps=7, min_sample_s=0.0)
    assert p.low <= p.ratio <= p.high and p.calls >= 1 and p.ours_ms > 0 and p.theirs_ms > 0
    assert timing.median_interval(list(range(100))) == (40, 59)
    assert [timing.verdict(*i) for i in ((1.01, 1.2), (0.8, 0.99), (0.9, 1.1))] == ["ahead", "behind", "parity"]


def test_bar_hopper_tiles_parse_and_bad_ones_are_named():
    """`--hopper`: ";"-separated forward tiles, printed back as given; a malformed item is a named ValueError."""
    from pallas_flash.hopper.config import HopperConfig

    configs = bar.parse_hopper_configs("64,128,3,persistent;128,64,2;64,128,2,persistent,overlap")
    assert configs == [HopperConfig(64, 128, 3, True), HopperConfig(128, 64, 2), HopperConfig(64, 128, 2, True, True)]
    assert [bar.describe(c) for c in configs] == ["64,128,3,persistent", "128,64,2", "64,128,2,persistent,overlap"]
    assert bar.parse_hopper_configs(None) == [None] and bar.describe(None) == "default"
    for bad in ("64,128", "64,128,2,fast", "64,x,2"):
        with pytest.raises(ValueError, match="--hopper: want"):
            bar.parse_hopper_configs(bad)


def test_bar_bwd_overrides_parse_and_bad_ones_are_named():
    """`--bwd`: ";"-separated HopperBwdConfig overrides (an empty item is the default), flags as 0/1; an unknown
    field or a non-integer value is a named ValueError."""
    items = bar.parse_bwd_overrides(";dq_overlap=1;dq_overlap=1,num_stages_dq=3;dq_atomic=0;portable=1")
    assert items == [
        {},
        {"dq_overlap": True},
        {"dq_overlap": True, "num_stages_dq": 3},
        {"dq_atomic": False},
        {"portable": True},
    ]
    assert all(type(v) is bool for item in items for k, v in item.items() if not k.startswith("num_"))
    assert [bar.describe_bwd(x) for x in items[:3]] == ["", " bwd:dq_overlap=1", " bwd:dq_overlap=1,num_stages_dq=3"]
    assert bar.parse_bwd_overrides(None) == [None]
    for bad in ("dq_overlaps=1", "num_stages_dq=x", "num_stages_dq"):
        with pytest.raises(ValueError, match="--bwd: want"):
            bar.parse_bwd_overrides(bad)
    # A forced backward replaces the head_dim's default; the portable backward after the Hopper forward is a
    # HopperBwdConfig field like any other.
    assert bar.kernel_config(64, 2048, True, True, backward="two-pass").hopper_bwd.dq_atomic is False
    assert bar.kernel_config(128, 2048, True, True, bwd={"portable": True}).hopper_bwd.portable is True
    assert bar.kernel_config(128, 2048, True, True) is None


@pytest.mark.parametrize("tool", ["kernel_breakdown", "train_step_breakdown", "hopper_resources", "tune"])
def test_tools_import_and_explain_themselves(tool, capsys):
    """The GPU tools at least import against today's package layout and print their usage."""
    import importlib

    module = importlib.import_module(f"tools.{tool}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0 and f"python -m tools.{tool}" in capsys.readouterr().out


def test_kernel_table_lists_kernels_by_time():
    """kernel_breakdown's table for a profile without a trace of its own (torch's): busy time per call, then each
    kernel's ms per call and share, largest first."""
    from tools.kernel_breakdown import kernel_table

    lines = kernel_table({"small": 1000.0, "large": 3000.0}, calls=2).splitlines()
    assert lines[0].startswith("device busy 2.00 ms/call")
    assert lines[1].split() == ["1.500", "ms/call", "75.0%", "large"]
    assert lines[2].split() == ["0.500", "ms/call", "25.0%", "small"]


def test_train_step_breakdown_compiler_options_reach_xla():
    """--compiler-option values as XLA takes them: "false" as a bool (XLA's own parser wants "False"), numbers as
    text; a compile with them succeeds, and one with the raw string "false" is what the parsing avoids."""
    from tools.train_step_breakdown import compiler_option

    options = dict(map(compiler_option, ["xla_gpu_enable_triton_gemm=false", "xla_gpu_graph_min_graph_size=1"]))
    assert options == {"xla_gpu_enable_triton_gemm": False, "xla_gpu_graph_min_graph_size": "1"}
    lowered = jax.jit(lambda x: x @ x).lower(jnp.ones((8, 8)))
    lowered.compile(options)
    with pytest.raises(Exception, match="not a valid bool"):
        lowered.compile({"xla_gpu_enable_triton_gemm": "false"})


def test_hopper_resources_names_the_forward_cases(capsys):
    """--forward takes the flex suite's cases and the plain calls, and names them when given another."""
    from tools import hopper_resources

    assert {"plain", "plain_causal", "bias_table", "alibi", "document"} <= set(hopper_resources.forward_cases())
    with pytest.raises(SystemExit) as done:
        hopper_resources.main(["--forward", "nope"])
    assert done.value.code == 2
    assert "--forward takes one of plain, plain_causal, soft_cap_causal" in capsys.readouterr().err


def test_jaxpr_snapshot_is_deterministic(tmp_path):
    """Two snapshots of the same code are byte for byte the same (what a refactor is checked against)."""
    from tools import jaxpr_snapshot

    argv = ["--seqs", "128", "--head-dims", "64", "--families", "portable,hopper"]
    with contextlib.redirect_stdout(io.StringIO()):
        jaxpr_snapshot.main([str(tmp_path / "a"), *argv])
        jaxpr_snapshot.main([str(tmp_path / "b"), *argv])
    names = sorted(os.listdir(tmp_path / "a"))
    assert len(names) == 12 and names == sorted(os.listdir(tmp_path / "b"))
    for name in names:
        text = (tmp_path / "a" / name).read_text()
        assert text == (tmp_path / "b" / name).read_text() and not text.startswith("ERROR"), name
        assert "/tmp" not in text and not re.search(r" at 0x[0-9a-f]+", text)  # no source paths or addresses


def test_gpu_kernel_summary_counts_kinds_and_exposed_collectives(tmp_path):
    """The profile summary of a made-up trace (two steps on two GPUs): the first GPU's busy time, idle gaps, time
    per kind of kernel and the collective's time when nothing else runs; one line for the second GPU."""
    from tools.kernel_breakdown import gpu_kernel_summary

    def kernel(name, ts, dur, pid=1):
        return {"ph": "X", "pid": pid, "name": name, "ts": ts, "dur": dur}

    events = [
        {"name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
    ]
    for step in range(2):
        t = 10_000 * step
        events += [
            kernel("flash_forward_sm90_mosaic_gpu_kernel", t, 4000),
            kernel("ncclDevKernel_SendRecv", t + 3000, 2000),  # 1000 us under the kernel, 1000 alone
            kernel("nvjet_sm90_tst", t + 5000, 500),
            kernel("loop_add_fusion", t + 6000, 260),
            kernel("flash_forward_sm90_mosaic_gpu_kernel", t, 9000, pid=2),
        ]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = gpu_kernel_summary(str(tmp_path), steps=2)
    assert "device busy 5.76 ms/step of a 8.13 ms/step span, 4 kernels/step" in summary
    assert "attention 4.00, collective 2.00, gemm 0.50, other 0.26; collectives alone 1.00" in summary
    # Gaps 500 us (twice, before the fusion) and 3740 us (before the second step's kernel), per step.
    assert "idle between kernels 2.37 ms/step, the longest gap 3740 us (before flash_forward_sm90" in summary
    assert "GPU:1: busy 9.00 ms/step of a 9.50 ms/step span; attention 9.00; collectives alone 0.00" in summary
