"""The scaling model: all-reduce time against node count for smddp and for a ring (docs/performance.md).

For N nodes (one worker each), S bytes, link payload bandwidth B (bytes/s per node, each way),
reduction speed g (bytes of input summed per second per core) and smddp's chunk c:

    smddp(N, S) = a_s + b_s (N-1) + 2 (N-1)/N S/B + min(c, S/N) N/g
    ring(N, S)  = a_r + b_r (N-1) + 2 (N-1)/N S/B + (N-1)/N S/g

- Both move 2 (N-1)/N S bytes through every node's link, each way (the bandwidth term).
- smddp has two network steps whatever N is (a_s: the fixed cost of one all-reduce, both steps'
  latency included), but every daemon sends and receives N-1 frames per step: b_s is that cost per
  extra peer (header, syscall and Python work per frame, both steps).
- A ring takes 2 (N-1) steps, each a latency and a message: b_r per extra node.
- Reduction: a daemon sums N rows of its S/N shard chunk by chunk as they arrive, so only the last
  chunk's sum is exposed; a ring reduces (N-1)/N S on the critical path between its steps.

a and b are fitted (least squares) to 4 KiB all-reduces at 2, 4 and 8 simulated nodes, where the
bandwidth and reduction terms vanish; B is measured with one TCP stream over the same shaped link;
g with the engine's kernel on float32. The model is then checked against 64 MiB all-reduces at 2, 4
and 8 nodes, which it did not see.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from smddp.bench.report import fmt_size, fmt_time
from smddp.bench.runner import BenchError, ImplRun, RunOptions, Topology, machine_info, place, run_impl
from smddp.bench.worker import Case

MiB = 1 << 20
CHECK_NODES = (2, 4, 8)
MODEL_NODES = tuple(2**k for k in range(1, 11))  # 2 .. 1024
RATE_MBIT = 1000.0


@dataclass(frozen=True)
class ModelConfig:
    source: str = ""  # a model.json whose parameters to use; "" = bench-results/model.json
    size: int = 64 * MiB
    check: bool = False  # measure at 2, 4, 8 simulated nodes (root), fit, check, write model.json
    outdir: str = "bench-results"
    repeats: int = 3


@dataclass(frozen=True)
class Params:
    bandwidth: float  # B, bytes/s per node link
    gamma: float  # g, bytes of input reduced per second per core (float32)
    chunk: int  # smddp's pipelining chunk, bytes
    smddp_a: float
    smddp_b: float
    ring_a: float
    ring_b: float

    def smddp(self, n: int, s: int) -> float:
        if n == 1:
            return self.smddp_a + s / self.gamma
        return (
            self.smddp_a
            + self.smddp_b * (n - 1)
            + 2 * (n - 1) / n * s / self.bandwidth
            + min(self.chunk, s / n) * n / self.gamma
        )

    def ring(self, n: int, s: int) -> float:
        if n == 1:
            return self.ring_a
        return (
            self.ring_a
            + self.ring_b * (n - 1)
            + 2 * (n - 1) / n * s / self.bandwidth
            + (n - 1) / n * s / self.gamma
        )


@dataclass(frozen=True)
class EfaCase:
    """An EFA cluster as the model sees it (issue 18). The link rates are AWS's published instance
    figures; the per-message figures are assumptions (no EFA was measured here): docs/performance.md,
    "The EFA case", says which is which."""

    name: str
    link_gbit: float  # network bandwidth per node, each way (AWS: p4d.24xlarge 400, p5.48xlarge 3200)
    latency_s: float = 15e-6  # one small message, one way, between two instances (assumed)
    per_message_s: float = 1e-6  # CPU to post and complete one message at each end (assumed)
    threads: int = 8  # the daemon's reduction threads (--threads: cores the GPUs leave)
    pipeline: int = 8 * MiB  # the workers' pipelined pieces (--pipeline-kb)


EFA_CASES = (EfaCase("p4d.24xlarge, 400 Gbit/s", 400.0), EfaCase("p5.48xlarge, 3200 Gbit/s", 3200.0))


def efa_smddp(c: EfaCase, n: int, s: int, gamma: float, copy_bps: float, local_s: float) -> float:
    """smddp on EFA: the node's own hop (local_s, measured here), two network steps (2 latencies, and
    N-1 messages per step at each daemon), then the slowest of the three streams the pipeline overlaps:
    the link (2 (N-1)/N S/B), the daemon's reduction of its N rows of S/N (S/(T g)) and the copy into
    and out of the arena (2 S/m); the first piece's copy in and the last one's copy out are exposed."""
    fill = 2 * min(c.pipeline, s) / copy_bps
    if n == 1:
        return local_s + fill + max(s / (c.threads * gamma), 2 * s / copy_bps)
    link = 2 * (n - 1) / n * s / (c.link_gbit * 1e9 / 8)
    return (
        local_s
        + 2 * c.latency_s
        + 2 * (n - 1) * c.per_message_s
        + fill
        + max(link, s / (c.threads * gamma), 2 * s / copy_bps)
    )


def efa_ring(c: EfaCase, n: int, s: int, gamma: float) -> float:
    """A ring on the same links, reducing on the host as it goes (one core): 2 (N-1) steps, each a
    latency and a message; its reduction overlaps its transfers, so the slower of the two shows."""
    if n == 1:
        return 0.0
    link = 2 * (n - 1) / n * s / (c.link_gbit * 1e9 / 8)
    return 2 * (n - 1) * (c.latency_s + c.per_message_s) + max(link, (n - 1) / n * s / gamma)


def copy_speed(nbytes: int = 64 * MiB, repeats: int = 5) -> float:
    """Bytes/s of one core copying a buffer (numpy), the best of `repeats`: the arena copies' speed."""
    import numpy as np

    a, b = np.ones(nbytes // 4, dtype=np.float32), np.empty(nbytes // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def efa_markdown(res: dict[str, Any]) -> str:
    """The EFA case's tables: smddp and a ring against node count, for each instance type."""
    e = res.get("efa")
    if not e:
        return ""
    gamma = Params(**res["params"]).gamma
    lines = [
        "EFA case (issue 18; a model, not a measurement): link rates from AWS's instance specifications, "
        f"one-way message latency {EFA_CASES[0].latency_s * 1e6:.0f} us and {EFA_CASES[0].per_message_s * 1e6:.0f} us "
        f"of CPU per message (assumed), {EFA_CASES[0].threads} reduction threads, g = {gamma / 1e9:.1f} GB/s per "
        f"core and m = {e['copy_bps'] / 1e9:.1f} GB/s copy speed (measured here), and the node's own hop "
        f"{fmt_time(e['local_s'])} ({e['local_source']}).",
        "",
    ]
    for c in EFA_CASES:
        for size in (res["size"], 256 * 1024):
            lines += [
                f"{c.name}, {fmt_size(size)}:",
                "",
                "| nodes | smddp | ring | smddp / ring | smddp busbw Gbit/s |",
                "| ---: | ---: | ---: | ---: | ---: |",
            ]
            for n in MODEL_NODES:
                t = efa_smddp(c, n, size, gamma, e["copy_bps"], e["local_s"])
                r = efa_ring(c, n, size, gamma)
                bus = size / t * 2 * (n - 1) / n * 8 / 1e9
                lines.append(f"| {n} | {fmt_time(t)} | {fmt_time(r)} | {t / r:.2f} | {bus:.1f} |")
            lines.append("")
    return "\n".join(lines)


def local_hop(outdir: Path) -> tuple[float, str]:
    """The node's own share of a small all-reduce: smddp's 4 KiB on one host (make bench's sweep)."""
    src = outdir / "sweep-host4.json"
    if src.exists():
        for run in json.loads(src.read_text())["runs"]:
            if run["impl"] == "smddp":
                return ImplRun.from_json(run).case(
                    4096
                ).median_s, "smddp's 4 KiB all-reduce, one host, 4 workers: sweep-host4"
    return 32e-6, "no sweep-host4.json: 32 us, the last one measured"


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x with a >= 0 (a fixed cost cannot be negative: then y = b x)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    a = my - b * mx
    if a < 0:
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return a, b


_RECV = (
    "import socket,sys,time\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 47001)); s.listen(1)\n"
    "c,_=s.accept(); buf=bytearray(1<<20); n=0; t0=None\n"
    "while True:\n"
    "    k=c.recv_into(buf)\n"
    "    if not k: break\n"
    "    if t0 is None: t0=time.perf_counter()\n"
    "    n+=k\n"
    "print(n/(time.perf_counter()-t0))\n"
)
_SEND = (
    "import socket,sys,time\n"
    "addr=sys.argv[1]; total=int(sys.argv[2])\n"
    "for _ in range(100):\n"
    "    try: c=socket.create_connection((addr, 47001)); break\n"
    "    except OSError: time.sleep(0.05)\n"
    "buf=bytes(1<<20); sent=0\n"
    "while sent<total: sent+=c.send(buf)\n"
    "c.close()\n"
)


def link_bandwidth(p: Any, nbytes: int = 64 * MiB) -> float:
    """Payload bytes/s of one TCP stream from node 0 to node 1 of a shaped simulated cluster."""
    recv = p.cluster.popen(1, [sys.executable, "-c", _RECV], stdout=subprocess.PIPE, text=True)
    try:
        send = p.cluster.exec(0, [sys.executable, "-c", _SEND, p.cluster.addr(1), str(nbytes)], timeout=120)
        if send.returncode:
            raise BenchError("link bandwidth probe: the sender failed")
        out, _ = recv.communicate(timeout=60)
        return float(out.strip())
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()


def measure(cfg: ModelConfig, log: TextIO) -> dict[str, Any]:
    """4 KiB and `size` all-reduces of smddp and a forced ring at 2, 4, 8 nodes; the link; the kernel."""
    from smddp_rigs.bench.targets import kernel_speed

    opts = RunOptions(repeats=cfg.repeats, prefix="smddpm", subnet="10.77.10")
    cases = [Case(4096, "float32", "sum"), Case(cfg.size, "float32", "sum")]
    runs: dict[str, dict[str, Any]] = {}
    link: list[float] = []
    for n in CHECK_NODES:
        topo = Topology(nodes=n, per_node=1, sim=True, rate_mbit=RATE_MBIT)
        with place(topo, opts) as p:
            if n == CHECK_NODES[0]:
                link = [link_bandwidth(p) for _ in range(3)]
            for impl in ("smddp", "mpi-ring"):
                print(f"python -m smddp_rigs.bench model: {n} nodes {impl}", file=log, flush=True)
                runs.setdefault(impl, {})[str(n)] = run_impl(impl, p, cases, log).to_json()
    return {"runs": runs, "link_bps": link, "kernel": kernel_speed()}


def fit(meas: dict[str, Any], chunk: int = 1024 * 1024) -> Params:
    def small(impl: str) -> tuple[float, float]:
        ns = [int(n) for n in meas["runs"][impl]]
        ts = [ImplRun.from_json(meas["runs"][impl][str(n)]).case(4096).median_s for n in ns]
        return fit_line([n - 1.0 for n in ns], ts)

    sa, sb = small("smddp")
    ra, rb = small("mpi-ring")
    return Params(
        bandwidth=statistics.median(meas["link_bps"]),
        gamma=meas["kernel"]["reducer_float32_gbps"] * 1e9,
        chunk=chunk,
        smddp_a=sa,
        smddp_b=sb,
        ring_a=ra,
        ring_b=rb,
    )


def checks(meas: dict[str, Any], params: Params, size: int) -> list[dict[str, Any]]:
    out = []
    for impl, model in (("smddp", params.smddp), ("mpi-ring", params.ring)):
        for n, run in meas["runs"][impl].items():
            t = ImplRun.from_json(run).case(size).median_s
            pred = model(int(n), size)
            out.append(
                {"impl": impl, "nodes": int(n), "measured_s": t, "model_s": pred, "error": pred / t - 1}
            )
    return out


def model_markdown(res: dict[str, Any]) -> str:
    p = Params(**res["params"])
    lines = [
        f"Parameters: B = {p.bandwidth * 8 / 1e9:.3f} Gbit/s (one TCP stream over a 1 Gbit/s tbf link), "
        f"g = {p.gamma / 1e9:.2f} GB/s per core (float32, the engine's kernel), c = {p.chunk // 1024} KiB; "
        f"smddp a = {fmt_time(p.smddp_a)}, b = {fmt_time(p.smddp_b)} per extra node; "
        f"ring a = {fmt_time(p.ring_a)}, b = {fmt_time(p.ring_b)} per extra node.",
        "",
    ]
    if res.get("checks"):
        lines += [
            f"Check against measurements ({fmt_size(res['size'])} float32, simulated nodes x 1 worker, 1 Gbit/s):",
            "",
            "| implementation | nodes | measured | model | model error |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for c in res["checks"]:
            lines.append(
                f"| {c['impl']} | {c['nodes']} | {fmt_time(c['measured_s'])} | {fmt_time(c['model_s'])} | "
                f"{c['error'] * 100:+.0f}% |"
            )
        lines.append("")
    for size in (res["size"], 256 * 1024):
        lines += [
            f"Model, {fmt_size(size)}:",
            "",
            "| nodes | smddp | ring | smddp / ring | smddp busbw Gbit/s |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for n in MODEL_NODES:
            s, r = p.smddp(n, size), p.ring(n, size)
            bus = size / s * 2 * (n - 1) / n * 8 / 1e9
            lines.append(f"| {n} | {fmt_time(s)} | {fmt_time(r)} | {s / r:.2f} | {bus:.3f} |")
        lines.append("")
    efa = efa_markdown(res)
    if efa:
        lines += [efa]
    return "\n".join(lines)


def run_model(cfg: ModelConfig, log: TextIO = sys.stderr) -> dict[str, Any]:
    outdir = Path(cfg.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    if cfg.check:
        t0 = time.monotonic()
        meas = measure(cfg, log)
        params = fit(meas)
        res: dict[str, Any] = {
            "kind": "model",
            "command": shlex_join(["smddp-bench", "model", "--check", "--size", str(cfg.size)]),
            "machine": machine_info(),
            "size": cfg.size,
            "params": asdict(params),
            "measurements": meas,
            "checks": checks(meas, params, cfg.size),
            "wall_s": time.monotonic() - t0,
        }
        (outdir / "model.json").write_text(json.dumps(res, indent=1) + "\n")
    else:
        src = Path(cfg.source or outdir / "model.json")
        if not src.exists():
            raise BenchError(
                f"{src} missing: run `python -m smddp_rigs.bench model --check` (root) to measure the parameters"
            )
        res = json.loads(src.read_text())
        if res.get("size") != cfg.size:  # the checks were measured at another size
            res.pop("checks", None)
            res["size"] = cfg.size
    if "efa" not in res:
        # The EFA case's measured inputs, kept with the model's (BENCHMARKS.md reads model.json).
        local, source = local_hop(outdir)
        res["efa"] = {"copy_bps": copy_speed(), "local_s": local, "local_source": source}
        (outdir / "model.json").write_text(json.dumps(res, indent=1) + "\n")
    md = model_markdown(res)
    (outdir / "model.md").write_text(md)
    print(md, file=log)
    return res


def shlex_join(argv: list[str]) -> str:
    import shlex

    return shlex.join(argv)
