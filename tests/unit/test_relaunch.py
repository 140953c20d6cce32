"""Before a restart: which hosts answer (asked again for --host-wait; one back rejoins), and how a failed attempt is told."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from smddp.launcher.hosts import parse_host_list
from smddp.launcher.mpirun import LaunchConfig, Outcome, wait_for_hosts

# A launch agent (ssh's stand-in: AGENT HOST COMMAND...) under which host "b" answers only once the
# file named by its first argument exists: a machine being replaced.
AGENT = """\
import os, subprocess, sys
flag, host, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
if host == "b" and not os.path.exists(flag):
    print("ssh: connect to host b port 22: No route to host", file=sys.stderr)
    raise SystemExit(255)
raise SystemExit(subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode)
"""


def config(tmp_path: Path) -> tuple[LaunchConfig, Path]:
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    flag = tmp_path / "b-is-back"
    cfg = LaunchConfig(
        np=2,
        hosts=tuple(parse_host_list("a:1,b:1")),
        launch_agent=f"{sys.executable} {agent} {flag}",
        command=("true",),
    )
    return cfg, flag


def test_without_waiting_a_silent_host_is_named(tmp_path: Path) -> None:
    cfg, _ = config(tmp_path)
    t0 = time.monotonic()
    alive, gone = wait_for_hosts(cfg, 0.0)
    assert [h.name for h in alive] == ["a"]
    assert [(h.name, why) for h, why in gone] == [
        ("b", "it does not answer: ssh: connect to host b port 22: No route to host")
    ]
    assert time.monotonic() - t0 < 20  # one look and no wait: a loaded host takes seconds, not 20


def test_a_host_back_within_the_wait_rejoins(tmp_path: Path) -> None:
    cfg, flag = config(tmp_path)
    threading.Timer(2.0, flag.touch).start()
    t0 = time.monotonic()
    alive, gone = wait_for_hosts(cfg, 30.0)
    took = time.monotonic() - t0
    assert [h.name for h in alive] == ["a", "b"] and gone == []
    assert 2.0 <= took < 20, took  # asked again about once a second, not only at the end of the wait


def test_the_wait_is_bounded(tmp_path: Path) -> None:
    cfg, _ = config(tmp_path)
    t0 = time.monotonic()
    alive, gone = wait_for_hosts(cfg, 2.5)
    took = time.monotonic() - t0
    assert [h.name for h in alive] == ["a"] and [h.name for h, _ in gone] == ["b"]
    assert 2.5 <= took < 20, took  # the whole 2.5 s waited, and then no longer than a look or two


def test_only_the_nodes_that_never_said_are_called_lost() -> None:
    """A node lost in the middle of a job: the ledger has its silence and the others' reports of it;
    only the silent one is lost, the others' words stay as what failed the job."""
    o = Outcome(
        1,
        crash=True,
        lost=("node 3 (h3) (its daemon never said how it ended)",),
        infra=("node 0 (h0) (node 0 (h0, rank 0) lost contact: node 3 (h3, rank 3) closed the connection)",),
    )
    assert (
        o.describe()
        == "1 node(s) lost or unreachable (a crash): node 3 (h3) (its daemon never said how it ended)"
    )
    assert Outcome(1, crash=True, infra=("a", "b", "c", "d")).describe() == (
        "an infrastructure failure (a crash): a; b; c; and 1 more"
    )
