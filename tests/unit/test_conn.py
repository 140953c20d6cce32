"""The framed Connection over a real AF_UNIX socket pair: payloads, fd passing, timeouts, garbage."""

from __future__ import annotations

import array
import gc
import os
import socket
import threading
import time

import numpy as np
import pytest

from smddp.errors import CollectiveError, ProtocolError, TransportError
from smddp.proto import HEADER_SIZE, DType, Header, Kind, MsgType, ReduceOp
from smddp.transport.conn import Connection, ConnectionClosed


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ca, cb = Connection(a, "peer-a"), Connection(b, "peer-b")
    yield ca, cb
    ca.close()
    cb.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def data_header(length: int, offset: int = 0) -> Header:
    return Header(
        MsgType.PARTIAL,
        sender=1,
        seq=42,
        shard=2,
        offset=offset,
        length=length,
        count=length // 4,
        dtype=DType.FLOAT32,
        op=ReduceOp.SUM,
        kind=Kind.ALLREDUCE,
    )


def test_closed_is_a_transport_error_not_a_job_failure():
    # The end of a stream is the transport's news; the daemon and client decide whether the job failed.
    assert issubclass(ConnectionClosed, TransportError)
    assert not issubclass(ConnectionClosed, CollectiveError)


def test_large_payload_round_trip(pair):
    a, b = pair
    payload = np.random.default_rng(0).integers(0, 256, 6 * 1024 * 1024 + 13, dtype=np.uint8)
    h = data_header(len(payload), offset=4096)
    errors = []

    def send():
        try:
            a.send_frame(h, payload, timeout=30)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=send)
    t.start()
    got, fds = b.recv_header(timeout=30)
    assert fds == []
    assert got == h
    dest = np.zeros(got.length, np.uint8)
    b.recv_into(dest, timeout=30)
    t.join(30)
    assert not t.is_alive() and not errors
    assert np.array_equal(dest, payload)


def test_frames_back_to_back_and_multipart(pair):
    a, b = pair
    a.send([Header(MsgType.ERROR, length=6).encode(), b"ab", bytearray(b"cd"), memoryview(b"ef")])
    a.send_frame(Header(MsgType.HEARTBEAT, sender=3))
    a.send_frame(Header(MsgType.HELLO, length=3, aux=1), b"xyz")
    h, body, fds = b.recv_frame(timeout=5)
    assert (h.type, body, fds) == (MsgType.ERROR, b"abcdef", [])
    h, body, _ = b.recv_frame(timeout=5)
    assert (h.type, h.sender, body) == (MsgType.HEARTBEAT, 3, b"")
    h, body, _ = b.recv_frame(timeout=5)
    assert (h.type, h.aux, body) == (MsgType.HELLO, 1, b"xyz")


def test_fd_passing_with_attach(pair):
    a, b = pair
    memfd = os.memfd_create("smddp-unit-fd", os.MFD_CLOEXEC)
    try:
        os.ftruncate(memfd, 8192)
        a.send_frame(Header(MsgType.ATTACH, aux=7, count=8192), fds=[memfd])
        h, fds = b.recv_header(timeout=5)
        assert h.type is MsgType.ATTACH and h.aux == 7 and h.count == 8192
        assert len(fds) == 1
        try:
            assert fds[0] != memfd
            assert os.fstat(fds[0]).st_ino == os.fstat(memfd).st_ino
            assert os.fstat(fds[0]).st_dev == os.fstat(memfd).st_dev
            os.pwrite(memfd, b"shared", 100)
            assert os.pread(fds[0], 6, 100) == b"shared"
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        os.close(memfd)


def test_several_fds_in_one_frame(pair):
    a, b = pair
    fds_out = [os.memfd_create(f"smddp-unit-{i}", os.MFD_CLOEXEC) for i in range(3)]
    try:
        a.send_frame(Header(MsgType.SEGMENT), fds=fds_out)
        _, fds_in = b.recv_header(timeout=5)
        try:
            assert [os.fstat(x).st_ino for x in fds_in] == [os.fstat(x).st_ino for x in fds_out]
        finally:
            for fd in fds_in:
                os.close(fd)
    finally:
        for fd in fds_out:
            os.close(fd)


def test_recv_header_timeout_on_silence(pair):
    _, b = pair
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed, match="timed out"):
        b.recv_header(timeout=0.3)
    took = time.monotonic() - t0
    # Not before its 0.3 s; the upper bound only tells a timed wait from a hang (a loaded host is late
    # by seconds at most).
    assert 0.3 <= took < 30.0, took


def test_idle_limit_resets_on_progress(pair):
    """`idle` fails a silent peer, but not one that keeps sending slowly."""
    a, b = pair
    frame = Header(MsgType.HEARTBEAT, sender=1).encode()

    def trickle() -> None:
        for i in range(len(frame)):
            a.sock.sendall(frame[i : i + 1])
            time.sleep(0.02)

    t = threading.Thread(target=trickle)
    t.start()
    h, _ = b.recv_header(idle=0.3)  # 56 bytes over ~1.1 s: slow, never silent for 0.3 s
    t.join()
    assert h.type is MsgType.HEARTBEAT
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed, match=r"silent for 0\.3s"):
        b.recv_header(idle=0.3)
    assert time.monotonic() - t0 < 2.0


def test_recv_header_stop_event(pair):
    _, b = pair
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed, match="stopped"):
        b.recv_header(stop=stop)
    assert time.monotonic() - t0 < 3.0


def test_recv_into_timeout_mid_payload(pair):
    a, b = pair
    a.send([data_header(1024).encode(), b"x" * 100])  # header promises 1024 bytes, 100 come
    h, _ = b.recv_header(timeout=5)
    buf = bytearray(h.length)
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed):
        b.recv_into(buf, timeout=0.3)
    assert time.monotonic() - t0 < 2.0


def test_eof_mid_header(pair):
    a, b = pair
    wire = Header(MsgType.BYE).encode()
    a.sock.sendall(wire[:20])
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionClosed):
        b.recv_header(timeout=5)


def test_eof_before_any_header(pair):
    a, b = pair
    a.close()
    with pytest.raises(ConnectionClosed, match="closed"):
        b.recv_header(timeout=5)


def test_eof_mid_payload(pair):
    a, b = pair
    a.send([data_header(4096).encode(), b"y" * 1000])
    a.sock.shutdown(socket.SHUT_WR)
    h, _ = b.recv_header(timeout=5)
    buf = bytearray(h.length)
    with pytest.raises(ConnectionClosed, match="middle of a frame"):
        b.recv_into(buf, timeout=5)
    assert bytes(buf[:1000]) == b"y" * 1000


@pytest.mark.parametrize(
    "garbage",
    [
        b"\0" * HEADER_SIZE,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(HEADER_SIZE, b"A"),
        Header(MsgType.BYE).encode()[:4] + b"\x09" + Header(MsgType.BYE).encode()[5:],  # version 9
        bytes(range(HEADER_SIZE)),
    ],
    ids=["zeros", "http", "version", "counting"],
)
def test_garbage_is_a_protocol_error(pair, garbage):
    a, b = pair
    a.sock.sendall(garbage)
    with pytest.raises(ProtocolError, match="peer-b"):
        b.recv_header(timeout=5)


def test_garbage_with_fds_closes_them(pair):
    a, b = pair
    memfd = os.memfd_create("smddp-unit-fd", os.MFD_CLOEXEC)
    try:
        # warm up anything lazily opened, and free what earlier tests left to the garbage collector
        # (a collection during the test would close their fds), then count
        gc.collect()
        before = open_fds()
        a.sock.sendmsg(
            [b"\xff" * HEADER_SIZE],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd, memfd]).tobytes())],
        )
        with pytest.raises(ProtocolError):
            b.recv_header(timeout=5)
        assert open_fds() == before, "fds received with a bad header were leaked"
    finally:
        os.close(memfd)


def test_send_after_close(pair):
    a, _ = pair
    a.close()
    assert a.closed
    with pytest.raises(ConnectionClosed):
        a.send_frame(Header(MsgType.BYE))
    a.close()  # twice is fine


def test_send_to_a_closed_peer(pair):
    a, b = pair
    b.close()
    with pytest.raises(ConnectionClosed):
        for _ in range(100):
            a.send_frame(data_header(1 << 20), bytes(1 << 20), timeout=5)


def test_send_timeout_when_peer_does_not_read(pair):
    a, _ = pair
    payload = bytes(64 << 20)  # far more than the socket buffers hold
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed, match="not reading"):
        a.send_frame(data_header(len(payload)), payload, timeout=0.5)
    assert time.monotonic() - t0 < 3.0


def test_peer_credentials(pair):
    a, _ = pair
    assert a.peer_uid() == os.getuid()
    assert a.peer_pid() == os.getpid()


def _partial_header_with_fd(a: Connection, memfd: int) -> None:
    a.sock.sendmsg(
        [Header(MsgType.ATTACH).encode()[:10]],
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd]).tobytes())],
    )


def test_fds_of_an_unfinished_header_are_closed_on_timeout(pair):
    a, b = pair
    memfd = os.memfd_create("smddp-unit-fd", os.MFD_CLOEXEC)
    try:
        before = open_fds()
        _partial_header_with_fd(a, memfd)
        with pytest.raises(ConnectionClosed):
            b.recv_header(timeout=0.2)
        assert open_fds() == before, "fds of a half-received header were leaked"
    finally:
        os.close(memfd)


def test_fds_of_an_unfinished_header_are_closed_on_stop(pair):
    """recv_header gives up when its stop event is set; fds that came with the first bytes must go."""
    a, b = pair
    memfd = os.memfd_create("smddp-unit-fd", os.MFD_CLOEXEC)
    try:
        before = open_fds()
        _partial_header_with_fd(a, memfd)
        stop = threading.Event()
        threading.Timer(0.2, stop.set).start()
        with pytest.raises(ConnectionClosed, match="stopped"):
            b.recv_header(stop=stop)
        assert open_fds() == before, "fds of a half-received header were leaked"
    finally:
        os.close(memfd)
