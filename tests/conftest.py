"""Shared fixtures: launching real jobs, and checking that nothing is left behind after each one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def smddp_launch(np_: int, nodes: int, args: list[str], timeout: float = 300, extra: list[str] | None = None):
    """Run `smddp-launch -np W --local-nodes N -- python ARGS...`; returns the CompletedProcess."""
    cmd = [str(BIN / "smddp-launch"), "-np", str(np_), "--local-nodes", str(nodes), *(extra or [])]
    cmd += ["--", sys.executable, *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def leftovers() -> list[str]:
    """smddp state that outlived its job: shared memory, socket directories, daemon processes."""
    found = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if "smddp" in n.lower()]
    base = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"smddp-{os.getuid()}")
    if os.path.isdir(base):
        found += [os.path.join(base, n) for n in os.listdir(base)]
    # Live processes only: a zombie (state Z) holds no memory, socket or shared memory, and after an
    # aborted mpirun it waits for PID 1 to reap it.
    ps = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True)
    for line in ps.stdout.splitlines():
        pid, stat, args = [*line.split(None, 2), "", ""][:3]
        if "smddp-daemon" in args and not stat.startswith("Z"):
            found.append(f"process {pid} {args[:160]}")
    return found


@pytest.fixture
def clean_host():
    """Fails the test if the job left anything behind."""
    before = set(leftovers())
    yield
    after = [x for x in leftovers() if x not in before]
    assert not after, f"left behind: {after}"
