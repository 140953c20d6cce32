"""`smddp status`: find the jobs on this host, ask a daemon for every daemon's report, draw the table."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass

from smddp.errors import ConfigError, ProtocolError, SmddpError
from smddp.proto.frames import MsgType, Role
from smddp.proto.messages import Bye, StatusRequest
from smddp.transport.auth import client_handshake
from smddp.transport.bootstrap import default_socket_dir
from smddp.transport.conn import Connection


@dataclass(frozen=True)
class StatusConfig:
    job: str = ""  # a job id or a unique prefix of one; "": the one job's table, or the list of several
    json: bool = False  # without a job: the list of daemons, however many jobs (scripts read it)
    list: bool = False  # the list even when there is one job
    watch: float = 0.0  # redraw every this many seconds (0 = once)
    socket_dir: str = ""
    timeout_s: float = 10.0


@dataclass(frozen=True)
class LocalDaemon:
    job: str
    node: int
    directory: str
    info: dict


_FIELDS = {"job": str, "node": int, "nnodes": int, "pid": int, "started": float, "socket": str}


def _well_formed(info: object) -> bool:
    return isinstance(info, dict) and all(
        isinstance(info.get(k), (int, float) if t is float else t) for k, t in _FIELDS.items()
    )


def daemon_alive(pid: int) -> bool:
    """Whether process `pid` lives and is a daemon of ours: a daemon killed by SIGKILL leaves its
    directory behind, and a recycled pid must not bring its job back."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: our daemons run as us, so the pid was recycled
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return True  # no /proc: the pid's existence is all we can know
    return b"smddp-daemon" in cmdline or b"smddp.daemon" in cmdline


def scan(socket_dir: str = "") -> tuple[list[LocalDaemon], list[str]]:
    """The live daemons of every job on this host that this user can see (their private directories),
    and the directories that daemons which are gone left behind (killed before they could clean up)."""
    base = socket_dir or default_socket_dir()
    found: list[LocalDaemon] = []
    stale: list[str] = []
    if not os.path.isdir(base):
        return found, stale
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        try:
            with open(os.path.join(path, "job.json")) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue  # starting, finished, or not ours
        if not _well_formed(info) or not daemon_alive(info["pid"]):
            stale.append(path)
        else:
            found.append(LocalDaemon(info["job"], int(info["node"]), path, info))
    return found, stale


def local_daemons(socket_dir: str = "") -> list[LocalDaemon]:
    """The live daemons of every job on this host that this user can see."""
    return scan(socket_dir)[0]


def fetch_report(d: LocalDaemon, timeout: float) -> dict:
    """Authenticate to the daemon as a control client (same handshake as everyone) and ask."""
    with open(os.path.join(d.directory, "secret"), "rb") as f:
        secret = f.read()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(d.info["socket"])
    except OSError as e:
        sock.close()
        raise SmddpError(f"cannot reach the daemon of job {d.job[:8]} node {d.node}: {e.strerror}") from None
    conn = Connection(sock, f"the daemon of node {d.node}")
    try:
        client_handshake(conn, secret, bytes.fromhex(d.job), Role.CONTROL, os.getpid() & 0x7FFFFFFF, timeout)
        conn.send_frame(StatusRequest().header(), timeout=timeout)
        h, fds = conn.recv_header(timeout=timeout)
        for fd in fds:
            os.close(fd)
        if h.type is not MsgType.REPORT:
            raise ProtocolError(f"expected REPORT, got {h.type.name}")
        report = json.loads(conn.recv_bytes(h.length, timeout=timeout))
        conn.send_frame(Bye().header(), timeout=timeout)
        return report
    finally:
        conn.close()


def pick(daemons: list[LocalDaemon], job: str) -> LocalDaemon:
    matches = sorted({d.job for d in daemons if d.job.startswith(job)})
    if not matches:
        raise ConfigError(f"no job {job!r} on this host (smddp status lists them)")
    if len(matches) > 1:
        raise ConfigError(f"job {job!r} is ambiguous: {', '.join(m[:12] for m in matches)}")
    return min((d for d in daemons if d.job == matches[0]), key=lambda d: d.node)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _ranks(ranks: list[int]) -> str:
    """Sorted ranks as runs: [0, 1, 2, 5] is "0-2, 5"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def render_jobs(daemons: list[LocalDaemon]) -> str:
    if not daemons:
        return "no smddp jobs on this host"
    lines = [f"{'JOB':<34} {'NODES HERE':<12} {'OF':<4} {'PIDS':<20} AGE"]
    jobs: dict[str, list[LocalDaemon]] = {}
    for d in daemons:
        jobs.setdefault(d.job, []).append(d)
    for job, ds in jobs.items():
        age = time.time() - min(d.info["started"] for d in ds)
        nodes = ",".join(str(d.node) for d in ds)
        pids = ",".join(str(d.info["pid"]) for d in ds)
        lines.append(f"{job:<34} {nodes:<12} {ds[0].info['nnodes']:<4} {pids:<20} {_duration(age)}")
    return "\n".join(lines)


def render_report(r: dict) -> str:
    """The live table: one row per daemon, then per-peer traffic, stalls and recent errors."""
    attempt = f"  ·  attempt {r['attempt']} (restarted)" if r.get("attempt") else ""
    out = [f"job {r['job']}  ·  {r['nnodes']} nodes  ·  {r['world']} ranks{attempt}"]
    head = (
        f"{'NODE':<5}{'HOST':<14}{'PID':<8}{'UP':<8}{'STATE':<10}{'WORKERS':<9}{'PEERS':<7}"
        f"{'DONE':>8}{'INFLT':>7}  {'OLDEST':<16}{'IN':>11}{'OUT':>11}{'REDUCE':>12}"
    )
    out += ["", head, "-" * len(head)]
    for d in r["daemons"]:
        if "workers" not in d:
            out.append(f"{d['node']:<5}{d['host'][:13]:<14}{d['pid']:<8}{'-':<8}{d['state']}")
            continue
        state = "FAILED" if d["state"].startswith("FAILED") else d["state"]
        peers = sum(p["connected"] for p in d["peers"])
        oldest = d["oldest"]
        old = f"#{oldest['seq']} {oldest['age_s']:.1f}s" if oldest else "-"
        bin_ = sum(p["bytes_in"] for p in d["peers"])
        bout = sum(p["bytes_out"] for p in d["peers"])
        red = d["reduction"]
        out.append(
            f"{d['node']:<5}{d['host'][:13]:<14}{d['pid']:<8}{_duration(d['uptime_s']):<8}{state:<10}"
            f"{d['workers']['connected']}/{d['workers']['expected']:<7}{peers}/{len(d['peers']):<5}"
            f"{d['collectives']['done']:>8}{d['collectives']['in_flight']:>7}  {old:<16}"
            f"{_size(bin_):>11}{_size(bout):>11}{red['gbytes_per_s']:>9.2f} GB/s"
        )
    # What each rank's front ends chose (the torch backend a group got), grouped: "native: ranks 0-3".
    chose: dict[tuple[str, str], list[int]] = {}
    for d in r["daemons"]:
        for rank, said in d.get("front_ends", {}).items():
            for k, v in said.items():
                chose.setdefault((k, v), []).append(int(rank))
    if chose:
        out += ["", "front ends (each rank's choice):"]
        out += [f"  {k}: {v} on ranks {_ranks(sorted(rs))}" for (k, v), rs in sorted(chose.items())]
    routed: dict[str, int] = {}
    for d in r["daemons"]:
        for k, v in d.get("routed", {}).items():
            routed[k] = routed.get(k, 0) + v
    if routed:
        out += [
            "",
            "calls smddp routed to the side group (all ranks): "
            + ", ".join(f"{k} x{v}" for k, v in sorted(routed.items())),
        ]
    devices = sorted((c for d in r["daemons"] for c in d.get("devices", [])), key=lambda c: c["rank"])
    if devices:
        out += ["", "device copies (each rank, between its GPU and host memory):"]
        out += [
            f"  rank {c['rank']}: to host {_size(c['d2h_bytes'])} in {c['d2h_copies']}, "
            f"back {_size(c['h2d_bytes'])} in {c['h2d_copies']}"
            + (f"; all-reduces summed on: {c['node_reduce']}" if c.get("node_reduce") else "")
            for c in devices
        ]
    fabrics = [(d["node"], d["fabric"]) for d in r["daemons"] if d.get("fabric")]
    if fabrics and r["nnodes"] > 1:
        out += ["", "fabric between the daemons:"]
        for node, f in fabrics:
            counts = (
                f"; messages in {f['messages_in']}, out {f['messages_out']}, rejected {f['rejected']}, "
                f"registrations {f['registrations']}"
                if f["name"] == "ofi" and "messages_in" in f
                else ""
            )
            out.append(f"  node {node}: {f['describe'] or f['name']} ({f['why']}){counts}")
    traffic = [
        (d["node"], p)
        for d in r["daemons"]
        if "peers" in d
        for p in d["peers"]
        if p["rate_in"] or p["rate_out"]
    ]
    if traffic:
        out += ["", "current throughput (last seconds):"]
        for node, p in traffic:
            out.append(
                f"  node {node} <-> node {p['node']}: in {_size(p['rate_in'])}/s, out {_size(p['rate_out'])}/s, "
                f"send queue {p['send_queue']}"
            )
    for d in r["daemons"]:
        for st in d.get("stalled", []):
            who = ", ".join(st["waiting_for"]) or "in progress"
            out.append(
                f"STALLED node {d['node']}: #{st['seq']} {st['what']} waiting {st['age_s']:.0f}s for {who}"
            )
        if d.get("state", "").startswith("FAILED"):
            out.append(f"node {d['node']}: {d['state']}")
        for e in d.get("last_errors", [])[-3:]:
            out.append(
                f"node {d['node']} {time.strftime('%H:%M:%S', time.localtime(e['time']))}: {e['text'][:150]}"
            )
    return "\n".join(out)


def status(cfg: StatusConfig) -> int:
    """Print the named job's table, else the one job's table, else the list of jobs; with watch, redraw."""
    while True:
        daemons, stale = scan(cfg.socket_dir)
        jobs = {d.job for d in daemons}
        if not cfg.job and len(jobs) == 1 and not (cfg.json or cfg.list):
            (only,) = jobs
            try:
                text = render_report(fetch_report(pick(daemons, only), cfg.timeout_s))
            except (SmddpError, OSError) as e:  # ending as we ask: the list says what is left
                text = f"{render_jobs(daemons)}\n(its daemon did not answer: {e})"
        elif not cfg.job:
            text = json.dumps([d.info for d in daemons], indent=2) if cfg.json else render_jobs(daemons)
            if stale and not cfg.json:
                text += "\n(left behind by daemons that are gone, safe to remove: " + ", ".join(stale) + ")"
        else:
            report = fetch_report(pick(daemons, cfg.job), cfg.timeout_s)
            text = json.dumps(report, indent=2) if cfg.json else render_report(report)
        if cfg.watch and not cfg.json:
            sys.stdout.write("\x1b[H\x1b[2J" + text + f"\n\n(every {cfg.watch:g}s; Ctrl-C to stop)\n")
        else:
            sys.stdout.write(text + "\n")
        sys.stdout.flush()
        if not cfg.watch:
            return 0
        time.sleep(cfg.watch)
