"""One DDP step's gradient averaging on nodes of 8 GPUs, on paper: the host path, the GPU step, NCCL's ring (issue 57).

`python -m smddp_rigs.bench node-model` prints the tables of docs/performance.md ("Nodes of 8 GPUs")
and the check against what a lent GPU measured (bench-results/gpu/gpu.json). Every constant is on
an `Instance` with where it comes from; docs/performance.md cites each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
MiB = 1 << 20


@dataclass(frozen=True)
class Instance:
    """A node as the model sees it. Bandwidths in bytes/s, each direction."""

    name: str
    gpus: int  # G
    nvlink: float  # one GPU's NVLink bandwidth, each direction (half the datasheet's bidirectional figure)
    pcie: float  # one PCIe switch's uplink to the host, each direction, as copies reach it
    gpus_per_switch: int  # GPUs sharing that uplink
    host_memory: float  # the node's DRAM bandwidth (both sockets, theoretical peak)
    efa: float  # the node's network bandwidth, each direction
    threads: int = 8  # the daemon's reduction threads (--threads: cores the GPUs leave)
    gamma: float = (
        24.5 * GB
    )  # input bytes one core sums per second (the engine's float32 kernel, measured here)
    latency: float = 15e-6  # one small message between instances, one way (assumed, as "The EFA case")
    ring_step: float = 5e-6  # what one step of NCCL's ring costs beyond its bytes (assumed)
    piece: int = 8 * MiB  # the pipelined pieces of a job of several nodes (--pipeline-kb)


P4D = Instance("p4d.24xlarge", 8, 300 * GB, 25 * GB, 2, 2 * 140.8 * GB, 400e9 / 8)
P5 = Instance("p5.48xlarge", 8, 450 * GB, 52 * GB, 2, 2 * 204.8 * GB, 3200e9 / 8)
INSTANCES = (P4D, P5)

# Gradient bytes of one DDP step, float32: ResNet-50 (25.6 M parameters) and BERT-large (340 M).
MODELS = (("ResNet-50, 102 MB", int(25.6e6 * 4)), ("BERT-large, 1.36 GB", int(340e6 * 4)))
NODES = (2, 4, 8, 16, 32, 64)


def _pipelined(stages: dict[str, float], s: int, piece: int) -> tuple[float, str]:
    """Stages that overlap piece by piece: the slowest one, plus one piece through all of them (the
    pipeline's fill); and which stage bounds it."""
    frac = min(1.0, piece / s) if s else 1.0
    bound = max(stages, key=lambda k: stages[k])
    return stages[bound] + frac * sum(stages.values()), bound


def host_path(c: Instance, n: int, s: int) -> tuple[float, str]:
    """Today's path: every GPU copies its whole buffer to the host and back (PCIe, shared by the
    GPUs of a switch), the daemon's CPU folds the node's G inputs and then sums its shard of the N
    node partials; host memory carries the copies in, the fold, the sends and receives, and the
    copies back."""
    g = c.gpus
    net = 2 * (n - 1) / n * s
    stages = {
        "PCIe to host": c.gpus_per_switch * s / c.pcie,
        "PCIe back": c.gpus_per_switch * s / c.pcie,
        "host memory": ((3 * g + 2) * s + 2 * net) / c.host_memory,
        "CPU sums": ((g + (1 if n > 1 else 0)) * s) / (c.threads * c.gamma),
        "network": net / c.efa,
    }
    t, bound = _pipelined(stages, s, c.piece)
    return t + (2 * c.latency if n > 1 else 0.0), bound


def gpu_step(c: Instance, n: int, s: int) -> tuple[float, str]:
    """Issue 57's path: the node's G ranks reduce-scatter on NVLink (each GPU takes (G-1)/G S from its
    peers; the adds run at HBM speed and are left out), each copies its S/G slice to the host and
    back, the daemon has one input (no fold; it still sums its shard of the N node partials), and the
    node all-gathers the reduced slices on NVLink with the copy engines."""
    g = c.gpus
    net = 2 * (n - 1) / n * s
    stages = {
        "NVLink reduce-scatter": (g - 1) / g * s / c.nvlink,
        "PCIe to host": c.gpus_per_switch * (s / g) / c.pcie,
        "PCIe back": c.gpus_per_switch * (s / g) / c.pcie,
        "host memory": (3 * s + 2 * net) / c.host_memory,
        "CPU sums": (s if n > 1 else 0) / (c.threads * c.gamma),
        "network": net / c.efa,
        "NVLink all-gather": (g - 1) / g * s / c.nvlink,
    }
    t, bound = _pipelined(stages, s, c.piece)
    return t + (2 * c.latency if n > 1 else 0.0), bound


def nccl_ring(c: Instance, n: int, s: int) -> tuple[float, str]:
    """NCCL's ring over the N G GPUs, one channel per NIC share: every GPU sends and receives
    2 (NG-1)/(NG) S; each node's NICs carry that for each of its G rings' one crossing, so the node
    sends 2 (NG-1)/(NG) S (against smddp's 2 (N-1)/N S), and NVLink carries the rest; 2 (NG-1) steps,
    each `ring_step` beyond its bytes. (NCCL picks trees, or NVLink SHARP on H100, where they are
    faster: this is its ring only.)"""
    w = n * c.gpus
    moved = 2 * (w - 1) / w * s
    stages = {"network": moved / c.efa, "NVLink": moved / c.nvlink}
    bound = max(stages, key=lambda k: stages[k])
    return stages[bound] + 2 * (w - 1) * (c.latency / c.gpus + c.ring_step), bound


def tables() -> str:
    """The markdown tables: milliseconds for each instance, model size and node count."""
    out = []
    for c in INSTANCES:
        for label, s in MODELS:
            out += [
                f"**{c.name}, {label}** (ms; in brackets what bounds it)",
                "",
                "| nodes | host path | GPU step | NCCL ring | GPU step / host path | GPU step / ring |",
                "| ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for n in NODES:
                (h, hb), (gs, gb), (r, rb) = host_path(c, n, s), gpu_step(c, n, s), nccl_ring(c, n, s)
                out.append(
                    f"| {n} | {h * 1e3:.1f} ({hb}) | {gs * 1e3:.1f} ({gb}) | {r * 1e3:.1f} ({rb}) "
                    f"| {gs / h:.2f} | {gs / r:.2f} |"
                )
            out.append("")
    return "\n".join(out)


def lent_check(gpu_json: Path) -> str:
    """The host path's copies on the lent GPU's own shape (one node, W ranks sharing one GPU and its
    PCIe link), against the all-reduce times the same run measured: the model's PCIe terms use the
    run's own measured copy throughput, so what is left over is the daemon's fold of W inputs, shown
    as the input bytes per second it implies (set against T g of the model)."""
    d = json.loads(gpu_json.read_text())
    copies = {r["bytes"]: r for r in d["copy"]["rows"]}
    runs = d["allreduce"] if isinstance(d["allreduce"], list) else [d["allreduce"]]
    lines = [
        f"Lent GPU: {d['copy']['device']} ({gpu_json.name}, `{d['command']}`); one node, W ranks sharing one GPU.",
        "",
        "| W | size | measured ms | model: copies ms (to host + back) | left for the fold ms | fold input GB/s implied |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        w = run["workers"]
        for r in run["rows"]:
            size = r["bytes"]
            if w < 2 or size not in copies or size < 16 * MiB:
                continue
            d2h = w * size / (copies[size]["arena_d2h_gbs"] * GB)
            h2d = w * size / (copies[size]["arena_h2d_gbs"] * GB)
            left = r["device_s"] - d2h - h2d
            rate = f"{w * size / left / GB:.0f}" if left > 0 else "-"
            lines.append(
                f"| {w} | {size // MiB} MiB | {r['device_s'] * 1e3:.2f} | {(d2h + h2d) * 1e3:.2f} "
                f"({d2h * 1e3:.2f} + {h2d * 1e3:.2f}) | {left * 1e3:.2f} | {rate} |"
            )
    return "\n".join(lines)


def main(gpu_json: str | None) -> str:
    text = tables()
    if gpu_json:
        text += "\n" + lent_check(Path(gpu_json))
    return text
