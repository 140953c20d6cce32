"""Chaos soak: DDP training with checkpoints on simulated nodes, random faults, --max-restarts, nothing lost.

`make soak` (as root; not in CI) runs it: first the training uninterrupted (the reference), then the
same training while a fault is injected every 40-80 s (chosen by a seeded generator): a rank killed,
a daemon killed or frozen, a node's link cut for 30 s, a node lost and a fresh one brought back in its
place. smddp-launch restarts the job after each (`--max-restarts`), the script resumes from its last
checkpoint, and at the end its parameters must equal the reference's bit for bit (the world never
changes: a lost node is replaced before the launcher looks for it). Written to --out: soak.json and
soak.md (faults, restarts, time to resume per fault, what was left behind) and the job's log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from smddp_rigs.simcluster import ClusterConfig, SimCluster, cleanup_stale

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torch" / "train_resume.py"
FAULTS = ("kill-rank", "kill-daemon", "freeze-daemon", "cut-link", "lose-node")


@dataclass(frozen=True)
class SoakConfig:
    nodes: int = 4
    # Long enough that the training outlasts the fault window at today's speed (about 220 steps/s
    # here: 90,000 steps take about 400 s alone, 600 s and more with faults); a soak whose training
    # ends before every kind of fault came fails, so a faster trainer cannot silently weaken it.
    steps: int = 90000
    ckpt_every: int = 500
    seconds: float = 600.0  # faults are injected for this long (or until the training ends)
    gap_s: tuple[float, float] = (40.0, 80.0)
    cut_s: float = 30.0
    seed: int = 1
    heartbeat_s: float = 3.0
    max_restarts: int = 100
    out: str = "bench-results/soak"
    prefix: str = "smddpk"
    subnet: str = "10.77.9"
    timeout_s: float = 3600.0


@dataclass
class Fault:
    kind: str
    node: int
    at_s: float  # since the soak's launch
    target: str
    failed_s: float | None = None  # smddp-launch's line for the attempt it ended, since launch
    resumed_s: float | None = None  # the next attempt's first line "starting at step", since launch
    resumed_step: int | None = None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def node_processes(cluster: SimCluster, i: int) -> dict[str, list[int]]:
    """Node i's workers (the training script itself, not its launcher wrapper) and daemons."""
    found: dict[str, list[int]] = {"worker": [], "daemon": []}
    for pid in cluster.pids(i):
        cmd = _cmdline(pid)
        if "smddp-daemon" in cmd or "smddp.launcher.cli daemon" in cmd:
            found["daemon"].append(pid)
        elif EXAMPLE.name in cmd and "smddp.launcher" not in cmd and "smddp-launch" not in cmd:
            found["worker"].append(pid)
    return found


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.rng = random.Random(cfg.seed)
        self.lines: list[tuple[float, str]] = []  # (seconds since launch, line) of the job's output
        self.lock = threading.Lock()
        self.t0 = 0.0
        self.log: Any = None

    def launch_cmd(self, cluster: SimCluster, ckpt: Path, save: Path, restarts: int) -> list[str]:
        cfg = self.cfg
        bindir = Path(sys.executable).parent
        return [
            str(bindir / "smddp-launch"),
            *("-H", cluster.host_list(1)),
            *("--iface", cluster.config.cidr),
            *("--launch-agent", cluster.launch_agent_path()),
            *("--heartbeat-timeout", f"{cfg.heartbeat_s:g}"),
            *("--max-restarts", str(restarts), "--restart-delay", "2"),
            *("--stall-timeout", "60", "--host-wait", "30"),
            *("--", sys.executable, str(EXAMPLE), "--steps", str(cfg.steps)),
            *("--ckpt-every", str(cfg.ckpt_every), "--ckpt-dir", str(ckpt), "--save", str(save)),
        ]

    def _read(self, stream: Any, tag: str) -> None:
        for line in stream:
            with self.lock:
                t, text = time.monotonic() - self.t0, f"{tag}{line.rstrip()}"
                self.lines.append((t, text))
                if self.log is not None:  # as it comes, for whoever watches a long soak
                    self.log.write(f"{t:8.2f} {text}\n")
                    self.log.flush()

    def run_job(
        self, cmd: list[str], inject: bool, cluster: SimCluster, ckpt: Path, log: Path
    ) -> tuple[int, float, list[Fault]]:
        self.lines = []
        self.log = log.open("w", errors="replace")
        self.t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        readers = [
            threading.Thread(target=self._read, args=(proc.stdout, ""), daemon=True),
            threading.Thread(target=self._read, args=(proc.stderr, "! "), daemon=True),
        ]
        for t in readers:
            t.start()
        faults: list[Fault] = []
        try:
            if inject:
                self.inject(proc, cluster, ckpt, faults)
            proc.wait(timeout=max(1.0, self.cfg.timeout_s - (time.monotonic() - self.t0)))
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for t in readers:
                t.join(timeout=10)
            with self.lock:
                self.log.close()
                self.log = None
        return proc.returncode, time.monotonic() - self.t0, faults

    def _sleep(self, proc: subprocess.Popen[str], seconds: float) -> bool:
        """Sleep unless the job ends first; True if it is still running."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            time.sleep(0.1)
        return proc.poll() is None

    def inject(
        self, proc: subprocess.Popen[str], cluster: SimCluster, ckpt: Path, faults: list[Fault]
    ) -> None:
        cfg = self.cfg
        while not any(ckpt.glob("ckpt-*.pt")):  # a first checkpoint, so that a restart resumes
            if not self._sleep(proc, 0.2):
                return
        kinds = list(FAULTS)
        while time.monotonic() - self.t0 < cfg.seconds:
            if not self._sleep(proc, self.rng.uniform(*cfg.gap_s)):
                return
            if not kinds:
                kinds = list(FAULTS)
            kind = kinds.pop(self.rng.randrange(len(kinds)))  # every kind once before any twice
            node = self.rng.randrange(cfg.nodes)
            f = self.apply(kind, node, cluster, proc)
            if f is not None:
                faults.append(f)

    def apply(self, kind: str, node: int, cluster: SimCluster, proc: subprocess.Popen[str]) -> Fault | None:
        ns = cluster.netns(node)
        at = time.monotonic() - self.t0
        if kind in ("kill-rank", "kill-daemon", "freeze-daemon"):
            procs = node_processes(cluster, node)["worker" if kind == "kill-rank" else "daemon"]
            if not procs:  # between attempts: nothing of that kind runs on the node right now
                return None
            pid = self.rng.choice(sorted(procs))
            target = f"pid {pid}: {_cmdline(pid)[:120]}"  # (read before a SIGKILL takes it away)
            os.kill(pid, signal.SIGSTOP if kind == "freeze-daemon" else signal.SIGKILL)
            return Fault(kind, node, at, target)
        if kind == "cut-link":
            cluster.set_link(node, False)
            self._sleep(proc, self.cfg.cut_s)
            cluster.set_link(node, True)
            return Fault(kind, node, at, f"{ns} eth0 down for {self.cfg.cut_s:g}s")
        cluster.lose(node)  # every process in it SIGKILLed, its namespace and link gone
        time.sleep(0.5)
        cluster.revive(node)  # a fresh machine in its place, before the launcher probes the hosts
        return Fault(kind, node, at, f"{ns} lost, a fresh one back after 0.5s")

    def leftovers(self, cluster: SimCluster) -> list[str]:
        """Any worker or daemon still in a node (every process of the job runs in one), and any smddp
        file in /dev/shm (the job's shared memory is anonymous: there should never be one)."""
        left = []
        for i in range(self.cfg.nodes):
            for what, pids in node_processes(cluster, i).items():
                left += [f"node {i}: {what} pid {p} ({_cmdline(p)[:100]})" for p in pids]
        shm = [p.name for p in Path("/dev/shm").iterdir() if "smddp" in p.name]
        left += [f"/dev/shm/{n}" for n in shm]
        return left

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        cleanup_stale(cfg.prefix)
        work = Path(os.environ.get("TMPDIR", "/tmp")) / f"{cfg.prefix}-soak-{os.getpid()}"
        work.mkdir(parents=True)
        report: dict[str, Any] = {"config": asdict(cfg)}
        cluster = SimCluster(
            ClusterConfig(nodes=cfg.nodes, prefix=cfg.prefix, subnet=cfg.subnet, uplink=True)
        ).up()
        try:
            ref = self.launch_cmd(cluster, work / "ref-ckpt", work / "ref.pt", 0)
            status, ref_s, _ = self.run_job(
                ref, False, cluster, work / "ref-ckpt", self.out / "reference.log"
            )
            if status != 0:
                raise SystemExit(f"chaos: the reference run failed with status {status} (reference.log)")
            soak = self.launch_cmd(cluster, work / "soak-ckpt", work / "soak.pt", cfg.max_restarts)
            status, soak_s, faults = self.run_job(
                soak, True, cluster, work / "soak-ckpt", self.out / "soak.log"
            )
            lines = list(self.lines)
            time.sleep(2)  # what the last attempt's teardown still ends
            left = self.leftovers(cluster)
        finally:
            cluster.down()
        starts = [(t, ln) for t, ln in lines if "workers, starting at step" in ln]
        failed = [t for t, ln in lines if ln.startswith("! smddp-launch: attempt")]
        for f in faults:
            # The attempt the fault ended, then the next one's first step.
            end = next((t for t in failed if t > f.at_s), None)
            nxt = next(((t, ln) for t, ln in starts if end is not None and t > end), None)
            f.failed_s = end
            if nxt is not None:
                f.resumed_s = nxt[0]
                f.resumed_step = int(nxt[1].split("starting at step ")[1].split()[0])
        restarts = [ln for _, ln in lines if ln.startswith("! smddp-launch: attempt")]
        report.update(
            reference={"status": 0, "seconds": ref_s},
            soak={"status": status, "seconds": soak_s, "attempts": len(starts), "restarts": len(restarts)},
            faults=[asdict(f) for f in faults],
            restart_lines=restarts,
            worlds=sorted({int(ln.split("attempt ")[1].split(": ")[1].split()[0]) for _, ln in starts}),
            leftovers=left,
        )
        report["equal"] = self.compare(work / "ref.pt", work / "soak.pt") if status == 0 else None
        report["missed"] = [k for k in FAULTS if k not in {f.kind for f in faults}]
        (self.out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
        (self.out / "soak.md").write_text(markdown(report))
        return report

    @staticmethod
    def compare(a: Path, b: Path) -> dict[str, Any]:
        import torch

        ra, rb = torch.load(a), torch.load(b)
        diff = [k for k in ra if not torch.equal(ra[k], rb[k])]
        return {"tensors": len(ra), "differing": diff}


def markdown(r: dict[str, Any]) -> str:
    cfg, soak, ref = r["config"], r["soak"], r["reference"]
    eq = r["equal"]
    verdict = (
        "the soak did not finish"
        if eq is None
        else "**bit for bit equal** to the uninterrupted run's"
        if not eq["differing"]
        else f"**different** from the uninterrupted run's in {len(eq['differing'])} of {eq['tensors']} tensors"
    )
    out = [
        f"Chaos soak (`make soak`, seed {cfg['seed']}): `examples/torch/train_resume.py` ({cfg['steps']} steps, "
        f"a checkpoint every {cfg['ckpt_every']}) on {cfg['nodes']} simulated nodes, one rank each, "
        f"`--max-restarts {cfg['max_restarts']} --heartbeat-timeout {cfg['heartbeat_s']:g}`; a fault every "
        f"{cfg['gap_s'][0]:g}-{cfg['gap_s'][1]:g} s for the first {cfg['seconds']:g} s.",
        "",
        f"- Uninterrupted: {ref['seconds']:.0f} s. Under faults: {soak['seconds']:.0f} s, exit status "
        f"{soak['status']}, {len(r['faults'])} faults, {soak['restarts']} restarts, {soak['attempts']} attempts "
        f"(worlds: {', '.join(map(str, r['worlds']))}); {soak['seconds'] - ref['seconds']:.0f} s lost in all.",
        f"- Final parameters: {verdict}.",
        f"- Left behind: {'nothing' if not r['leftovers'] else '; '.join(r['leftovers'])}.",
        (
            "- Every kind of fault came at least once."
            if not r["missed"]
            else f"- **Not every kind of fault came** (the training ended first; raise --steps): {', '.join(r['missed'])}."
        ),
        "",
        "| # | at | fault | node | attempt over after | training resumed after | from step |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for i, f in enumerate(r["faults"], 1):
        over = f"{f['failed_s'] - f['at_s']:.1f} s" if f["failed_s"] is not None else "-"
        after = f"{f['resumed_s'] - f['at_s']:.1f} s" if f["resumed_s"] is not None else "-"
        step = f["resumed_step"] if f["resumed_step"] is not None else "-"
        out.append(f"| {i} | {f['at_s']:.0f} s | {f['kind']} | {f['node']} | {over} | {after} | {step} |")
    out += ["", "What smddp-launch said of each failed attempt:", ""]
    out += [f"- `{ln.removeprefix('! ')[:400]}`" for ln in r["restart_lines"]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smddp_rigs.chaos", description=__doc__)
    d = SoakConfig()
    ap.add_argument("--nodes", type=int, default=d.nodes)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    ap.add_argument("--seconds", type=float, default=d.seconds, help="inject faults for this long")
    ap.add_argument("--gap", default=f"{d.gap_s[0]:g},{d.gap_s[1]:g}", help="seconds between faults: min,max")
    ap.add_argument("--cut", type=float, default=d.cut_s, help="seconds a cut link stays down")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default=d.out)
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("chaos: needs root (network namespaces)", file=sys.stderr)
        return 2
    lo, hi = (float(x) for x in a.gap.split(","))
    cfg = SoakConfig(
        nodes=a.nodes,
        steps=a.steps,
        ckpt_every=a.ckpt_every,
        seconds=a.seconds,
        gap_s=(lo, hi),
        cut_s=a.cut,
        seed=a.seed,
        out=a.out,
    )
    report = Soak(cfg).run()
    print((Path(cfg.out) / "soak.md").read_text())
    ok = report["soak"]["status"] == 0 and report["equal"] is not None and not report["equal"]["differing"]
    return 0 if ok and not report["leftovers"] and not report["missed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
