"""One Chrome/Perfetto trace event (a complete "X" span), as the daemons and the ranks both write them."""

from __future__ import annotations

from typing import Any


def span(
    name: str, start: float, end: float, process: str, lane: str, args: dict[str, Any]
) -> dict[str, Any]:
    """A span from `start` to `end` (wall-clock seconds) in lane `lane` of `process`; `cat` is the lane."""
    return {
        "name": name,
        "cat": lane,
        "ph": "X",
        "ts": start * 1e6,
        "dur": max(end - start, 0.0) * 1e6,
        "pid": process,
        "tid": lane,
        "args": args,
    }
