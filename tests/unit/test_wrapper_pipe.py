"""The pipe between a worker's client and smddp-launch's wrapper: joined, and the cause's exit status."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from smddp.client.session import WrapperPipe
from smddp.launcher.worker_env import Report, _Joined, run_worker


def _pipe() -> tuple[_Joined, WrapperPipe]:
    j = _Joined()
    fd = os.dup(j.write_fd)  # what the child would hold
    env = {"SMDDP_JOINED_FD": f"{fd}:{os.fstat(fd).st_ino}"}
    j.start()
    pipe = WrapperPipe.open(env)
    assert pipe is not None and not os.get_inheritable(fd)
    return j, pipe


def test_joined_then_cause():
    j, pipe = _pipe()
    pipe.cause(137)
    pipe.cause(9)  # only the first cause counts
    pipe.close()
    assert j.settle() and j.cause == 137


def test_joined_without_cause_and_garbage_is_ignored():
    j, pipe = _pipe()
    pipe._write(b"cXYZ\n")
    pipe.close()
    assert j.settle() and j.cause is None


def test_a_stale_or_foreign_fd_is_not_used():
    assert WrapperPipe.open({}) is None
    r, w = os.pipe()
    try:
        assert WrapperPipe.open({"SMDDP_JOINED_FD": f"{w}:1"}) is None  # not the inode the wrapper gave
    finally:
        os.close(r)
        os.close(w)


def test_the_wrapper_ends_a_consequence_with_the_causes_status():
    """A worker that failed because of another rank's end (told by its client) exits with that
    rank's status; one that succeeded anyway keeps 0; one without news keeps its own status."""
    child = (
        "import os, sys\n"
        "from smddp.client.session import WrapperPipe\n"
        "p = WrapperPipe.open(os.environ)\n"
        "p.cause(3) if sys.argv[1] != 'none' else None\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    for tell, own, want in [("cause", 1, 3), ("cause", 0, 0), ("none", 1, 1)]:
        report = _Recorded(rank=1, node=0, job_hex="00" * 16)
        t0 = time.monotonic()
        code = run_worker([sys.executable, "-c", child, tell, str(own)], "", report)
        assert code == want, (tell, own, code)
        # A joined rank that ended badly is reported without waiting for a daemon (its own status).
        assert report.sent == ([(own, False, False)] if own else []), report.sent
        assert time.monotonic() - t0 < 20


def test_a_wrapper_told_to_end_says_so():
    """mpirun's teardown (SIGTERM to the wrapper, passed on to the worker): the report says the
    rank was torn down, so that its daemon does not take its end for a crash; it does not wait for
    a daemon that may be going down too."""
    child = (
        "import os, time\n"
        "from smddp.client.session import WrapperPipe\n"
        "WrapperPipe.open(os.environ)\n"
        "time.sleep(60)\n"
    )
    report = _Recorded(rank=1, node=0, job_hex="00" * 16)
    default = signal.getsignal(signal.SIGTERM)
    done = threading.Event()

    def teardown() -> None:
        # mpirun's SIGTERM, once the wrapper passes it on (before that it would end this process).
        while signal.getsignal(signal.SIGTERM) is default and not done.wait(0.01):
            pass
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=teardown)
    killer.start()
    t0 = time.monotonic()
    try:
        code = run_worker([sys.executable, "-c", child], "", report)
    finally:
        done.set()
        killer.join()
    assert code == 128 + signal.SIGTERM
    assert report.sent == [(128 + signal.SIGTERM, False, True)], report.sent
    assert time.monotonic() - t0 < 20


class _Recorded(Report):
    """The wrapper's report to its daemon, recorded instead of sent (the daemon's side of EXITED runs
    for real in tests/multiprocess/test_launch.py)."""

    def __init__(self, rank: int, node: int, job_hex: str) -> None:
        super().__init__(rank, node, job_hex)
        self.sent: list[tuple[int, bool, bool]] = []

    def send(self, status: int, wait: bool = True, torn_down: bool = False) -> None:
        self.sent.append((status, wait, torn_down))
