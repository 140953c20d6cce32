"""Results as markdown tables and a PNG of busbw against size (matplotlib optional)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from smddp.bench.runner import CaseResult, ImplRun


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


def impl_table(run: ImplRun) -> str:
    """One implementation, nccl-tests style: a row per (size, dtype, op)."""
    lines = [
        "| size | count | dtype | op | iters | time (median) | min | max | spread | algbw GB/s | busbw GB/s |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in run.cases:
        head = f"| {fmt_size(c.nbytes)} | {c.count} | {c.dtype} | {c.op} |"
        if not c.supported:
            lines.append(head + " | unsupported | | | | | |")
            continue
        lines.append(
            head + f" {c.iters} | {fmt_time(c.median_s)} | {fmt_time(c.min_s)} | {fmt_time(c.max_s)} | "
            f"{c.spread * 100:.0f}% | {c.algbw / 1e9:.3f} | {c.busbw / 1e9:.3f} |"
        )
    return "\n".join(lines)


def comparison_table(runs: Sequence[ImplRun]) -> str:
    """Median time and busbw of every implementation side by side, plus smddp's time ratio to each."""
    impls = [r.impl for r in runs]
    keys: list[tuple[int, str, str]] = []
    for r in runs:
        for c in r.cases:
            if (c.nbytes, c.dtype, c.op) not in keys:
                keys.append((c.nbytes, c.dtype, c.op))
    others = [i for i in impls if i != "smddp"]
    head = "| size | dtype | op | " + " | ".join(f"{i} time" for i in impls)
    head += " | " + " | ".join(f"{i} busbw GB/s" for i in impls)
    if "smddp" in impls:
        head += " | " + " | ".join(f"smddp/{i} time" for i in others)
    ncols = head.count("|")
    lines = [head + " |", "| " + " | ".join(["---"] * ncols) + " |"]
    by = {r.impl: {(c.nbytes, c.dtype, c.op): c for c in r.cases} for r in runs}
    for k in keys:
        cells = [fmt_size(k[0]), k[1], k[2]]
        cs: list[CaseResult | None] = [by[i].get(k) for i in impls]
        cells += [fmt_time(c.median_s) if c and c.supported else "-" for c in cs]
        cells += [f"{c.busbw / 1e9:.3f}" if c and c.supported else "-" for c in cs]
        if "smddp" in impls:
            s = by["smddp"].get(k)
            for i in others:
                o = by[i].get(k)
                ok = s and o and s.supported and o.supported and o.median_s > 0
                cells.append(f"{s.median_s / o.median_s:.2f}" if ok and s and o else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def settings_lines(runs: Sequence[ImplRun]) -> str:
    out = []
    for r in runs:
        shown = {k: v for k, v in r.settings.items() if k not in ("daemon_pids",)}
        out.append(f"- **{r.impl}**: `{r.command}`")
        out.append(f"  - settings: `{json.dumps(shown, sort_keys=True)}`")
    return "\n".join(out)


def is_isolated(result: dict[str, Any]) -> bool:
    """A sweep timed in the isolated mode (`--isolated`: one all-reduce per round)."""
    return result.get("config", {}).get("options", {}).get("max_iters") == 1


def mode_line(result: dict[str, Any]) -> str:
    """How a round was timed: one all-reduce after a barrier (isolated), or a run of them back to back."""
    if is_isolated(result):
        return (
            "Mode: **isolated**: every round is a barrier, then one all-reduce, timed alone (the way a "
            "training step meets a collective)."
        )
    return (
        "Mode: **back-to-back**: every round is a barrier, then `iters` all-reduces of the same buffer "
        "one after another, timed together and divided by `iters`."
    )


def sweep_markdown(result: dict[str, Any]) -> str:
    runs = [ImplRun.from_json(r) for r in result["runs"]]
    m = result["machine"]
    parts = [
        f"# smddp-bench sweep: {result['topology_label']}",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores')} cores, {m.get('mem_gib')} GiB, "
        f"kernel {m.get('kernel')}, load average before {m.get('loadavg_1_5_15')}.",
        f"Command: `{result['command']}`",
        "",
        mode_line(result),
        "",
        "Time is the median over rounds of the slowest rank's time per all-reduce; spread is "
        "(max - min) / median; algbw = size / time; busbw = algbw * 2 (n-1)/n with n ranks "
        f"(n = {result['ranks']}). GB/s = 1e9 bytes/s.",
        "",
        "## How each implementation ran",
        "",
        settings_lines(runs),
        "",
        "## Side by side",
        "",
        comparison_table(runs),
    ]
    for r in runs:
        parts += ["", f"## {r.impl}", "", impl_table(r)]
    return "\n".join(parts) + "\n"


def plot_busbw(result: dict[str, Any], path: Path) -> bool:
    """busbw against size, a line per implementation (and dtype/op when several); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = [ImplRun.from_json(r) for r in result["runs"]]
    fig, ax = plt.subplots(figsize=(8, 5))
    combos = sorted({(c.dtype, c.op) for r in runs for c in r.cases})
    styles = ["-", "--", ":", "-."]
    for r in runs:
        for j, (dt, op) in enumerate(combos):
            pts = sorted(
                (c.nbytes, c.busbw / 1e9) for c in r.cases if (c.dtype, c.op) == (dt, op) and c.supported
            )
            if not pts:
                continue
            label = r.impl if len(combos) == 1 else f"{r.impl} {dt} {op}"
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], styles[j % len(styles)], marker="o", label=label
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"all-reduce busbw: {result['topology_label']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
