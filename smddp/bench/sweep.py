"""The nccl-tests style sweep: sizes x dtypes x ops, for smddp and the baselines, on one topology."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from smddp.bench.report import plot_busbw, sweep_markdown
from smddp.bench.runner import (
    DEFAULT_IMPLS,
    IMPLS,
    ImplRun,
    RunOptions,
    Topology,
    have_torch,
    machine_info,
    place,
    run_impl,
    stats,
)
from smddp.bench.worker import ITEMSIZE, Case

#: 4 KiB to 256 MiB in steps of 4x (the issue's range).
DEFAULT_SIZES = tuple(4096 << (2 * i) for i in range(9))


@dataclass(frozen=True)
class SweepConfig:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    dtypes: tuple[str, ...] = ("float32",)
    ops: tuple[str, ...] = ("sum",)
    impls: tuple[str, ...] = DEFAULT_IMPLS
    topology: Topology = field(default_factory=Topology)
    options: RunOptions = field(default_factory=RunOptions)
    rounds: int = 1  # launches per implementation, interleaved; their rounds are pooled
    outdir: str = "bench-results"
    name: str = "sweep"  # file stem: NAME.json, NAME.md, NAME.png
    command: str = ""  # the command line that asked for this, for the report

    def __post_init__(self) -> None:
        for d in self.dtypes:
            if d not in ITEMSIZE:
                raise ValueError(f"unknown dtype {d!r} (known: {', '.join(ITEMSIZE)})")
        for i in self.impls:
            if i not in IMPLS:
                raise ValueError(f"unknown implementation {i!r} (known: {', '.join(IMPLS)})")
        if self.rounds < 1:
            raise ValueError("rounds must be at least 1")

    def cases(self) -> list[Case]:
        return [Case(s, d, o) for s in self.sizes for d in self.dtypes for o in self.ops]


def merge(runs: list[ImplRun]) -> ImplRun:
    """Several launches of one implementation as one: their rounds pooled, statistics recomputed."""
    first = runs[0]
    for i, c in enumerate(first.cases):
        for r in runs[1:]:
            c.times = c.times + r.cases[i].times
        stats(c, first.ranks)
    first.wall_s = sum(r.wall_s for r in runs)
    return first


def run_sweep(cfg: SweepConfig, log: TextIO = sys.stderr) -> dict[str, Any]:
    """Run the sweep, write NAME.json, NAME.md and (with matplotlib) NAME.png; returns the result."""
    impls = [i for i in cfg.impls if i != "gloo" or have_torch()]
    skipped = [i for i in cfg.impls if i not in impls]
    if skipped:
        print(f"smddp-bench: torch is not installed, skipping {skipped}", file=log)
    machine = machine_info()
    per_impl: dict[str, list[ImplRun]] = {i: [] for i in impls}
    with place(cfg.topology, cfg.options) as p:
        for rnd in range(cfg.rounds):
            for impl in impls:
                print(f"smddp-bench: round {rnd + 1}/{cfg.rounds} {impl}", file=log, flush=True)
                per_impl[impl].append(run_impl(impl, p, cfg.cases(), log))
    machine["loadavg_after"] = list(os.getloadavg())
    runs = [merge(per_impl[i]) for i in impls]
    result: dict[str, Any] = {
        "kind": "sweep",
        "command": cfg.command,
        "config": asdict(cfg),
        "topology_label": cfg.topology.label(),
        "ranks": cfg.topology.workers,
        "machine": machine,
        "skipped": skipped,
        "runs": [r.to_json() for r in runs],
    }
    write_outputs(result, Path(cfg.outdir), cfg.name, log)
    return result


def write_outputs(result: dict[str, Any], outdir: Path, name: str, log: TextIO) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (outdir / f"{name}.md").write_text(sweep_markdown(result))
    if plot_busbw(result, outdir / f"{name}.png"):
        print(f"smddp-bench: wrote {outdir}/{name}.json, .md, .png", file=log)
    else:
        print(f"smddp-bench: wrote {outdir}/{name}.json, .md (no matplotlib: no plot)", file=log)


def rewrite_outputs(path: str, outdir: str = "", log: TextIO = sys.stderr) -> None:
    """NAME.md and NAME.png again from a sweep's NAME.json (after merging or moving results)."""
    src = Path(path)
    try:
        result = json.loads(src.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable sweep result ({e})") from e
    if not isinstance(result, dict) or result.get("kind") != "sweep":
        raise ValueError(f'{path}: not a sweep result (its JSON has no "kind": "sweep")')
    write_outputs(result, Path(outdir) if outdir else src.parent, src.stem, log)
