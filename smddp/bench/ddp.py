"""`smddp-bench ddp`: the user's number, a DDP training step's time on smddp against gloo, interleaved."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from smddp.bench.runner import (
    BenchError,
    RunOptions,
    Topology,
    have_torch,
    launch_ranks,
    machine_info,
    place,
)

#: compute: the same step with DDP's all-reduces replaced by a hook that keeps each bucket as it is
#: (launched as gloo): the floor of either backend's step, so that what the averaging costs each of
#: them, and the best smddp / gloo this machine allows, are read from the same run.
IMPLS = ("smddp", "gloo", "compute")
#: With --launcher torchrun: smddp and gloo under torchrun too (gloo's start-up under each launcher
#: is what torchrun itself costs, the floor of smddp's under it).
TORCHRUN_IMPLS = ("smddp", "smddp-torchrun", "gloo", "gloo-torchrun")
#: What each implementation is launched as (the launcher and its settings): the rest, as themselves.
LAUNCHED_AS = {"compute": "gloo"}


@dataclass(frozen=True)
class DdpConfig:
    topology: Topology = field(default_factory=lambda: Topology(nodes=2, per_node=2))
    options: RunOptions = field(default_factory=RunOptions)
    width: int = 1024
    depth: int = 11  # with width 1024 and 256 inputs: 11.8 M parameters, 45 MiB of float32 gradients
    inputs: int = 256
    batch: int = 64
    bucket_mb: float = 25.0  # torch DDP's default bucket_cap_mb
    steps: int = 20
    warmup: int = 3
    rounds: int = 3  # launches per implementation, interleaved
    device: str = "cpu"  # or "cuda": the model and DDP on GPU local rank % GPUs (several ranks may share one)
    outdir: str = "bench-results"
    name: str = "ddp"
    command: str = ""
    launcher: str = "smddp-launch"  # or "torchrun": smddp also under torchrun, interleaved

    @property
    def impls(self) -> tuple[str, ...]:
        return TORCHRUN_IMPLS if self.launcher == "torchrun" else IMPLS

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError("rounds and steps must be at least 1, warmup at least 0")
        if self.launcher not in ("smddp-launch", "torchrun"):
            raise ValueError(f"launcher must be smddp-launch or torchrun, got {self.launcher!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")

    def program(self, impl: str, outdir: str) -> list[str]:
        return [
            sys.executable,
            *("-m", "smddp.bench.ddp_worker", "--impl", impl.split("-")[0], "--out", outdir),
            *("--width", str(self.width), "--depth", str(self.depth), "--inputs", str(self.inputs)),
            *("--batch", str(self.batch), "--bucket-mb", f"{self.bucket_mb:g}"),
            *("--steps", str(self.steps), "--warmup", str(self.warmup)),
            *("--threads", str(self.options.torch_threads), "--device", self.device),
        ]


def run_once(cfg: DdpConfig, impl: str, p: Any, log: TextIO) -> dict[str, Any]:
    """One launch of `impl`: per step the slowest rank's time, and the parameters' digest checked equal;
    its start-up: from the command to the last rank's first all-reduce done."""
    started = time.time()
    cmd, settings, wall, per_rank = launch_ranks(
        LAUNCHED_AS.get(impl, impl),
        p,
        (),
        log,
        opts=cfg.options,
        program=lambda outdir: cfg.program(impl, outdir),
    )
    digests = {r["params_sha256"] for r in per_rank}
    if len(digests) != 1 and impl != "compute":  # (compute averages nothing: its replicas differ)
        raise BenchError(f"{impl}: the ranks' parameters differ after training ({len(digests)} digests)")
    steps = [max(s) for s in zip(*(r["step_s"] for r in per_rank), strict=True)]
    return {
        "impl": impl,
        "command": shlex.join(cmd),
        "settings": settings,
        "wall_s": wall,
        "params": per_rank[0]["params"],
        "torch": per_rank[0]["torch"],
        "torch_threads": per_rank[0]["torch_threads"],
        "device": per_rank[0].get("device", "cpu"),
        "step_s": steps,
        "median_s": statistics.median(steps),
        "startup_s": max(r["first_allreduce_at"] for r in per_rank) - started,
        "params_sha256": per_rank[0]["params_sha256"],
        **({"torch_backend": per_rank[0]["torch_backend"]} if "torch_backend" in per_rank[0] else {}),
    }


def run_ddp(cfg: DdpConfig, log: TextIO = sys.stderr) -> dict[str, Any]:
    """Run `rounds` launches of each implementation, interleaved; write NAME.json and NAME.md."""
    if not have_torch():
        raise BenchError("smddp-bench ddp needs torch (pip install torch)")
    machine = machine_info()
    impls = cfg.impls
    runs: dict[str, list[dict[str, Any]]] = {i: [] for i in impls}
    t0 = time.monotonic()
    with place(cfg.topology, cfg.options) as p:
        for rnd in range(cfg.rounds):
            for impl in impls:
                print(f"smddp-bench ddp: round {rnd + 1}/{cfg.rounds} {impl}", file=log, flush=True)
                runs[impl].append(run_once(cfg, impl, p, log))
    machine["loadavg_after"] = list(os.getloadavg())
    pooled = {i: statistics.median(s for r in runs[i] for s in r["step_s"]) for i in impls}
    result: dict[str, Any] = {
        "kind": "ddp",
        "command": cfg.command,
        "config": asdict(cfg),
        "topology_label": cfg.topology.label(),
        "ranks": cfg.topology.workers,
        "machine": machine,
        "wall_s": time.monotonic() - t0,
        "params": runs["smddp"][0]["params"],
        "device": runs["smddp"][0]["device"],
        "runs": runs,
        "median_s": pooled,
        "ratio": pooled["smddp"] / pooled["gloo"],
        "ratio_per_round": [
            s["median_s"] / g["median_s"] for s, g in zip(runs["smddp"], runs["gloo"], strict=True)
        ],
        "startup_s": {i: statistics.median(r["startup_s"] for r in runs[i]) for i in impls},
    }
    if "compute" in runs:
        # What the gradient averaging adds to each backend's step, and the best smddp / gloo that
        # the step's own compute leaves (averaging for free).
        floor = pooled["compute"]
        result["floor"] = {
            "smddp_s": pooled["smddp"] - floor,
            "gloo_s": pooled["gloo"] - floor,
            "best_ratio": floor / pooled["gloo"],
        }
    if "smddp-torchrun" in runs:
        # One data plane: the same training gives the same bits under either launcher.
        same = {r["params_sha256"] for i in ("smddp", "smddp-torchrun") for r in runs[i]}
        result["torchrun"] = {
            "step_ratio": pooled["smddp-torchrun"] / pooled["smddp"],
            "step_ratio_per_round": [
                t["median_s"] / s["median_s"]
                for t, s in zip(runs["smddp-torchrun"], runs["smddp"], strict=True)
            ],
            "startup_ratio": result["startup_s"]["smddp-torchrun"] / result["startup_s"]["smddp"],
            "gloo_startup_ratio": result["startup_s"]["gloo-torchrun"] / result["startup_s"]["gloo"],
            "same_bits": len(same) == 1,
        }
    out = Path(cfg.outdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{cfg.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{cfg.name}.md").write_text(ddp_markdown(result))
    print(f"smddp-bench ddp: wrote {out}/{cfg.name}.json, .md", file=log)
    return result


def _on_backend(res: dict[str, Any]) -> str:
    """Which torch backend smddp's launches ran on (older reports do not say)."""
    kinds = sorted({r["torch_backend"] for r in res["runs"].get("smddp", []) if "torch_backend" in r})
    return f" (smddp on its {'/'.join(kinds)} torch backend)" if kinds else ""


def ddp_markdown(res: dict[str, Any]) -> str:
    """The result as a table: step time per implementation, the ratio, and what ran."""
    c = res["config"]
    device = res.get("device", "cpu")
    where = (
        "on the CPU"
        if device == "cpu"
        else f"on CUDA ({device}, every rank's model on GPU local rank % GPUs)"
    )
    lines = [
        f"DDP training step, {res['topology_label']}, {where}: an MLP of {res['params'] / 1e6:.1f} M parameters "
        f"(width {c['width']}, depth {c['depth']}), batch {c['batch']} per rank, {c['bucket_mb']:g} MiB "
        f"buckets, stock `torch.nn.parallel.DistributedDataParallel`{_on_backend(res)}, one torch thread per rank; "
        f"{c['steps']} timed steps after {c['warmup']} untimed, {c['rounds']} launches per "
        "implementation, interleaved. A step's time is the slowest rank's, from a barrier to the end "
        "of its optimizer step; every rank's parameters were the same bits after training"
        + (" (smddp's and gloo's)." if "compute" in res["runs"] else "."),
        "",
        "| implementation | median step ms | per launch (median ms) |",
        "| --- | ---: | --- |",
    ]
    impls = list(res["runs"])
    startup = res.get("startup_s", {})
    for impl in impls:
        per = ", ".join(f"{r['median_s'] * 1e3:.1f}" for r in res["runs"][impl])
        up = f" | {startup[impl]:.2f}" if startup else ""
        lines.append(f"| {impl} | {res['median_s'][impl] * 1e3:.1f} | {per}{up} |")
    if startup:
        lines[lines.index("| implementation | median step ms | per launch (median ms) |")] += " start-up s |"
        lines[lines.index("| --- | ---: | --- |")] += " ---: |"
    rounds = ", ".join(f"{x:.3f}" for x in res["ratio_per_round"])
    lines += ["", f"smddp / gloo: **{res['ratio']:.3f}** (per launch: {rounds}).", ""]
    if "floor" in res:
        f = res["floor"]
        lines += [
            "compute: the same step with DDP's all-reduces replaced by a hook that keeps each bucket as it "
            "is (its replicas differ): the floor. What the gradient averaging adds to the step: smddp "
            f"{f['smddp_s'] * 1e3:.1f} ms, gloo {f['gloo_s'] * 1e3:.1f} ms; with averaging for free, "
            f"smddp / gloo would be {f['best_ratio']:.3f}.",
            "",
        ]
    if "torchrun" in res:
        t = res["torchrun"]
        per = ", ".join(f"{x:.3f}" for x in t["step_ratio_per_round"])
        lines += [
            f"smddp under torchrun / under smddp-launch: step **{t['step_ratio']:.3f}** (per launch: {per}); "
            f"start-up (the command to the last rank's first all-reduce, median) **{t['startup_ratio']:.2f}**; "
            f"the same parameters to the bit under both: {t['same_bits']}."
            + (
                f" gloo under torchrun / under mpirun, start-up: {t['gloo_startup_ratio']:.2f} (torchrun's own cost)."
                if "gloo_startup_ratio" in t
                else ""
            ),
            "",
        ]
    lines += ["Launched as (the first launch; the output directory differs per launch):", ""]
    lines += [f"- {impl}: `{res['runs'][impl][0]['command']}`" for impl in impls]
    lines.append("")
    return "\n".join(lines)
