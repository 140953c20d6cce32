"""When the client RELEASEs result slots: small ones ride with the next frame, large ones go at once (a socketpair)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from smddp.client.collectives import allreduce_async
from smddp.client.session import RELEASE_BATCH_BYTES, Client
from smddp.proto.frames import Header, MsgType
from smddp.transport.conn import Connection
from smddp.transport.shm import Segment
from tests.unit.lonely import lonely_client

RESULTS = 8 << 20  # the scripted daemon's result segment


class ScriptedDaemon:
    """The daemon's end of a worker connection, driven step by step by the test."""

    def __init__(self, sock: socket.socket) -> None:
        self.conn = Connection(sock, "the worker")
        self.results = Segment.create(0, RESULTS, "smddp-test-results")
        self.conn.send_frame(Header(MsgType.SEGMENT, shard=0, offset=RESULTS), fds=[self.results.fd])

    def frames(self, n: int) -> list[Header]:
        """The next `n` frames from the worker (ATTACH fds are closed: only the order matters here)."""
        out = []
        for _ in range(n):
            h, fds = self.conn.recv_header(timeout=5.0)
            for fd in fds:
                socket.close(fd)
            out.append(h)
        return out

    def pending(self) -> bool:
        """Whether the worker has sent anything not yet read."""
        self.conn.sock.setblocking(False)
        try:
            return bool(self.conn.sock.recv(1, socket.MSG_PEEK))
        except BlockingIOError:
            return False
        finally:
            self.conn.sock.settimeout(0.5)

    def done(self, submit: Header, value: float) -> None:
        """Complete `submit` with every element equal to `value`."""
        assert submit.dtype is not None
        nbytes = submit.count * submit.dtype.itemsize
        self.results.view(0, nbytes).view(submit.dtype.storage)[:] = value
        self.conn.send_frame(
            Header(
                MsgType.DONE,
                seq=submit.seq,
                shard=0,
                offset=0,
                count=submit.count,
                dtype=submit.dtype,
                op=submit.op,
                kind=submit.kind,
            )
        )

    def close(self) -> None:
        self.conn.close()
        self.results.close()


@pytest.fixture
def pair():
    client, theirs = lonely_client()
    daemon = ScriptedDaemon(theirs)
    yield client, daemon
    client.shutdown(timeout=2)
    daemon.close()


def until_submits(daemon: ScriptedDaemon, k: int) -> list[Header]:
    """Frames from the worker up to and including its k-th SUBMIT (ATTACHes and RELEASEs between)."""
    frames: list[Header] = []
    while sum(f.type is MsgType.SUBMIT for f in frames) < k:
        frames += daemon.frames(1)
    return frames


def roundtrip(
    client: Client, daemon: ScriptedDaemon, n: int, value: float
) -> tuple[np.ndarray, list[Header]]:
    """One all-reduce of `n` float32 through the scripted daemon: the result, and what the worker sent."""
    h = allreduce_async(client, np.zeros(n, np.float32))
    frames = until_submits(daemon, 1)
    daemon.done(frames[-1], value)
    return h.wait(timeout=5), frames


def sent(frames: list[Header]) -> list[tuple[MsgType, int]]:
    return [(f.type, f.seq) for f in frames if f.type is not MsgType.ATTACH]


def test_small_result_is_released_with_the_next_submit(pair):
    client, daemon = pair
    out, _ = roundtrip(client, daemon, 1024, 3.0)
    assert np.array_equal(out, np.full(1024, 3.0, np.float32))
    assert not daemon.pending(), "a 4 KiB result's RELEASE went out on its own"
    out, frames = roundtrip(client, daemon, 1024, 4.0)
    assert np.array_equal(out, np.full(1024, 4.0, np.float32))
    assert sent(frames) == [(MsgType.RELEASE, 1), (MsgType.SUBMIT, 2)]


def test_large_result_is_released_at_once(pair):
    client, daemon = pair
    roundtrip(client, daemon, 1024, 1.0)  # held
    big = RELEASE_BATCH_BYTES // 4 + 1  # float32 elements: one past the bound
    out, frames = roundtrip(client, daemon, big, 2.0)
    assert np.array_equal(out, np.full(big, 2.0, np.float32))
    assert sent(frames) == [(MsgType.RELEASE, 1), (MsgType.SUBMIT, 2)]
    assert sent(daemon.frames(1)) == [(MsgType.RELEASE, 2)]
    assert not daemon.pending()


def test_held_results_never_pass_the_bound(pair):
    client, daemon = pair
    n = 16 << 10  # 64 KiB results
    fit = RELEASE_BATCH_BYTES // (n * 4)
    handles = [allreduce_async(client, np.zeros(n, np.float32)) for _ in range(fit + 1)]
    submits = [f for f in until_submits(daemon, fit + 1) if f.type is MsgType.SUBMIT]
    for f in submits[:fit]:
        daemon.done(f, 1.0)
    for h in handles[:fit]:
        assert np.array_equal(h.wait(timeout=5), np.ones(n, np.float32))
    assert not daemon.pending(), "results within the bound were released on their own"
    daemon.done(submits[fit], 1.0)
    handles[fit].wait(timeout=5)
    # One more would pass the bound: every held RELEASE goes, with this one, at once.
    assert sent(daemon.frames(fit + 1)) == [(MsgType.RELEASE, s) for s in range(1, fit + 2)]
    assert not daemon.pending()


def test_bye_carries_the_held_releases(pair):
    client, daemon = pair
    roundtrip(client, daemon, 1024, 1.0)
    roundtrip(client, daemon, 1024, 1.0)
    client.shutdown(timeout=2)
    assert sent(daemon.frames(2)) == [(MsgType.RELEASE, 2), (MsgType.BYE, 0)]
