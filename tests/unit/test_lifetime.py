"""The small shared pieces: a child dies with its parent, a job's directories are found by their one name."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from smddp.transport.bootstrap import job_dir, job_dirs

JOB = "0123456789abcdef0123456789abcdef"

# The middle process starts a grandchild that asks for SIGKILL on its parent's death, prints the
# grandchild's pid, and exits; the grandchild would otherwise sleep for a minute.
_MIDDLE = """
import subprocess, sys
code = "import sys, time; sys.path.insert(0, sys.argv[1]); from smddp.lifetime import signal_on_parent_death; " \\
    "assert signal_on_parent_death(); print('armed', flush=True); time.sleep(60)"
p = subprocess.Popen([sys.executable, "-c", code, sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert p.stdout.readline().strip() == "armed"
print(p.pid, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_dies_with_its_parent():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _MIDDLE, root], capture_output=True, text=True, timeout=30)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the grandchild outlived its parent"


def test_job_dirs_are_the_ones_job_dir_names(tmp_path):
    mine = [job_dir(str(tmp_path), JOB, n) for n in (0, 1, 12)]
    others = [job_dir(str(tmp_path), "f" * 32, 0), str(tmp_path / f"job-{JOB}-nx"), str(tmp_path / "routed")]
    for d in mine + others:
        os.mkdir(d)
    assert job_dirs(str(tmp_path), JOB) == sorted(mine)
    assert job_dirs(str(tmp_path / "absent"), JOB) == []


# The middle process stands for mpirun: it starts a worker's wrapper, reads the worker's pid, and
# dies without a word (as mpirun or prted killed with SIGKILL).
_LAUNCHER = """
import os, subprocess, sys
env = {**os.environ, "OMPI_COMM_WORLD_RANK": "0"}
env.pop("SMDDP_JOB_ID", None)
worker = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
p = subprocess.Popen(
    [sys.executable, sys.argv[1], "--nodes", "1", "--per-node", "1", "--master-addr", "127.0.0.1",
     "--master-port", "1", "--", sys.executable, "-c", worker],
    stdout=subprocess.PIPE, text=True, env=env,
)
print(p.pid, p.stdout.readline().strip(), flush=True)
os._exit(0)
"""


def test_a_workers_wrapper_and_its_worker_end_with_the_launcher():
    """Orphaned, the wrapper is told (SIGTERM), passes it on, and the worker ends: nothing of the job
    runs on outside it (Slurm's scancel finds a job's processes by parentage)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    wrapper = os.path.join(root, "smddp", "launcher", "worker_env.py")
    out = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, wrapper], capture_output=True, text=True, timeout=30
    )
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, pids)), "the wrapper or its worker outlived the launcher"
