"""The job ledger: daemons say they are up and how they ended; strangers and garbage are ignored."""

from __future__ import annotations

import socket
import time

from smddp.transport.ledger import NEVER_SAID, Ledger, LedgerClient, report_infra


def _until(check, timeout: float = 5.0) -> None:
    """The ledger reads on its own threads: wait for what the clients sent to be read."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_up_and_ended_cleanly_or_not() -> None:
    ledger = Ledger(["127.0.0.1"])
    try:
        a = LedgerClient.connect(ledger.spec, 0)
        b = LedgerClient.connect(ledger.spec, 1)
        c = LedgerClient.connect(ledger.spec, 2)
        assert a and b and c
        _until(lambda: ledger.up == {0, 1, 2})
        a.end(True)
        b.end(False, "node 1 lost contact:\nnode 2 closed the connection")
        t0 = time.monotonic()
        # c never says how it ended, and its connection stays open: the wait is bounded.
        never = "its daemon never said how it ended"
        want = [(1, "node 1 lost contact: node 2 closed the connection"), (2, never)]
        assert ledger.unfinished(settle_s=0.3) == want
        assert time.monotonic() - t0 < 2.0
        assert ledger.ended[1] == (False, "node 1 lost contact: node 2 closed the connection")
        c._sock.close()  # a daemon killed: its connection ends without a word
        assert ledger.unfinished(settle_s=1.0) == want
    finally:
        ledger.close()


def test_strangers_and_garbage_count_for_nothing() -> None:
    ledger = Ledger(["127.0.0.1"])
    try:
        port = int(ledger.spec.rsplit(":", 1)[1])
        for line in (b"up 0000 0\nend ok\n", b"GET / HTTP/1.1\r\n\r\n", b"end ok\n", b"\xff" * 10000):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(line)
        good = LedgerClient.connect(ledger.spec, 5)
        assert good is not None
        _until(lambda: ledger.up == {5})
        good.end(True)
        assert ledger.unfinished() == [] and ledger.up == {5}
    finally:
        ledger.close()


def test_infrastructure_causes_from_daemons_and_workers_wrappers() -> None:
    """A daemon's "end failed-infra", a daemon that never said, and a wrapper's "lost" line (answered
    once recorded) are infrastructure failures; a plain "end failed" is not; a wrong token is nothing."""
    ledger = Ledger(["127.0.0.1"])
    try:
        a, b, c = (LedgerClient.connect(ledger.spec, n) for n in range(3))
        assert a and b and c
        _until(lambda: ledger.up == {0, 1, 2})
        a.end(False, "rank 0 exited with status 1")
        b.end(False, "node 1 lost contact: node 2 silent for 3.0 s", infra=True)
        assert report_infra(ledger.spec, 4, "rank 4: lost the node daemon:\n silent for 3s")
        token = ledger.spec.partition("@")[0]
        assert not report_infra(ledger.spec.replace(token, "0" * len(token)), 5, "a stranger")
        assert not report_infra("garbage", 6, "no ledger")
        assert len(ledger.unfinished(settle_s=0.3)) == 3  # c never said: waited for, bounded
        assert ledger.infra_failures() == [
            ("node", 1, "node 1 lost contact: node 2 silent for 3.0 s"),
            ("node", 2, NEVER_SAID),
            ("rank", 4, "rank 4: lost the node daemon: silent for 3s"),
        ]
        c.end(False, "stopped by signal 15 (mpirun tore the job down)")
        _until(lambda: 2 in ledger.ended)
        assert [x[:2] for x in ledger.infra_failures()] == [("node", 1), ("rank", 4)]
    finally:
        ledger.close()


def test_no_ledger_or_none_reachable() -> None:
    assert LedgerClient.connect("", 0) is None
    assert LedgerClient.connect("garbage", 0) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    assert LedgerClient.connect(f"{'a' * 32}@127.0.0.1:{port}", 0, timeout=1.0) is None


def test_ever_up_and_daemons_that_never_came_up() -> None:
    """A daemon world that fails before any daemon's bootstrap has no worker to tell: smddp-launch
    stops the workers at once instead of giving them the grace meant for hearing why."""
    import subprocess

    from smddp.launcher.mpirun import supervise

    ledger = Ledger(["127.0.0.1"])
    try:
        t0 = time.monotonic()
        assert not ledger.ever_up(settle_s=0.2)
        assert time.monotonic() - t0 < 1.0
        a = LedgerClient.connect(ledger.spec, 0)
        assert a
        assert ledger.ever_up(settle_s=5.0)
    finally:
        ledger.close()
    daemons = subprocess.Popen(["sh", "-c", "exit 2"])
    workers = subprocess.Popen(["sleep", "60"])
    t0 = time.monotonic()
    assert supervise(daemons, workers, worker_grace_s=30.0, daemons_ever_up=lambda: False) == (2, True)
    assert time.monotonic() - t0 < 10.0 and workers.poll() is not None
    # With a daemon that was up, the workers get their grace to hear why and leave by themselves.
    daemons = subprocess.Popen(["sh", "-c", "exit 2"])
    workers = subprocess.Popen(["sh", "-c", "sleep 0.3; exit 1"])
    assert supervise(daemons, workers, worker_grace_s=30.0, daemons_ever_up=lambda: True) == (1, True)


def test_a_daemon_a_rank_lost_is_not_waited_for():
    """A rank whose own daemon froze said so through its wrapper: after the workers end, the daemons'
    world (which cannot finish by itself) is stopped after LOST_DAEMON_GRACE_S, not the full grace;
    the ledger says whether a wrapper reported that."""
    import subprocess

    from smddp.launcher.mpirun import LOST_DAEMON_GRACE_S, supervise
    from smddp.transport.ledger import report_infra

    ledger = Ledger(["127.0.0.1"])
    try:
        assert not ledger.a_rank_lost_its_daemon()
        assert report_infra(ledger.spec, 1, "rank 1: lost the node daemon: silent for 3s")
        deadline = time.monotonic() + 10
        while not ledger.a_rank_lost_its_daemon() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ledger.a_rank_lost_its_daemon()
    finally:
        ledger.close()
    daemons = subprocess.Popen(["sleep", "600"])  # a frozen daemon: it never finishes
    workers = subprocess.Popen(["sh", "-c", "exit 1"])
    t0 = time.monotonic()
    assert supervise(daemons, workers, daemon_grace_s=300.0, daemon_lost=lambda: True) == (1, False)
    assert time.monotonic() - t0 < LOST_DAEMON_GRACE_S + 10.0 and daemons.poll() is not None
    # Without that word, a daemon world still running gets the grace meant for finishing by itself.
    daemons = subprocess.Popen(["sh", "-c", "sleep 1; exit 0"])
    workers = subprocess.Popen(["sh", "-c", "exit 1"])
    assert supervise(daemons, workers, daemon_grace_s=300.0, daemon_lost=lambda: False) == (1, False)
    assert daemons.returncode == 0  # it finished by itself, not stopped
