"""The benchmark harness's --smoke run: every suite at tiny sizes on CPU, so the harness never rots."""
import json
import os

import pytest

from benchmarks import attention

REQUIRED = {"suite", "impl", "pass", "batch", "seq_q", "seq_k", "heads", "kv_heads", "head_dim", "causal", "dtype",
            "ms", "tflops", "ratio_to_cudnn", "temp_bytes", "device", "jax_version"}


def test_smoke_writes_every_suite(tmp_path, capsys):
    out = attention.main(["--smoke", "--suite", "all", "--out", str(tmp_path)])
    with open(os.path.join(out, "results.json")) as f:
        records = json.load(f)
    assert {r["suite"] for r in records} == set(attention.SUITES)
    for r in records:
        assert REQUIRED <= set(r), sorted(REQUIRED - set(r))
        assert r["pass"] in attention.PASSES
        assert r["status"] in ("ok", "fail", "skip"), r
        assert r["status"] != "fail", r  # the reference implementations must agree with the reference
    ok = [r for r in records if r["status"] == "ok"]
    # Every suite and pass measured something; every timed number came after a passing check.
    assert {(r["suite"], r["pass"]) for r in ok} >= {(r["suite"], r["pass"]) for r in records}
    assert all(r["rel_err"] <= r["tolerance"] for r in ok)
    assert all(r["ms"] > 0 for r in ok if r["suite"] != "memory")
    assert {"pf:pallas", "pallas_triton_ref"} <= {r["impl"] for r in ok}  # interpret mode, seed fwd
    assert {r["impl"] for r in records} >= {"cudnn", "xla", "pallas_mgpu_ref"}  # present, skipped off GPU
    sparse = [r for r in ok if r["suite"] == "sparse"]
    assert {r["pattern"] for r in sparse} == {"full", "local", "strided"}
    for r in sparse:  # every block-sparse time is set against the same call with a full block mask
        assert 0 < r["density"] <= 1 and r["ratio_to_dense_same_impl"] > 0, r
    for name in ("results.md", "seed.png", "sweep.png", "memory.png", "backends.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    printed = capsys.readouterr().out
    assert "### sweep" in printed and "smoke run" in printed


def test_bad_arguments_are_named():
    for argv, word in ((["--suite", "nope"], "nope"), (["--impls", "nope"], "nope"), (["--passes", "up"], "up")):
        try:
            attention.main(argv)
        except SystemExit as e:
            assert word in str(e)
        else:
            raise AssertionError(f"{argv} was accepted")


def test_bar_smoke_pairs_every_point(tmp_path):
    """benchmarks/bar.py on CPU: every (pass, head_dim, causal) point compiled, compared and timed in pairs."""
    from benchmarks import bar
    out = tmp_path / "bar.jsonl"
    bar.main(["--smoke", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["pass"], r["head_dim"], r["causal"]) for r in records} == {
        (p, d, c) for p in ("fwd", "fwdbwd") for d in (16, 32) for c in (False, True)}
    for r in records:
        assert r["max_abs_difference"] < 1e-4, r  # xla_chunked against the dense reference, float32
        low, high = r["interval"]
        assert low <= r["ratio"] <= high and r["verdict"] in ("ahead", "behind", "parity")
        assert r["bitwise_repeatable"] == {"ours": True, "theirs": True}  # XLA on CPU: no atomics


def test_bar_hopper_tiles_parse_and_bad_ones_are_named():
    """`--hopper`: ";"-separated forward tiles, printed back as given; a malformed item is a named ValueError."""
    from benchmarks import bar
    from pallas_flash.config import HopperConfig
    configs = bar.parse_hopper_configs("64,128,3,persistent;128,64,2;64,128,2,persistent,overlap")
    assert configs == [HopperConfig(64, 128, 3, True), HopperConfig(128, 64, 2),
                       HopperConfig(64, 128, 2, True, True)]
    assert [bar.describe(c) for c in configs] == ["64,128,3,persistent", "128,64,2", "64,128,2,persistent,overlap"]
    assert bar.parse_hopper_configs(None) == [None] and bar.describe(None) == "default"
    for bad in ("64,128", "64,128,2,fast", "64,x,2"):
        with pytest.raises(ValueError, match="--hopper: want"):
            bar.parse_hopper_configs(bad)


def test_bar_bwd_overrides_parse_and_bad_ones_are_named():
    """`--bwd`: ";"-separated HopperBwdConfig overrides (an empty item is the default), flags as 0/1, printed
    back in the tiles column; an unknown field or a non-integer value is a named ValueError."""
    from benchmarks import bar
    items = bar.parse_bwd_overrides(";dq_overlap=1;dq_overlap=1,num_stages_dq=3;dq_atomic=0;dkv_overlap=1")
    assert items == [{}, {"dq_overlap": True}, {"dq_overlap": True, "num_stages_dq": 3}, {"dq_atomic": False},
                     {"dkv_overlap": True}]
    assert all(type(v) is bool for item in items for k, v in item.items() if not k.startswith("num_"))
    assert [bar.describe_bwd(x) for x in items[:3]] == ["", " bwd:dq_overlap=1", " bwd:dq_overlap=1,num_stages_dq=3"]
    assert bar.parse_bwd_overrides(None) == [None]
    for bad in ("dq_overlaps=1", "num_stages_dq=x", "num_stages_dq"):
        with pytest.raises(ValueError, match="--bwd: want"):
            bar.parse_bwd_overrides(bad)
