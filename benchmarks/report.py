"""Markdown tables and PNG plots from benchmark records (the list a suite writes to results.json)."""

from __future__ import annotations

import os
import re

PASS_ORDER = ("fwd", "bwd", "fwdbwd")
MB = 2**20
# The PyTorch SDPA backends the `backends` suite mirrors with our implementations.
BACKEND_LABELS = {"pf:xla": "math", "pf:pallas": "flash", "pf:xla_chunked": "memory-efficient"}


def slug(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; other devices: their name, lower-case, dashed."""
    match = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", device)
    if match and device.upper().startswith("NVIDIA"):
        return match.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"


def _mb(value):
    return "-" if value is None else f"{value / MB:.0f}"


def progress_line(r) -> str:
    head = (
        f"{r['suite']:8s} {r['impl']:18s} {r['pass']:6s} b{r['batch']} n{r['seq_q']} h{r['heads']} "
        f"d{r['head_dim']} c{int(r['causal'])} {r['dtype']:8s}"
    )
    if r.get("pattern"):
        head += f" {r['pattern']} density {r['density']:.3f}"
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()}: {r['note']}"
    timing = f"{r['ms']:9.3f} ms {r['tflops']:6.1f} TFLOP/s" if r.get("ms") else "untimed"
    return f"{head} {timing}  temp {_mb(r['temp_bytes'])} MB  peak {_mb(r['peak_bytes'])} MB  err {r['rel_err']:.1e}"


def _cell(r, what="tflops"):
    if r is None:
        return "-"
    if r["status"] == "fail":
        return "FAIL"
    if r["status"] != "ok":
        return "OOM" if r["note"] == "out of memory" else "-"
    if what == "tflops":
        text = f"{r['tflops']:.0f}"
        return text + (f" ({r['ratio_to_baseline']:.2f}x)" if r.get("ratio_to_baseline") else "")
    return _mb(r[what])


def _impl_order(records):
    """Implementations in first-seen order, leaving out those that ran nowhere (the notes say why)."""
    names = []
    for r in records:
        if r["impl"] not in names and (r["status"] != "skip" or r["note"] == "out of memory"):
            names.append(r["impl"])
    return names


def _header(records) -> list[str]:
    envs = {
        (r["device"], r["jax_version"], r.get("jaxlib_version"), r.get("cuda_version"), r.get("cudnn_version"))
        for r in records
    }
    lines = [
        f"- device {d}, JAX {j}"
        + "".join(f", {name} {v}" for name, v in (("jaxlib", jl), ("CUDA runtime", c), ("cuDNN", cd)) if v is not None)
        for d, j, jl, c, cd in sorted(envs, key=str)
    ]
    lines += [f"- command: `{cmd}`" for cmd in sorted({r["command"] for r in records})]
    baselines = sorted({r["baseline"] for r in records if r.get("baseline")})
    if baselines:
        paired = any(r.get("ratio_interval") for r in records)
        lines.append(
            f"- x {'/'.join(baselines)}: its ms / this ms (> 1: faster), "
            + ("median of interleaved pairs (~95% interval in results.json)" if paired else "from separate medians")
        )
    if any(r.get("smoke") for r in records):
        lines.append("- **smoke run (CPU, tiny sizes): the times are not measurements of anything**")
    return lines


def _notes(records) -> list[str]:
    by_note = {}
    for r in records:
        if r["status"] != "ok" and r["note"] != "out of memory":
            by_note.setdefault((r["impl"], r["status"].upper(), r["note"]), []).append(r["pass"])
    notes = [
        f"{impl} ({', '.join(p for p in PASS_ORDER if p in passes)}): {status} {note}"
        for (impl, status, note), passes in sorted(by_note.items())
    ]
    converted = sorted(
        {
            f"{r['impl']} ran in {r['dtype']} (it rejects {r['requested_dtype']})"
            for r in records
            if r["dtype"] != r["requested_dtype"] and r["status"] == "ok"
        }
    )
    out = [f"- {n}" for n in converted + notes]
    return ["", "Notes:"] + out if out else []


def _point_table(records, title):
    lines = [
        f"### {title}",
        "",
        *_header(records),
        "",
        "| shape | impl | pass | ms | TFLOP/s | x baseline | XLA temp MB | peak MB | rel err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        shape = (
            f"B={r['batch']} N={r['seq_q']} H={r['heads']} D={r['head_dim']} {r['requested_dtype']}"
            f"{' causal' if r['causal'] else ''}"
        )
        label = r["impl"]
        if r["suite"] == "backends":
            label += f" ({BACKEND_LABELS[r['impl']]})" if r["impl"] in BACKEND_LABELS else ""
        if r["status"] != "ok":
            lines.append(f"| {shape} | {label} | {r['pass']} | {r['status'].upper()} | | | | | |")
            continue
        ratio = f"{r['ratio_to_baseline']:.2f}" if r.get("ratio_to_baseline") else "-"
        lines.append(
            f"| {shape} | {label} | {r['pass']} | {r['ms']:.3f} | {r['tflops']:.0f} | {ratio} | "
            f"{_mb(r['temp_bytes'])} | {_mb(r['peak_bytes'])} | {r['rel_err']:.1e} |"
        )
    return lines + _notes(records) + [""]


def _sweep_tables(records):
    impls = _impl_order(records)
    lines = ["### sweep: TFLOP/s (x baseline)", "", *_header(records), ""]
    for pass_ in PASS_ORDER:
        rows = [r for r in records if r["pass"] == pass_]
        if not rows:
            continue
        lines += [
            f"#### {pass_}",
            "",
            "| D | N | B x H | causal | " + " | ".join(impls) + " |",
            "|---|---|---|---|" + "---|" * len(impls),
        ]
        keys = sorted(
            {(r["head_dim"], r["seq_q"], r["batch"], r["heads"], r["causal"]) for r in rows},
            key=lambda k: (-k[0], k[4], k[1]),
        )
        for d, n, b, h, causal in keys:
            cells = []
            for impl in impls:
                match = [r for r in rows if (r["impl"], r["head_dim"], r["seq_q"], r["causal"]) == (impl, d, n, causal)]
                cells.append(_cell(match[0] if match else None))
            lines.append(f"| {d} | {n} | {b} x {h} | {int(causal)} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines + _notes(records) + [""]


def _memory_table(records):
    impls = _impl_order(records)
    passes = [p for p in PASS_ORDER if any(r["pass"] == p for r in records)]
    r0 = records[0]
    lines = [
        f"### memory: B={r0['batch']} H={r0['heads']} D={r0['head_dim']} {r0['requested_dtype']}"
        f"{' causal' if r0['causal'] else ''}; MB, peak device memory of one call (XLA temp)",
        "",
        *_header(records),
        "",
        "| N | " + " | ".join(f"{i} {p}" for p in passes for i in impls) + " |",
        "|---|" + "---|" * (len(impls) * len(passes)),
    ]
    for n in sorted({r["seq_q"] for r in records}):
        cells = []
        for p in passes:
            for impl in impls:
                match = [r for r in records if (r["impl"], r["pass"], r["seq_q"]) == (impl, p, n)]
                r = match[0] if match else None
                cells.append(
                    _cell(r, "peak_bytes") + f" ({_cell(r, 'temp_bytes')})" if r and r["status"] == "ok" else _cell(r)
                )
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return (
        lines
        + [
            "",
            "OOM: out of device memory; '-': not run or not measured (the high-water mark "
            "did not rise, see benchmarks/suites.py).",
        ]
        + _notes(records)
        + [""]
    )


def _sparse_table(records):
    lines = [
        "### sparse: block-sparse time against the same implementation with a full block mask",
        "",
        *_header(records),
        "",
        "| shape | impl | pass | pattern | density | ms | x dense (same impl) | TFLOP/s (computed blocks) | rel err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(
        records,
        key=lambda r: (
            r["seq_q"],
            r["impl"],
            PASS_ORDER.index(r["pass"]),
            r["pattern"] != "full",
            r["pattern"],
            -r["density"],
        ),
    )
    for r in order:
        shape = f"B={r['batch']} N={r['seq_q']} H={r['heads']} D={r['head_dim']} {r['requested_dtype']}"
        head = f"| {shape} | {r['impl']} | {r['pass']} | {r['pattern']} | {r['density']:.3f} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status'].upper()} | | | |")
            continue
        ratio = f"{r['ratio_to_dense_same_impl']:.2f}" if r.get("ratio_to_dense_same_impl") else "-"
        lines.append(f"{head} {r['ms']:.3f} | {ratio} | {r['tflops']:.0f} | {r['rel_err']:.1e} |")
    return lines + _notes(records) + [""]


def _bar_label(r) -> str:
    """A bar record's variant: forward tiles, backward overrides or forced backward, deterministic or not."""
    parts = [] if r.get("variant", "default") == "default" else [r["variant"]]
    if r.get("backward", "default") != "default":
        parts.append(f"{r['backward']} backward")
    if not r.get("deterministic", True):
        parts.append("deterministic=False")
    return ", ".join(parts) or "default"


def bar_header(baseline: str) -> list[str]:
    """The bar table's two header lines."""
    return [
        f"| pass | D | N | causal | variant | ours ms (TFLOP/s) | {baseline} ms | {baseline} / ours (~95% interval) "
        f"| verdict | max abs diff | bitwise repeatable (ours/{baseline}) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def head_dims(r) -> str:
    """A record's head_dim, or "query/value" head dims where value has its own."""
    return f"{r['head_dim']}/{r['head_dim_v']}" if r.get("head_dim_v") else str(r["head_dim"])


def _head_dims_order(r):
    return r["head_dim"], r.get("head_dim_v") or r["head_dim"]


def bar_row(r) -> str:
    """One bar record as a row of that table."""
    head = (
        f"| {'fwd+bwd' if r['pass'] == 'fwdbwd' else r['pass']} | {head_dims(r)} | {r['seq_q']} | "
        f"{int(r['causal'])} | {_bar_label(r)}{' (superseded)' if r.get('superseded_by') else ''} |"
    )
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()}: {r['note']} | | | | | |"
    repeat = r.get("bitwise_repeatable") or {}
    repeat = "/".join({True: "yes", False: "no"}.get(repeat.get(k), "-") for k in ("ours", "baseline"))
    diff = f"{r['max_abs_difference']:.1e}" if r.get("max_abs_difference") is not None else "-"
    if r["ratio_to_baseline"] is None:  # no peer runs this point: ours alone, against the float32 XLA path
        return f"{head} {r['ms']:.3f} ({r['tflops']:.0f}) | - | - | {r['verdict']} | {diff} | {repeat} |"
    low, high = r["ratio_interval"]
    return (
        f"{head} {r['ms']:.3f} ({r['tflops']:.0f}) | {r['baseline_ms']:.3f} | {r['ratio_to_baseline']:.3f} "
        f"({low:.3f}-{high:.3f}) | {r['verdict']} | {diff} | {repeat} |"
    )


def _bar_table(records):
    """One table per baseline (cuDNN through JAX, through PyTorch's SDPA), each with its own header."""
    lines = []
    for base in dict.fromkeys(r.get("baseline", "baseline") for r in records):
        rows = [r for r in records if r.get("baseline", "baseline") == base]
        labels = sorted({r["baseline_label"] for r in rows if r.get("baseline_label") not in (None, base)})
        lines += [
            f"### bar: ours against {base}, timed in interleaved pairs",
            "",
            *_header(rows),
            *([f"- {base}: {', '.join(labels)}"] if labels else []),
            "",
            *bar_header(base),
            *(bar_row(r) for r in rows),
        ]
        superseded = sorted({r["superseded_by"] for r in rows if r.get("superseded_by")})
        notes = [f"- superseded: measured again later ({s})" for s in superseded]
        lines += ([""] + notes if notes else []) + [""]
    return lines


def flex_header() -> list[str]:
    """The flex table's two header lines."""
    return [
        "| case | N | pass | variant | impl | ms | TFLOP/s (kept) | kept | this / mod (~95% interval) "
        "| kept work (target) | rel err | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def flex_row(r) -> str:
    """One flex record as a row of that table (the note cut at 120 characters; results.json has it whole)."""
    pass_ = "fwd+bwd" if r["pass"] == "fwdbwd" else r["pass"]
    head = f"| {r['case']} | {r['seq_q']} | {pass_} | {r['variant']} | {r['impl'] or '-'} |"
    note = (r["note"] or "")[:120]
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()} | | | | | | {note} |"

    def num(key, fmt):
        return "-" if r.get(key) is None else format(r[key], fmt)

    ratio = "-"
    if r.get("ratio_to_mod") is not None:
        low, high = r["ratio_interval"]
        ratio = f"{r['ratio_to_mod']:.2f} ({low:.2f}-{high:.2f})"
    work = num("kept_work_ratio", ".2f")
    target = r.get("target")
    if target is not None:  # the block-mask build's is in ms, the document mask's a kept-work ratio
        value, unit = (r["ms"], " ms") if r["case"] == "block_classes" else (r["kept_work_ratio"], "")
        work += f" (<= {target:g}{unit}: {'met' if value <= target else 'missed'})"
    return (
        f"{head} {num('ms', '.3f')} | {num('tflops', '.0f')} | {num('kept_fraction', '.3f')} | {ratio} | {work} | "
        f"{num('rel_err', '.1e')} | {note} |"
    )


def _flex_table(records):
    """The flex records in the order they were measured, each case's mod row first."""
    order = {key: i for i, key in enumerate(dict.fromkeys((r["case"], r["point"]) for r in records))}
    # then mod@ rows (--hopper, --bwd), as measured
    variants = ("mod", "plain", "band", "as_mask", "cudnn", "torch_flex")
    rank = lambda v: variants.index(v) if v in variants else len(variants)
    rows = sorted(records, key=lambda r: (order[(r["case"], r["point"])], r["pass"], rank(r["variant"])))
    return [
        "### flex: score_mod, mask_mod and sinks against our plain kernel, cuDNN and torch flex_attention",
        "",
        *_header(records),
        "- this / mod: this row's ms / ours-with-the-modifier's ms (> 1: the modifier in our kernel is faster), "
        "median of interleaved pairs; kept work: mod's ms / this ms scaled to the logits mod keeps",
        "",
        *flex_header(),
        *(flex_row(r) for r in rows),
        "",
    ]


def _interval(value, interval, fmt=".2f") -> str:
    """`value (low-high)`, or '-' where there is no value."""
    if value is None:
        return "-"
    text = format(value, fmt)
    return text + (f" ({interval[0]:{fmt}}-{interval[1]:{fmt}})" if interval else "")


def _against(value, target) -> str:
    """' (>= target: met/missed)' after a value that has a lower bound as its target."""
    if value is None or target is None:
        return ""
    return f" (>= {target:g}: {'met' if value >= target else 'missed'})"


def ring_header() -> list[str]:
    """The ring table's two header lines."""
    return [
        "| pass | tokens/GPU | GPUs | H/Hkv | variant | ms | TFLOP/s | single / this (~95%) | efficiency (target) "
        "| contiguous / zig-zag (target) | rel err | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def ring_row(r) -> str:
    """One ring record as a row of that table (the note cut at 120 characters; results.json has it whole)."""
    pass_ = "fwd+bwd" if r["pass"] == "fwdbwd" else r["pass"]
    head = f"| {pass_} | {r['seq_per_gpu']} | {r['devices']} | {r['heads']}/{r['kv_heads']} | {r['variant']} |"
    note = (r["note"] or "")[:120]
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()} | | | | | | {note} |"
    efficiency = _interval(r.get("efficiency"), r.get("efficiency_interval")) + _against(
        r.get("efficiency"), r.get("target")
    )
    zigzag = _interval(r.get("ratio_to_contiguous"), r.get("contiguous_interval")) + _against(
        r.get("ratio_to_contiguous"), r.get("contiguous_target")
    )
    error = "-" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
    return (
        f"{head} {r['ms']:.3f} | {r['tflops']:.0f} | {_interval(r.get('speedup'), r.get('speedup_interval'))} | "
        f"{efficiency} | {zigzag} | {error} | {note} |"
    )


def _ring_table(records):
    variants = ("single", "ring_zigzag", "ring_contiguous", "all_gather", "cudnn")
    rows = sorted(
        records,
        key=lambda r: (
            PASS_ORDER.index(r["pass"]),
            r["seq_per_gpu"] or 0,
            -r["kv_heads"],
            variants.index(r["variant"]),
        ),
    )
    return [
        "### ring: context parallelism against one GPU on the whole sequence (causal, batch 1)",
        "",
        *_header(records),
        "- single / this: the one-GPU flash_attention's ms / this row's ms, median of interleaved pairs; "
        "efficiency: that over the number of GPUs; contiguous / zig-zag: the two rings paired",
        "",
        *ring_header(),
        *(ring_row(r) for r in rows),
        "",
    ]


def decode_header() -> list[str]:
    """The decode table's two header lines."""
    return [
        "| case | B | keys (capacity) | page | variant | impl | ms | TB/s (of peak) | this / default (~95%) "
        "| cuDNN / this | this / partner | tokens/s | dense / this (target) | rel err | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def decode_row(r) -> str:
    """One decode record as a row of that table (the note cut at 120 characters; results.json has it whole)."""
    page = r.get("page_size") or "-"
    keys = f"{r['kv_tokens']} ({r['batch'] * r['seq']})" if r.get("kv_tokens") else f"{r.get('context', '-')}"
    head = f"| {r['case']} | {r['batch']} | {keys} | {page} | {r['variant']} | {r['impl'] or '-'} |"
    note = (r["note"] or "")[:120]
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()} | | | | | | | | {note} |"
    tbs = "-"
    if r.get("tbs") is not None:
        peak = r.get("fraction_of_peak")
        tbs = f"{r['tbs']:.2f}" + ("" if peak is None else f" ({peak:.0%})")
    partner = "-"
    if r.get("ratio_to_partner") is not None:
        partner = f"{r['partner']}: {_interval(r['ratio_to_partner'], r['partner_interval'])}"
    tokens = "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.0f}"
    dense = _interval(r.get("ratio_to_dense"), r.get("dense_interval")) + _against(
        r.get("ratio_to_dense"), r.get("target")
    )
    error = "-" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
    return (
        f"{head} {r['ms']:.3f} | {tbs} | {_interval(r.get('ratio_to_default'), r.get('ratio_interval'))} | "
        f"{_interval(r.get('ratio_to_cudnn'), r.get('cudnn_interval'))} | {partner} | {tokens} | {dense} | "
        f"{error} | {note} |"
    )


def _decode_table(records):
    return [
        "### decode: flash_decode against cuDNN (one query per sequence), and GPT.generate against a dense loop",
        "",
        *_header(records),
        "- this / default: this row's ms / flash_decode(implementation=None)'s, median of interleaved pairs; "
        "cuDNN / this: cuDNN's ms / the default's; this / partner: ms over the paired case's default "
        "(paged: contiguous, ragged: uniform); TB/s: the keys and values the queries see, over the time",
        "",
        *decode_header(),
        *(decode_row(r) for r in records),
        "",
    ]


def markdown(records) -> str:
    lines = []
    for suite in ("bar", "flex", "ring", "decode", "seed", "sweep", "memory", "backends", "sparse"):
        rows = [r for r in records if r["suite"] == suite]
        if not rows:
            continue
        if suite == "bar":
            lines += _bar_table(rows)
        elif suite == "flex":
            lines += _flex_table(rows)
        elif suite == "ring":
            lines += _ring_table(rows)
        elif suite == "decode":
            lines += _decode_table(rows)
        elif suite == "sweep":
            lines += _sweep_tables(rows)
        elif suite == "memory":
            lines += _memory_table(rows)
        elif suite == "sparse":
            lines += _sparse_table(rows)
        else:
            lines += _point_table(rows, suite)
    return "\n".join(lines)


def plots(records, out) -> list[str]:
    """One PNG per suite present; returns their paths (none where matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plots")
        return []
    paths = []
    for suite, draw in (
        ("bar", _plot_bar),
        ("flex", _plot_flex),
        ("ring", _plot_ring),
        ("decode", _plot_decode),
        ("sweep", _plot_sweep),
        ("memory", _plot_memory),
        ("seed", _plot_bars),
        ("backends", _plot_bars),
        ("sparse", _plot_sparse),
    ):
        rows = [r for r in records if r["suite"] == suite and r["status"] == "ok" and not r.get("superseded_by")]
        if suite == "bar":  # the plot shows ratios; a point no peer runs has none
            rows = [r for r in rows if r["ratio_to_baseline"] is not None]
        if rows:
            fig = draw(plt, rows, suite)
            path = os.path.join(out, f"{suite}.png")
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            paths.append(path)
    return paths


def _plot_sweep(plt, rows, suite):
    passes = [p for p in PASS_ORDER if any(r["pass"] == p for r in rows)]
    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(
        len(passes), len(panels), figsize=(4 * len(panels), 3.2 * len(passes)), squeeze=False, sharex=True
    )
    for i, pass_ in enumerate(passes):
        for j, (d, causal) in enumerate(panels):
            ax = axes[i][j]
            for impl in _impl_order(rows):
                pts = sorted(
                    (r["seq_q"], r["tflops"])
                    for r in rows
                    if (r["impl"], r["pass"], r["head_dim"], r["causal"]) == (impl, pass_, d, causal)
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl, linestyle="--" if impl == "cudnn" else "-")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{pass_}, D={d}{', causal' if causal else ''}", fontsize=9)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(passes) - 1:
                ax.set_xlabel("sequence length")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(
        f"{rows[0]['device']}, {rows[0]['dtype']}: attention TFLOP/s vs sequence length "
        f"(batch x seq = {rows[0]['batch'] * rows[0]['seq_q']} tokens)",
        fontsize=10,
    )
    return fig


def _plot_memory(plt, rows, suite):
    passes = [p for p in PASS_ORDER if any(r["pass"] == p for r in rows)]
    fig, axes = plt.subplots(1, len(passes), figsize=(5 * len(passes), 3.6), squeeze=False)
    for ax, pass_ in zip(axes[0], passes):
        for color, impl in enumerate(_impl_order(rows)):
            for what, style in (("peak_bytes", "-"), ("temp_bytes", ":")):
                pts = sorted(
                    (r["seq_q"], max(r[what], 1) / MB)
                    for r in rows
                    if (r["impl"], r["pass"]) == (impl, pass_) and r[what] is not None
                )
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=f"C{color}", label=f"{impl} {what.split('_')[0]}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("MB")
        ax.set_title(f"{pass_}: peak device memory (solid), XLA temp (dotted)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0][-1].legend(fontsize=7)
    return fig


def _plot_bars(plt, rows, suite):
    shapes = sorted({r["point"] for r in rows})
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 3.4 * len(shapes)), squeeze=False)
    for (ax_t, ax_m), shape in zip(axes, shapes):
        sub = [r for r in rows if r["point"] == shape]
        passes = [p for p in PASS_ORDER if any(r["pass"] == p for r in sub)]
        impls = _impl_order(sub)
        width = 0.8 / len(passes)
        for k, pass_ in enumerate(passes):
            xs, ms, mem = [], [], []
            for i, impl in enumerate(impls):
                match = [r for r in sub if (r["impl"], r["pass"]) == (impl, pass_)]
                if match:
                    xs.append(i + k * width)
                    ms.append(match[0]["ms"] or 0)
                    best = match[0]["peak_bytes"] if match[0]["peak_bytes"] is not None else match[0]["temp_bytes"]
                    mem.append((best or 0) / MB)
            ax_t.bar(xs, ms, width, label=pass_)
            ax_m.bar(xs, mem, width, label=pass_)
        for ax, label in ((ax_t, "ms (median)"), (ax_m, "MB: peak, else XLA temp")):
            ax.set_xticks([i + width * (len(passes) - 1) / 2 for i in range(len(impls))])
            ax.set_xticklabels(impls, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(shape.split("/", 1)[1], fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot_bar(plt, rows, suite):
    """Ratio to the baseline with its interval against N: one panel per pass and head_dim, one series per
    causality and variant."""
    passes = [p for p in PASS_ORDER if any(r["pass"] == p for r in rows)]
    panels = [head_dims(r) for r in sorted(rows, key=_head_dims_order)]
    panels = list(dict.fromkeys(panels))
    seqs = sorted({r["seq_q"] for r in rows})
    fig, axes = plt.subplots(
        len(passes), len(panels), figsize=(4.6 * len(panels), 3.4 * len(passes)), squeeze=False, sharey=True
    )
    baselines = list(dict.fromkeys(r.get("baseline", "baseline") for r in rows))
    series = sorted(
        {(r["causal"], _bar_label(r), r.get("baseline", "baseline")) for r in rows},
        key=lambda s: (s[1] != "default", baselines.index(s[2]), s),
    )
    for i, pass_ in enumerate(passes):
        for j, d in enumerate(panels):
            ax = axes[i][j]
            for k, (causal, label, base) in enumerate(series):
                pts = sorted(
                    (seqs.index(r["seq_q"]), r["ratio_to_baseline"], *r["ratio_interval"])
                    for r in rows
                    if (r["pass"], head_dims(r), r["causal"], _bar_label(r), r.get("baseline", "baseline"))
                    == (pass_, d, causal, label, base)
                )
                if not pts:
                    continue
                offset = (k - (len(series) - 1) / 2) * 0.08
                xs = [x + offset for x, *_ in pts]
                ys = [y for _, y, _, _ in pts]
                err = [[y - lo for _, y, lo, _ in pts], [hi - y for _, y, _, hi in pts]]
                name = ("causal" if causal else "not causal") + ("" if label == "default" else f", {label}")
                name += f" vs {base}" if len(baselines) > 1 else ""
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, linestyle="-" if causal else "--", label=name)
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_xticks(range(len(seqs)))
            ax.set_xticklabels([f"{n // 1024}k" if n >= 1024 else str(n) for n in seqs])
            ax.set_title(f"{'fwd+bwd' if pass_ == 'fwdbwd' else pass_}, D={d}", fontsize=9)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel(f"{' or '.join(baselines)} ms / ours ms")
            if i == len(passes) - 1:
                ax.set_xlabel(f"sequence length N (batch x N = {rows[0]['batch'] * rows[0]['seq_q']} tokens)")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle(
        f"{rows[0]['device']}, {rows[0]['dtype']}: ratio to {' and '.join(baselines)} "
        "(> 1: ours faster), median of interleaved pairs, ~95% interval",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def _plot_sparse(plt, rows, suite):
    """Block-sparse time over dense time (same implementation) against the mask's density."""
    passes = [p for p in PASS_ORDER if any(r["pass"] == p for r in rows)]
    fig, axes = plt.subplots(1, len(passes), figsize=(5 * len(passes), 3.8), squeeze=False, sharey=True)
    for ax, pass_ in zip(axes[0], passes):
        sub = [r for r in rows if r["pass"] == pass_ and r["pattern"] != "full"]
        sub = [r for r in sub if r.get("ratio_to_dense_same_impl")]
        for key in sorted({(r["impl"], r["pattern"], r["seq_q"]) for r in sub}):
            pts = sorted(
                (r["density"], r["ratio_to_dense_same_impl"], r.get("dense_ratio_interval"))
                for r in sub
                if (r["impl"], r["pattern"], r["seq_q"]) == key
            )
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            err = None
            if all(p[2] for p in pts):
                err = [[y - p[2][0] for y, p in zip(ys, pts)], [p[2][1] - y for y, p in zip(ys, pts)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{key[0]} {key[1]} N={key[2]}")
        ax.plot([0, 1], [0, 1], ":", color="gray", label="time proportional to density")
        ax.set_xlim(0, 0.55)
        ax.set_ylim(0, 0.7)
        ax.set_xlabel("block-mask density")
        ax.set_title(f"{'fwd+bwd' if pass_ == 'fwdbwd' else pass_}: ms / ms with a full mask", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("time relative to dense")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(
        f"{rows[0]['device']}, {rows[0]['dtype']}, D={rows[0]['head_dim']}: block-sparse attention", fontsize=10
    )
    fig.tight_layout()
    return fig


def _plot_flex(plt, rows, suite):
    """Each case's rows as this / mod with its interval (> 1: the modifier in our kernel is faster), per pass."""
    paired = [r for r in rows if r.get("ratio_to_mod") is not None]
    passes = [p for p in PASS_ORDER + ("build",) if any(r["pass"] == p for r in paired)] or ["fwd"]
    fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 0.3 * len(paired) + 2), squeeze=False)
    for ax, pass_ in zip(axes[0], passes):
        sub = [r for r in paired if r["pass"] == pass_]
        ys = range(len(sub))
        low = [r["ratio_to_mod"] - r["ratio_interval"][0] for r in sub]
        high = [r["ratio_interval"][1] - r["ratio_to_mod"] for r in sub]
        ax.errorbar([r["ratio_to_mod"] for r in sub], ys, xerr=[low, high], fmt="o", capsize=3)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([f"{r['case']} N={r['seq_q']}: {r['variant']}" for r in sub], fontsize=7)
        ax.invert_yaxis()  # the first case on top, as in the table
        ax.axvline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("this ms / mod ms (> 1: mod faster)")
        ax.set_title("fwd+bwd" if pass_ == "fwdbwd" else pass_, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{rows[0]['device']}, {rows[0]['dtype']}: ours with the modifier against the rest", fontsize=10)
    fig.tight_layout()
    return fig


def _plot_ring(plt, rows, suite):
    """Scaling efficiency with its interval against tokens per GPU: one panel per pass, one series per strategy
    and head layout; the pass's target as a dotted line."""
    passes = [p for p in PASS_ORDER if any(r["pass"] == p for r in rows)]
    fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 3.8), squeeze=False, sharey=True)
    for ax, pass_ in zip(axes[0], passes):
        sub = [r for r in rows if r["pass"] == pass_ and r.get("efficiency") is not None]
        for variant, heads, kv_heads in sorted({(r["variant"], r["heads"], r["kv_heads"]) for r in sub}):
            pts = sorted(
                (r["seq_per_gpu"], r["efficiency"], *r["efficiency_interval"])
                for r in sub
                if (r["variant"], r["heads"], r["kv_heads"]) == (variant, heads, kv_heads)
            )
            ys = [y for _, y, _, _ in pts]
            err = [[y - lo for _, y, lo, _ in pts], [hi - y for _, y, _, hi in pts]]
            style = "-" if heads == kv_heads else "--"
            ax.errorbar([x for x, *_ in pts], ys, yerr=err, marker="o", capsize=3, linestyle=style,
                        label=f"{variant} H={heads}/{kv_heads}")  # fmt: skip
        targets = {r["target"] for r in sub if r.get("target")}
        for target in targets:
            ax.axhline(target, color="gray", linestyle=":", linewidth=0.8)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per GPU")
        ax.set_title(f"{'fwd+bwd' if pass_ == 'fwdbwd' else pass_}: single ms / (GPUs x this ms)", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0][0].set_ylabel("scaling efficiency")
    fig.suptitle(f"{rows[0]['device']} x {rows[0]['devices']}, {rows[0]['dtype']}: context parallelism", fontsize=10)
    fig.tight_layout()
    return fig


def _plot_decode(plt, rows, suite):
    """TB/s of each case's variants (the HBM peak dotted), and generation tokens/s of both loops."""
    attention = [r for r in rows if r.get("tbs") is not None]
    generation = [r for r in rows if r.get("tokens_per_s") is not None]
    panels = [p for p in (attention, generation) if p] or [rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.8), squeeze=False)
    if attention:
        ax = axes[0][0]
        labels = [f"{r['case']}: {r['variant']} ({r['impl']})" for r in attention]
        ax.barh(range(len(attention)), [r["tbs"] for r in attention])
        ax.set_yticks(range(len(attention)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        peak = attention[0].get("peak_tbs")
        if peak:
            ax.axvline(peak, color="gray", linestyle=":", label=f"HBM peak {peak} TB/s")
            ax.legend(fontsize=7)
        ax.set_xlabel("TB/s (keys and values seen / time)")
        ax.grid(alpha=0.3)
    if generation:
        ax = axes[0][-1]
        labels = [f"{r['prompt']}+{r['new_tokens']}\n{r['variant']} ({r['context']})" for r in generation]
        ax.bar(range(len(generation)), [r["tokens_per_s"] for r in generation])
        ax.set_xticks(range(len(generation)))
        ax.set_xticklabels(labels, fontsize=7)
        r0 = generation[0]
        ax.set_title(f"{r0['preset']} GPT, B={r0['batch']}: prompt + new tokens, loop (cache)", fontsize=9)
        ax.set_ylabel("generated tokens/s")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{rows[0]['device']}: decoding", fontsize=10)
    fig.tight_layout()
    return fig
