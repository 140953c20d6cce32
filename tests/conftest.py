"""Shared fixtures: launching real jobs, and checking that nothing is left behind after each one."""

from __future__ import annotations

import importlib
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


# Job ids launched by the running test: the leftover check looks at these jobs only, so that other
# jobs on the machine (a developer's, a parallel run's) cannot make a test fail.
LAUNCHED: list[str] = []


def job_env(**extra: str) -> dict[str, str]:
    """An environment for smddp-launch with a fresh job id, remembered for the leftover check."""
    job = secrets.token_hex(16)
    LAUNCHED.append(job)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "SMDDP_JOB_ID": job, **extra}


def smddp_launch(np_: int, nodes: int, args: list[str], timeout: float = 300, extra: list[str] | None = None):
    """Run `smddp-launch -np W --local-nodes N -- python ARGS...`; returns the CompletedProcess."""
    cmd = [str(BIN / "smddp-launch"), "-np", str(np_), "--local-nodes", str(nodes), *(extra or [])]
    cmd += ["--", sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=job_env(), cwd=REPO)


def _environ(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def leftovers(jobs: list[str]) -> list[str]:
    """What jobs `jobs` left behind: shared memory, socket directories, live daemon processes."""
    found = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if "smddp" in n.lower()]
    base = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"smddp-{os.getuid()}")
    if os.path.isdir(base):
        found += [os.path.join(base, n) for n in os.listdir(base) if any(j in n for j in jobs)]
    # Live processes only: a zombie (state Z) holds no memory, socket or shared memory, and after an
    # aborted mpirun it waits for PID 1 to reap it.
    # ps without the sanitizer runtime a sanitized run preloads (make engine-sanitize-jobs): ps hangs under it.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    ps = subprocess.run(
        ["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True, env=env, timeout=30
    )
    for line in ps.stdout.splitlines():
        pid, stat, args = [*line.split(None, 2), "", ""][:3]
        if "smddp-daemon" in args and not stat.startswith("Z"):
            env = _environ(pid)
            if any(f"SMDDP_JOB_ID={j}".encode() in env for j in jobs):
                found.append(f"process {pid} {args[:160]}")
    return found


@pytest.fixture
def own_runtime_dir(monkeypatch):
    """A private XDG_RUNTIME_DIR: the jobs `smddp status` finds are this test's only, whatever else
    runs on the machine (short, for the 108-byte limit of a unix socket's path)."""
    path = tempfile.mkdtemp(prefix="smddp-st-", dir="/tmp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tmp_leftovers() -> set[str]:
    """What jobs must not leave in the temporary directory: Open MPI's session directories (mpirun's
    ompi.<pid>, a simulated node's prted.<pid>) and the bases smddp-launch makes for them, since PMIx
    will not start over the rendezvous files of one a killed mpirun left, so a later mpirun given that
    pid fails; and torchrun's log directories (torchelastic_*), which torchrun makes there when given
    no --log-dir and never removes."""
    tmp = tempfile.gettempdir()
    return {
        os.path.join(tmp, n)
        for n in os.listdir(tmp)
        if re.fullmatch(r"(ompi|prted)\.\d+|smddp-prte-.*|torchelastic_.*", n)
    }


@pytest.fixture(autouse=True)
def nothing_left_in_tmp():
    """Every test: an Open MPI session directory that an mpirun of the test left (killed, or stopped
    short), or a torchrun log directory, fails it (see tmp_leftovers)."""
    before = tmp_leftovers()
    yield
    deadline = time.monotonic() + 10  # an mpirun still ending removes its own
    while (left := tmp_leftovers() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind: {sorted(left)}"


@pytest.fixture
def clean_host():
    """Fails the test if a job it launched left anything behind."""
    shm_before = {n for n in os.listdir("/dev/shm") if "smddp" in n.lower()}
    LAUNCHED.clear()
    yield
    # mpirun may return while the processes it killed are still being reaped: allow a moment.
    deadline = time.monotonic() + 10
    while True:
        after = [x for x in leftovers(LAUNCHED) if x.removeprefix("/dev/shm/") not in shm_before]
        if not after or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not after, f"left behind: {after}"


def skip_or_fail(msg: str) -> NoReturn:
    """Skip a test whose requirement is missing on a developer machine, but fail it in CI (CI=true),
    where `make setup` installs everything and runs as root, and no tier may skip silently."""
    if os.environ.get("CI"):
        pytest.fail(msg + "; they must not skip in CI", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def need_module(name: str, install: str) -> Any:
    """Import `name` for a test module or test; a missing one skips here, but fails in CI."""
    try:
        return importlib.import_module(name)
    except ImportError:
        skip_or_fail(f"these tests need {name} ({install}, or make setup)")


def need_programs(*names: str, install: str) -> None:
    """Programs a test runs for real (sshd, slurmd, prometheus); missing ones skip here, fail in CI."""
    import shutil

    dirs = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
    missing = [
        n for n in names if not shutil.which(n) and not any(os.access(f"{d}/{n}", os.X_OK) for d in dirs)
    ]
    if missing:
        skip_or_fail(f"these tests need {', '.join(missing)} (apt-get install {install}; .ci/run does)")


def processes_in_nodes(namespaces: list[str], hosts: list[str], keep: set[int]) -> list[str]:
    """Every live process in the simulated nodes' namespaces but `keep` (the servers a rig started):
    what a job, a login or a launcher left running, each with its state and parent."""
    found = []
    for ns, host in zip(namespaces, hosts, strict=True):
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        for pid in (int(p) for p in out.split()):
            if pid in keep:
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue  # gone meanwhile
            found.append(f"{host}: {pid} (state {state}, parent {ppid}) {cmd[:150]}")
    return found


def need_root(what: str) -> None:
    """Root on Linux (network namespaces, veth, tc, AF_PACKET); skips here without it, fails in CI."""
    if not (sys.platform.startswith("linux") and os.geteuid() == 0):
        skip_or_fail(f"{what} need root on Linux (network namespaces, veth, tc)")


def communicate_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of every process, each waited for at most `timeout` s; none outlives the call
    (a timeout or error kills every one still running)."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def fault_at_checkpoint(
    cmd: list[str], env: dict[str, str], checkpoint: Path, fault: Callable[[], None], timeout: float = 180
) -> tuple[int, str, str]:
    """Run `cmd`; once `checkpoint` exists, call `fault` (kill a rank, lose a node); then wait for the
    end. Returns (status, stdout, stderr); the process never outlives the call."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + timeout
        while not checkpoint.exists():
            assert p.poll() is None and time.monotonic() < deadline, "no checkpoint came"
            time.sleep(0.05)
        fault()
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, out, err
