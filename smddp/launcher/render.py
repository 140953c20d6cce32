"""Pictures for people: a job timeline (Chrome trace) and a terminal capture, rendered to PNG."""

from __future__ import annotations

import json
from typing import Any

from smddp.errors import ConfigError

# One colour per phase, the same in every picture.
PHASE_COLOURS = {
    "copy in": "#8dd3c7",
    "in flight": "#d9d9d9",
    "copy out": "#80b1d3",
    "wait for local ranks": "#fdb462",
    "local reduce": "#b3de69",
    "local copy": "#bebada",
    "send": "#fb8072",
    "server reduce": "#33a02c",
    "receive": "#fccde5",
}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("rendering needs matplotlib: pip install 'smddp[bench]'") from None
    return plt


def timeline_png(trace_path: str, png_path: str, first: int = 0, last: int = 0) -> int:
    """Draw every process's phases as lanes over time; returns the number of boxes drawn.

    `first`/`last` limit the picture to collectives with those sequence numbers (0 = all).
    """
    plt = _pyplot()
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    events = [
        e
        for e in events
        if (not first or e["args"]["seq"] >= first) and (not last or e["args"]["seq"] <= last)
    ]
    if not events:
        raise ConfigError(f"{trace_path}: no collectives to draw")
    t0 = min(e["ts"] for e in events)
    procs = sorted({e["pid"] for e in events}, key=lambda p: (not p.startswith("node"), p))
    lanes = [
        (p, ph)
        for p in procs
        for ph in PHASE_COLOURS
        if any(e["pid"] == p and e["cat"] == ph for e in events)
    ]
    index = {lane: i for i, lane in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(14, 0.28 * len(lanes) + 1.5))
    for e in events:
        y = index[(e["pid"], e["cat"])]
        ax.broken_barh(
            [((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.02))],
            (y - 0.4, 0.8),
            facecolors=PHASE_COLOURS.get(e["cat"], "#999999"),
            edgecolor="#555555",
            linewidth=0.3,
        )
    ax.set_yticks(range(len(lanes)), [f"{p}: {ph}" for p, ph in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"smddp timeline: {trace_path.rsplit('/', 1)[-1]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return len(events)


def text_png(text: str, png_path: str, title: str = "") -> None:
    """A terminal capture as a picture (monospace, dark background)."""
    plt = _pyplot()
    lines = text.rstrip("\n").splitlines() or [""]
    width = max(len(line) for line in lines)
    fig = plt.figure(figsize=(max(6.0, width * 0.075), 0.19 * len(lines) + 0.5))
    fig.patch.set_facecolor("#1e1e1e")
    fig.text(0.01, 0.98, "\n".join(lines), family="monospace", fontsize=8.5, color="#e8e8e8", va="top")
    if title:
        fig.suptitle(title, color="#9cdcfe", fontsize=8, x=0.99, ha="right")
    fig.savefig(png_path, dpi=110, facecolor=fig.get_facecolor())
    plt.close(fig)
