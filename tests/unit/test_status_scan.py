"""`smddp status` finds live jobs only: directories of killed daemons and malformed files are set aside."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from smddp.launcher.status import StatusConfig, daemon_alive, scan, status


def _job_dir(base: Path, job: str, node: int, pid: int, **extra: object) -> Path:
    d = base / f"job-{job}-n{node}"
    d.mkdir(parents=True)
    info = {"job": job, "node": node, "nnodes": 2, "pid": pid, "started": time.time(), "socket": str(d / "s")}
    (d / "job.json").write_text(json.dumps({**info, **extra}))
    return d


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _daemon_like() -> subprocess.Popen:
    """A live process whose command line names smddp, as a daemon's does."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "smddp-daemon"])


def test_live_dead_and_malformed(tmp_path: Path) -> None:
    live = _daemon_like()
    try:
        a, b = "a" * 32, "b" * 32
        _job_dir(tmp_path, a, 0, live.pid)
        dead = _job_dir(tmp_path, b, 0, _dead_pid())
        broken = _job_dir(tmp_path, "c" * 32, 0, live.pid, started="yesterday")
        (tmp_path / "job-starting-n0").mkdir()  # no job.json yet: neither a job nor stale
        found, stale = scan(str(tmp_path))
        assert [(d.job, d.node) for d in found] == [(a, 0)]
        assert sorted(stale) == sorted([str(dead), str(broken)])
    finally:
        live.kill()
        live.wait()


def test_a_recycled_pid_is_not_a_daemon() -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert daemon_alive(other.pid) is False
    finally:
        other.kill()
        other.wait()
    assert daemon_alive(_dead_pid()) is False


def test_status_lists_no_dead_job_and_names_what_it_left(tmp_path: Path, capsys) -> None:
    dead = _job_dir(tmp_path, "d" * 32, 0, _dead_pid())
    assert status(StatusConfig(socket_dir=str(tmp_path))) == 0
    out = capsys.readouterr().out
    assert out.startswith("no smddp jobs on this host") and str(dead) in out, out
    assert status(StatusConfig(socket_dir=str(tmp_path), json=True)) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_the_table_says_which_attempt() -> None:
    from smddp.launcher.status import render_report

    report = {"job": "e" * 32, "nnodes": 1, "world": 2, "daemons": []}
    assert "attempt" not in render_report({**report, "attempt": 0}).splitlines()[0]
    assert render_report({**report, "attempt": 2}).splitlines()[0].endswith("attempt 2 (restarted)")
    assert "attempt" not in render_report(report)  # a daemon from before restarts existed


def test_the_table_names_the_fabric() -> None:
    from smddp.launcher.status import render_report

    fabric = {
        "name": "ofi",
        "provider": "tcp",
        "library": "/x/libfabric.so.1",
        "why": "--fabric ofi --ofi-provider tcp",
        "describe": "ofi tcp (fabric 10.0.0.0/24, domain eth0), libfabric /x/libfabric.so.1",
        "registrations": 4,
        "temp_registrations": 0,
        "messages_in": 10,
        "messages_out": 12,
        "rejected": 1,
    }
    report = {"job": "e" * 32, "nnodes": 2, "world": 2, "daemons": [{"node": 0, "fabric": fabric}]}
    # (A daemon row without its workers: the table shows what it has, the fabric section the rest.)
    report["daemons"][0].update(host="h", pid=1, state="starting")  # type: ignore[index]
    text = render_report(report)
    assert "fabric between the daemons:" in text
    assert "node 0: ofi tcp (fabric 10.0.0.0/24, domain eth0)" in text and "rejected 1" in text
    assert "fabric between" not in render_report({**report, "nnodes": 1})


def test_the_table_says_what_each_ranks_front_end_chose() -> None:
    from smddp.launcher.status import render_report

    native, python = {"torch backend": "native"}, {"torch backend": "python"}
    daemons = [
        {
            "node": 0,
            "host": "h",
            "pid": 1,
            "state": "running",
            "front_ends": {"0": native, "2": native, "1": native},
        },
        {
            "node": 1,
            "host": "h",
            "pid": 2,
            "state": "running",
            "front_ends": {"5": native, "3": python, "4": python},
        },
    ]
    text = render_report({"job": "e" * 32, "nnodes": 2, "world": 6, "daemons": daemons})
    assert "  torch backend: native on ranks 0-2, 5" in text, text
    assert "  torch backend: python on ranks 3-4" in text, text
    assert "front ends" not in render_report({"job": "e" * 32, "nnodes": 1, "world": 1, "daemons": []})
