"""When the client RELEASEs result slots: small ones ride with the next descriptor, large ones go at once
(a socketpair and the client's real rings, read by the test)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from smddp_rigs import _engine_testing

from smddp.client.collectives import allreduce_async
from smddp.client.session import RELEASE_BATCH_BYTES, Client
from smddp.proto.frames import Header, MsgType, decode_header
from smddp.transport.conn import Connection
from smddp.transport.shm import Segment
from tests.unit.lonely import lonely_client

RESULTS = 8 << 20  # the scripted daemon's result segment


class ScriptedDaemon:
    """The daemon's end of a worker's socket and rings, driven step by step by the test."""

    def __init__(self, sock: socket.socket) -> None:
        self.conn = Connection(sock, "the worker")
        h, fds = self.conn.recv_header(timeout=5.0)
        assert h.type is MsgType.CHANNEL and len(fds) == 2, h  # its segment and its side socket
        self.rings = _engine_testing.DaemonChannel(fds[0], h.offset, fds[1])
        self.back: list[Header] = []  # popped by pending(), not yet taken by frames()
        self.results = Segment.create(0, RESULTS, "smddp-test-results")
        seg = self.results.native
        self.rings.send_segment(seg.fd, seg.id, seg.size, 0, 5.0)

    def _pop(self, timeout: float) -> Header | None:
        raw = self.rings.pop(timeout)
        return None if raw is None else decode_header(raw)

    def frames(self, n: int) -> list[Header]:
        """The next `n` descriptors from the worker's submit ring (SUBMIT, RELEASE, BYE, in order;
        DaemonChannel takes ATTACHes in on the way, as the plane does)."""
        out = []
        for _ in range(n):
            h = self.back.pop(0) if self.back else self._pop(5.0)
            assert h is not None, f"the worker pushed {len(out)} descriptors, not {n}"
            out.append(h)
        return out

    def pending(self) -> bool:
        """Whether the worker has pushed anything not yet taken."""
        if not self.back:
            h = self._pop(0.1)
            if h is not None:
                self.back.append(h)
        return bool(self.back)

    def done(self, submit: Header, value: float) -> None:
        """Complete `submit` with every element equal to `value`."""
        assert submit.dtype is not None
        nbytes = submit.count * submit.dtype.itemsize
        # A slot of its own, as a real daemon's (a result parked for a later wait is copied out then).
        offset = (submit.seq % 16) * (RESULTS // 16) if nbytes <= RESULTS // 16 else 0
        self.results.view(offset, nbytes).view(submit.dtype.storage)[:] = value
        done = Header(
            MsgType.DONE,
            seq=submit.seq,
            shard=0,
            offset=offset,
            count=submit.count,
            dtype=submit.dtype,
            op=submit.op,
            kind=submit.kind,
        )
        self.rings.push(done.encode(), 5.0)

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
    # One more would pass the bound: every held RELEASE goes, with this one, at once (in the order
    # the results were delivered, which two threads taking DONEs off the ring may swap).
    assert sorted(sent(daemon.frames(fit + 1))) == [(MsgType.RELEASE, s) for s in range(1, fit + 2)]
    assert not daemon.pending()


def test_bye_carries_the_held_releases(pair):
    client, daemon = pair
    roundtrip(client, daemon, 1024, 1.0)
    roundtrip(client, daemon, 1024, 1.0)
    client.shutdown(timeout=2)
    assert sent(daemon.frames(2)) == [(MsgType.RELEASE, 2), (MsgType.BYE, 0)]
