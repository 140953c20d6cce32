"""BENCHMARKS.md's section on issue 17's figures, computed from the sweeps, profiles and DDP runs of `make bench`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smddp.bench.report import fmt_size, fmt_time
from smddp.bench.runner import ImplRun

#: Where the last `make bench` of the Python data plane (commit c0bfdf6) left its profiles, and where
#: the headroom profiles measured at that commit for comparison went: the "before" of issue 17.
BEFORE_DIR = "before-engine"
BEFORE_COMMIT = "c0bfdf6"
#: Profiles that are the engine's CPU and headroom figures: (file stem, what it measures).
CPU_PROFILES = (
    ("profile-host4-4k", "1 host, 4 workers, 4 KiB"),
    ("profile-sim4-4k", "4 simulated nodes x 1 at 1 Gbit/s, 4 KiB"),
    ("profile-sim4-64m", "4 simulated nodes x 1 at 1 Gbit/s, 64 MiB"),
    ("profile-sim2-64m", "headroom: 2 simulated nodes x 1, unshaped veth, 64 MiB"),
    ("profile-host2-64m", "headroom: 1 host, 2 daemons (--local-nodes 2) x 1 worker, 64 MiB"),
)
BASELINES = ("mpi", "mpi-ring", "gloo")


@dataclass(frozen=True)
class Figure:
    what: str
    value: float
    cmp: str  # "<=" or ">="
    limit: float
    note: str = ""

    @property
    def met(self) -> bool:
        return self.value <= self.limit if self.cmp == "<=" else self.value >= self.limit


def _medians(sweep: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Each implementation's median time per size (the float32 sums make bench sweeps)."""
    runs = [ImplRun.from_json(r) for r in sweep["runs"]]
    return {
        r.impl: {
            c.nbytes: c.median_s for c in r.cases if c.supported and (c.dtype, c.op) == ("float32", "sum")
        }
        for r in runs
    }


def _best(med: dict[str, dict[int, float]], size: int) -> tuple[str, float]:
    times = [(i, med[i][size]) for i in BASELINES if i in med and size in med[i]]
    return min(times, key=lambda t: t[1]) if times else ("", float("nan"))


def _ratios(med: dict[str, dict[int, float]]) -> dict[int, float]:
    """smddp's time over the best baseline's, per size both measured, smallest size first."""
    mine = med.get("smddp", {})
    return {s: mine[s] / _best(med, s)[1] for s in sorted(mine) if _best(med, s)[0]}


def _slowest(
    what: str, med: dict[str, dict[int, float]], ratios: dict[int, float], limit: float, name_over: bool
) -> Figure:
    """The slowest of `ratios` (size -> smddp over the best baseline) against `limit`; with
    `name_over`, every size above the limit named in the note."""
    worst = max(ratios, key=lambda s: ratios[s])
    over = ", ".join(f"{fmt_size(s)} {r:.2f}" for s, r in ratios.items() if r > limit) if name_over else ""
    note = f"{fmt_size(worst)} against {_best(med, worst)[0]}" + (
        f"; above {limit:g}: {over}" if over else ""
    )
    return Figure(what, ratios[worst], "<=", limit, note)


def sweep_figures(label: str, sweep: dict[str, Any]) -> list[Figure]:
    """The issue's sweep rules: no size slower than 1.5x the best baseline, at or below it from 1 MiB."""
    med = _medians(sweep)
    ratios = _ratios(med)
    if not ratios:
        return []
    figs = [
        _slowest(f"{label}: slowest size against the best of {', '.join(BASELINES)}", med, ratios, 1.5, False)
    ]
    big = {s: r for s, r in ratios.items() if s >= 1 << 20}
    if big:
        figs.append(
            _slowest(f"{label}: from 1 MiB up, the slowest size against the best", med, big, 1.0, True)
        )
    return figs


def small_figure(label: str, sweep: dict[str, Any], limit: float) -> Figure | None:
    med = _medians(sweep)
    s, m = med.get("smddp", {}).get(4096), med.get("mpi", {}).get(4096)
    if s is None or m is None:
        return None
    return Figure(
        f"{label}: 4 KiB, smddp / Open MPI", s / m, "<=", limit, f"{fmt_time(s)} against {fmt_time(m)}"
    )


def large_figure(sweep: dict[str, Any]) -> Figure | None:
    mine = _medians(sweep).get("smddp", {})
    a, b = mine.get(256 << 20), mine.get(1 << 30)
    if a is None or b is None:
        return None
    return Figure(
        "1 host, 2 daemons x 1 worker: 1 GiB time / 256 MiB time",
        b / a,
        "<=",
        4.2,
        f"{fmt_time(b)} against {fmt_time(a)}",
    )


def target_figure(
    targets: dict[str, Any], target: str, name: str, what: str, cmp: str, limit: float
) -> Figure | None:
    """The value of one of issue 4's checks (named by target and name: T1 and T3 both have a
    "time smddp / gloo, 64 MiB"), under issue 17's limit; None where the targets run did not measure it."""
    for c in targets.get("checks", []):
        if (c["target"], c["name"]) == (target, name) and c["value"] == c["value"]:
            return Figure(what, float(c["value"]), cmp, limit)
    return None


def profile_row(pr: dict[str, Any]) -> dict[str, float]:
    """Time, GB/s and daemon CPU of one profile (CPU from /proc over its window, per all-reduce)."""
    nbytes = int(pr["config"]["nbytes"])
    daemons = [p for p in pr["processes"] if p["role"] == "daemon"]
    cpu = [p["user_us"] + p["sys_us"] for p in daemons]
    total_us = sum(cpu)
    return {
        "nbytes": nbytes,
        "wall_us": float(pr["wall_us"]),
        "gbps": nbytes / (pr["wall_us"] * 1e-6) / 1e9,
        "daemon_us": total_us / len(cpu) if cpu else float("nan"),
        "daemon_s_per_gb": total_us * 1e-6 / (nbytes / 1e9),
    }


def _profile_cells(row: dict[str, float] | None) -> list[str]:
    if row is None:
        return ["-", "-", "-", "-"]
    return [
        fmt_time(row["wall_us"] * 1e-6),
        f"{row['gbps']:.3f}",
        fmt_time(row["daemon_us"] * 1e-6),
        f"{row['daemon_s_per_gb']:.2f}",
    ]


def figures_table(figs: list[Figure]) -> list[str]:
    """Figures as a markdown table (measured, limit, where, met), and the blank line after it."""
    out = ["| figure | measured | limit | where | met |", "| --- | ---: | ---: | --- | --- |"]
    for f in figs:
        out.append(
            f"| {f.what} | {f.value:.3g} | {f.cmp} {f.limit:g} | {f.note or '-'} | {'met' if f.met else '**missed**'} |"
        )
    return [*out, ""]


def engine_section(
    targets: dict[str, Any],
    sweeps: dict[str, dict[str, Any]],
    profiles: dict[str, dict[str, Any]],
    before: dict[str, dict[str, Any]],
    ddps: dict[str, dict[str, Any]],
) -> list[str]:
    """Issue 17's targets, each measured in this run, then the CPU and headroom profiles before and after."""
    figs: list[Figure | None] = []
    if "sweep-host4" in sweeps:
        figs.append(small_figure("1 host, 4 workers", sweeps["sweep-host4"], 2.0))
    if "sweep-sim4" in sweeps:
        figs.append(small_figure("4 simulated nodes x 1 at 1 Gbit/s", sweeps["sweep-sim4"], 1.5))
    figs += [
        target_figure(
            targets,
            "T2",
            "time smddp / best of Open MPI (default, ring) and gloo, 256 KiB, 0.5 ms one-way delay",
            "T2: 256 KiB, 0.5 ms one-way delay, smddp / the best peer",
            "<=",
            0.6,
        ),
        target_figure(targets, "T1", "smddp busbw, 64 MiB float32", "T1: 64 MiB busbw, Gbit/s", ">=", 0.95),
        target_figure(targets, "T1", "time smddp / gloo, 64 MiB", "T1: 64 MiB, smddp / gloo", "<=", 1.0),
        target_figure(
            targets,
            "T3",
            "time smddp / Open MPI shared memory, 64 MiB",
            "T3: 64 MiB one host, smddp / Open MPI",
            "<=",
            0.6,
        ),
    ]
    for key, label in (("sweep-host4", "1 host, 4 workers"), ("sweep-sim4", "4 simulated nodes at 1 Gbit/s")):
        if key in sweeps:
            figs += sweep_figures(label, sweeps[key])
    if "sweep-host2-large" in sweeps:
        figs.append(large_figure(sweeps["sweep-host2-large"]))
    for key, label in (
        ("ddp-host4", "DDP step, 1 host (2 local nodes)"),
        ("ddp-sim4", "DDP step, 4 simulated nodes"),
    ):
        if key in ddps:
            figs.append(Figure(f"{label}: smddp / gloo", float(ddps[key]["ratio"]), "<=", 0.85))
    figs.append(
        target_figure(
            targets,
            "T6",
            "daemon RSS growth over the 1 MiB run (after warm-up)",
            "T6: daemon RSS growth over 10,000 x 1 MiB, MiB",
            "<=",
            1.0,
        )
    )
    for stem, label in (("profile-host4-4k", "1 host, 4 workers"), ("profile-sim4-4k", "4 simulated nodes")):
        if stem in before and stem in profiles:
            was, now = profile_row(before[stem]), profile_row(profiles[stem])
            figs.append(
                Figure(
                    f"{label}: daemon CPU per 4 KiB all-reduce, before / now",
                    was["daemon_us"] / now["daemon_us"],
                    ">=",
                    5.0,
                    f"{fmt_time(was['daemon_us'] * 1e-6)} -> {fmt_time(now['daemon_us'] * 1e-6)}",
                )
            )
    shown = [f for f in figs if f is not None]
    out = [
        "## The compiled engine's figures (issue 17)",
        "",
        "Each of issue 17's targets, computed from the runs above (the sweeps' medians, the target "
        "setups, the DDP runs): one run, implementations interleaved.",
        "",
        *figures_table(shown),
    ]
    missed = [f for f in shown if not f.met]
    if missed:
        out += [
            "Missed: "
            + "; ".join(
                f"{f.what}: {f.value / f.limit:.2f}x the limit"
                if f.cmp == "<="
                else f"{f.what}: {f.value / f.limit * 100:.0f}% of the limit"
                for f in missed
            )
            + ". What limits each: [docs/performance.md](docs/performance.md).",
            "",
        ]
    rows = [(stem, label) for stem, label in CPU_PROFILES if stem in profiles or stem in before]
    if rows:
        out += [
            "CPU and headroom, from the profiles (CPU from /proc over each profile's window; daemon CPU "
            "per all-reduce is the mean over the job's daemons, CPU s per GB is all daemons' CPU per GB "
            f"of buffer all-reduced). Before: the Python data plane, commit {BEFORE_COMMIT} (its last "
            f"`make bench`, and the headroom profiles run at that commit), in `bench-results/{BEFORE_DIR}/`.",
            "",
            "| setup | before: time | GB/s | daemon CPU / all-reduce | daemon CPU s / GB "
            "| now: time | GB/s | daemon CPU / all-reduce | daemon CPU s / GB | daemon CPU, before / now |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for stem, label in rows:
            b = profile_row(before[stem]) if stem in before else None
            n = profile_row(profiles[stem]) if stem in profiles else None
            gain = f"{b['daemon_us'] / n['daemon_us']:.1f}x" if b and n and n["daemon_us"] > 0 else "-"
            out.append(f"| {label} | " + " | ".join([*_profile_cells(b), *_profile_cells(n), gain]) + " |")
        out.append("")
    return out


def load_before(sweeps_dir: str) -> dict[str, dict[str, Any]]:
    d = Path(sweeps_dir) / BEFORE_DIR
    return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("profile*.json"))} if d.is_dir() else {}


def worst_size_figure(label: str, sweep: dict[str, Any], limit: float) -> Figure | None:
    """The slowest size of a sweep against the best of the baselines, under `limit`."""
    med = _medians(sweep)
    ratios = _ratios(med)
    if not ratios:
        return None
    return _slowest(
        f"{label}: slowest size against the best of {', '.join(BASELINES)}", med, ratios, limit, True
    )


#: Issue 29's limit on each call of the calls rig, against the blocking call.
CALLS_X = 1.2


def worker_section(
    sweeps: dict[str, dict[str, Any]], ddps: dict[str, dict[str, Any]], calls: list[dict[str, Any]]
) -> list[str]:
    """Issue 29's targets (item 6), each measured in this run: small all-reduces isolated and back to
    back, one host's sizes against the best, the DDP step, and the calls against the blocking call."""
    figs: list[Figure | None] = []
    if "sweep-host4-isolated" in sweeps:
        figs.append(small_figure("1 host, 4 workers, isolated", sweeps["sweep-host4-isolated"], 1.5))
    if "sweep-sim4-isolated" in sweeps:
        figs.append(
            small_figure("4 simulated nodes x 1 at 1 Gbit/s, isolated", sweeps["sweep-sim4-isolated"], 1.3)
        )
    if "sweep-sim4" in sweeps:
        figs.append(
            small_figure("4 simulated nodes x 1 at 1 Gbit/s, back to back", sweeps["sweep-sim4"], 1.3)
        )
    if "sweep-host4" in sweeps:
        figs.append(worst_size_figure("1 host, 4 workers, 4 KiB to 256 MiB", sweeps["sweep-host4"], 1.2))
    if "sweep-host2-large" in sweeps:
        figs.append(large_figure(sweeps["sweep-host2-large"]))
    if "ddp-host1x4" in ddps:
        figs.append(
            Figure(
                "DDP step, 1 host, 4 workers: smddp / gloo", float(ddps["ddp-host1x4"]["ratio"]), "<=", 0.75
            )
        )
    for report in calls:
        med = report["slowest_s"]
        floors = {"a Python backend's floor": "torch.floor", "a C++ backend's floor": "torch.floor.native"}
        for c in ("async.wait", "torch", "torch.async"):
            if c in med:
                note = f"{med[c] * 1e6:.1f} us against {med['blocking'] * 1e6:.1f} us"
                for what, floor in floors.items():
                    if c.startswith("torch") and floor in med:
                        note += f"; {what}: {med[floor] / med['blocking']:.2f}x"
                figs.append(
                    Figure(
                        f"{c} at {fmt_size(report['size'])}: time / the blocking call",
                        med[c] / med["blocking"],
                        "<=",
                        CALLS_X,
                        note,
                    )
                )
    shown = [f for f in figs if f is not None]
    if not shown:
        return []
    out = [
        "## The worker side's figures (issue 29, item 6)",
        "",
        "Each of issue 29's targets, computed from the runs above (the sweeps' medians, the DDP runs, "
        "the calls rig): one run, implementations interleaved. What limits the ones missed: "
        "[docs/performance.md](docs/performance.md).",
        "",
        *figures_table(shown),
    ]
    return out
