"""Where smddp's time goes: CPU per all-reduce of every process of a job, and optionally py-spy.

`smddp-bench profile` starts smddp on a topology with one case and an open-ended loop, waits for
the warm-up, then reads every job process's user and system CPU time (/proc/PID/stat) and rank 0's
count of completed all-reduces at the start and end of a window. CPU per all-reduce is the
difference over the window divided by the all-reduces completed in it. With `--py-spy`, one daemon
and one worker are also sampled with `py-spy record --gil` (only the thread holding the GIL, that
is where Python spends CPU) for the same window; the top frames are reported.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from smddp.bench.report import fmt_size
from smddp.bench.runner import BenchError, RunOptions, Topology, build_command, place
from smddp.bench.worker import Case


@dataclass(frozen=True)
class ProfileConfig:
    topology: Topology = field(default_factory=Topology)
    nbytes: int = 4096
    dtype: str = "float32"
    warmup: int = 0  # all-reduces before the window opens; 0: 100 below 1 MiB, else 3
    seconds: float = 8.0  # the window
    pyspy: bool = False
    options: RunOptions = field(default_factory=RunOptions)
    outdir: str = "bench-results"
    name: str = "profile"


def _job_procs(job: str) -> dict[int, dict[str, Any]]:
    tck = os.sysconf("SC_CLK_TCK")
    out: dict[int, dict[str, Any]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if f"SMDDP_JOB_ID={job}".encode() not in f.read():
                    continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{d}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # Only the processes themselves: mpirun, prted, the launch agent and smddp-launch name them in
        # their arguments too.
        if not os.path.basename(argv[0]).startswith(b"python"):
            continue
        if argv[1:2] and argv[1].endswith(b"smddp-daemon"):
            role = "daemon"
        elif argv[1:3] == [b"-m", b"smddp.bench.worker"]:
            role = "worker"
        else:
            continue
        out[int(d)] = {"role": role, "user": int(st[11]) / tck, "sys": int(st[12]) / tck}
    return out


def _progress(path: str) -> tuple[int, float]:
    try:
        with open(path) as f:
            done, t = f.read().split()
        return int(done), float(t)
    except (OSError, ValueError):
        return 0, 0.0


def _top_frames(path: str, n: int = 15) -> list[tuple[float, str]]:
    """py-spy raw output: (share of samples, 'function (file:line)') of the innermost frames."""
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    try:
        with open(path) as f:
            for line in f:
                stack, _, count = line.rstrip().rpartition(" ")
                if not count.isdigit():
                    continue
                frames = stack.split(";")
                thread = frames[0].split(":")[-1].strip() if frames else ""
                leaf[f"{frames[-1]} [{thread}]"] += int(count)
                total += int(count)
    except OSError:
        return []
    return [(c / total, k) for k, c in leaf.most_common(n)] if total else []


def run_profile(cfg: ProfileConfig, log: TextIO = sys.stderr) -> dict[str, Any]:
    job = os.urandom(16).hex()
    tmp = tempfile.mkdtemp(prefix="smddp-profile-")
    os.chmod(tmp, 0o755)
    progress = os.path.join(tmp, "progress")
    case = Case(cfg.nbytes, cfg.dtype, "sum")
    loop = 10**7  # open-ended: the job is stopped once the window has closed
    opts = replace(
        cfg.options, repeats=1, warmup=0, budget_bytes=loop * cfg.nbytes, max_iters=loop, progress=progress
    )
    res: dict[str, Any] = {"kind": "profile", "config": asdict(cfg), "case": case.spec()}
    try:
        with place(cfg.topology, opts) as p:
            cmd, env, _ = build_command("smddp", p, [case], tmp, job, opts)
            res["command"] = " ".join(cmd)
            proc = subprocess.Popen(
                cmd,
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            try:
                res.update(_window(cfg, proc, job, progress, tmp, log))
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    outdir = Path(cfg.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{cfg.name}.json").write_text(json.dumps(res, indent=1) + "\n")
    md = profile_markdown(res)
    (outdir / f"{cfg.name}.md").write_text(md)
    print(md, file=log)
    return res


def _window(
    cfg: ProfileConfig, proc: subprocess.Popen[str], job: str, progress: str, tmp: str, log: TextIO
) -> dict[str, Any]:
    deadline = time.monotonic() + cfg.options.timeout_s
    warmup = cfg.warmup or (100 if cfg.nbytes < 1 << 20 else 3)
    while _progress(progress)[0] < warmup:
        if proc.poll() is not None:
            raise BenchError(f"the job ended before the window: {proc.communicate()[0][-3000:]}")
        if time.monotonic() > deadline:
            raise BenchError("the job made no progress")
        time.sleep(0.1)
    a, (ka, ta) = _job_procs(job), _progress(progress)
    spies = []
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    spy = beside if os.access(beside, os.X_OK) else shutil.which("py-spy")
    if cfg.pyspy and not spy:
        print("smddp-bench profile: py-spy not found (pip install 'smddp[bench]'): CPU times only", file=log)
    if cfg.pyspy and spy:
        for role in ("daemon", "worker"):
            pid = min(p for p, v in a.items() if v["role"] == role)
            out = os.path.join(tmp, f"{role}.txt")
            argv = [spy, "record", "-p", str(pid), "-d", str(int(cfg.seconds)), "-r", "200", "--gil"]
            argv += ["-f", "raw", "--threads", "-o", out]
            spies.append(
                (role, out, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            )
    time.sleep(cfg.seconds)
    b, (kb, tb) = _job_procs(job), _progress(progress)
    for _, _, sp in spies:
        sp.wait(timeout=cfg.seconds + 30)
    n = kb - ka
    if n <= 0:
        raise BenchError("no all-reduce completed in the window")
    procs = []
    for pid in sorted(set(a) & set(b)):
        u, s = b[pid]["user"] - a[pid]["user"], b[pid]["sys"] - a[pid]["sys"]
        procs.append({"pid": pid, "role": a[pid]["role"], "user_us": u / n * 1e6, "sys_us": s / n * 1e6})
    return {
        "allreduces": n,
        "window_s": tb - ta,
        "wall_us": (tb - ta) / n * 1e6,
        "cores": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "processes": procs,
        "pyspy": {role: _top_frames(out) for role, out, _ in spies},
    }


def profile_markdown(res: dict[str, Any]) -> str:
    topo = Topology(**{k: v for k, v in res["config"]["topology"].items()})
    procs = res["processes"]
    total = sum(p["user_us"] + p["sys_us"] for p in procs)
    lines = [
        f"Profile: {topo.label()}, all-reduce of {fmt_size(res['config']['nbytes'])} {res['config']['dtype']}: "
        f"{res['allreduces']} all-reduces in {res['window_s']:.1f} s, {res['wall_us']:.0f} us each; "
        f"CPU of all job processes {total:.0f} us per all-reduce ({total / res['wall_us']:.2f} cores busy "
        f"of {res['cores']}; load average {[round(x, 1) for x in res['loadavg']]}).",
        "",
        "| process | pid | user us / all-reduce | sys us / all-reduce | total |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for p in procs:
        lines.append(
            f"| {p['role']} | {p['pid']} | {p['user_us']:.0f} | {p['sys_us']:.0f} | {p['user_us'] + p['sys_us']:.0f} |"
        )
    for role, frames in res.get("pyspy", {}).items():
        if frames:
            lines += ["", f"py-spy --gil, one {role}, innermost frames:", ""]
            lines += [f"- {share * 100:.1f}% {frame}" for share, frame in frames]
    return "\n".join(lines) + "\n"
