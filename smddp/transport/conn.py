"""A framed, bounded-time socket: whole frames out, headers and payloads in, fds over unix sockets."""

from __future__ import annotations

import array
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from smddp.errors import ProtocolError, TransportError
from smddp.proto import HEADER_SIZE, Header, decode_header

_MAX_FDS = 8
# How long one poll of a blocking socket lasts; loops re-check their deadline and stop flag.
_POLL_S = 0.5

if TYPE_CHECKING:
    import numpy as np

    Buffer = bytes | bytearray | memoryview | np.ndarray


class ConnectionClosed(TransportError):
    """The other end closed the connection (or it broke, or went silent past a timeout)."""


class _Clock:
    """Two limits on a blocking call: `timeout` in total, and `idle` without any bytes moving."""

    def __init__(self, timeout: float | None, idle: float | None) -> None:
        now = time.monotonic()
        self.deadline = None if timeout is None else now + timeout
        self.idle = idle
        self.last = now

    def progress(self) -> None:
        self.last = time.monotonic()

    def expired(self) -> str | None:
        now = time.monotonic()
        if self.deadline is not None and now > self.deadline:
            return "timed out"
        if self.idle is not None and now - self.last > self.idle:
            return f"has been silent for {self.idle:g}s"
        return None


class Connection:
    """One socket carrying smddp frames; reads from one thread, writes serialised by a lock."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer  # human-readable name for errors: "rank 3 (pid 123)", "node 1 (10.0.0.2:4000)"
        self.is_unix = sock.family == socket.AF_UNIX
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        sock.settimeout(_POLL_S)
        if not self.is_unix:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._hdr = bytearray(HEADER_SIZE)

    # -- sending -------------------------------------------------------------------------------

    def send(
        self,
        parts: Sequence[Buffer],
        fds: Sequence[int] = (),
        timeout: float | None = None,
        idle: float | None = None,
    ) -> None:
        """Send the parts of one frame back to back; fds ride on the first byte (unix sockets only).

        `timeout` bounds the whole call, `idle` the time the peer may read nothing at all.
        """
        wait = min(x for x in (timeout, idle, 1e9) if x is not None)
        if not self._send_lock.acquire(timeout=-1 if wait >= 1e9 else wait):
            raise ConnectionClosed(f"connection to {self.peer} stayed busy for {wait:g}s")
        self._send_held(parts, fds, _Clock(timeout, idle))

    def _send_held(self, parts: Sequence[Buffer], fds: Sequence[int], clock: _Clock) -> None:
        """The sending itself, with the send lock held; releases it."""
        views = [memoryview(cast(Any, p)).cast("B") for p in parts if len(p)]
        try:
            anc = []
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
            while views:
                if self._closed.is_set():
                    raise ConnectionClosed(f"connection to {self.peer} is closed")
                try:
                    sent = self.sock.sendmsg(views[:64], anc) if anc else self.sock.sendmsg(views[:64])
                except TimeoutError:
                    why = clock.expired()
                    if why:
                        raise ConnectionClosed(f"sending to {self.peer} {why} (it is not reading)") from None
                    continue
                except OSError as e:
                    raise ConnectionClosed(f"connection to {self.peer} broke: {e.strerror or e}") from None
                anc = []
                clock.progress()
                while sent:
                    n = len(views[0])
                    if sent >= n:
                        sent -= n
                        views.pop(0)
                    else:
                        views[0] = views[0][sent:]
                        sent = 0
        finally:
            self._send_lock.release()

    def send_frame(
        self,
        h: Header,
        payload: Buffer = b"",
        fds: Sequence[int] = (),
        timeout: float | None = None,
        idle: float | None = None,
    ) -> None:
        self.send([h.encode(), payload], fds, timeout, idle)

    # -- receiving -----------------------------------------------------------------------------

    def recv_header(
        self, stop: threading.Event | None = None, timeout: float | None = None, idle: float | None = None
    ) -> tuple[Header, list[int]]:
        """Read and validate one header, with any fds that came with it.

        `timeout` bounds the whole read (a handshake), `idle` the silence of an established peer.
        """
        fds: list[int] = []
        view = memoryview(self._hdr)
        got = 0
        clock = _Clock(timeout, idle)
        while got < HEADER_SIZE:
            try:
                if self.is_unix:
                    n, new_fds = self._recvmsg_into(view[got:])
                    fds.extend(new_fds)
                else:
                    n = self.sock.recv_into(view[got:])
            except TimeoutError:
                if stop is not None and stop.is_set():
                    _close_fds(fds)
                    raise ConnectionClosed(f"stopped while reading from {self.peer}") from None
                why = clock.expired()
                if why:
                    _close_fds(fds)
                    raise ConnectionClosed(f"{self.peer} {why}") from None
                continue
            except OSError as e:
                _close_fds(fds)
                raise ConnectionClosed(f"connection to {self.peer} broke: {e.strerror or e}") from None
            if n == 0:
                _close_fds(fds)
                raise ConnectionClosed(f"{self.peer} closed the connection")
            got += n
            clock.progress()
        try:
            return decode_header(self._hdr), fds
        except ProtocolError as e:
            _close_fds(fds)
            raise ProtocolError(f"from {self.peer}: {e}") from None

    def _recvmsg_into(self, view: memoryview) -> tuple[int, list[int]]:
        fds = array.array("i")
        n, anc, _flags, _addr = self.sock.recvmsg_into([view], socket.CMSG_SPACE(_MAX_FDS * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
        return n, list(fds)

    def recv_into(self, buf: Buffer, timeout: float | None = None, idle: float | None = None) -> None:
        """Fill `buf` completely from the socket (the payload lands in its final place)."""
        view = memoryview(cast(Any, buf)).cast("B")
        clock = _Clock(timeout, idle)
        got, total = 0, len(view)
        while got < total:
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                why = clock.expired()
                if why:
                    raise ConnectionClosed(f"{self.peer} {why} in the middle of a frame") from None
                if self._closed.is_set():
                    raise ConnectionClosed(f"connection to {self.peer} is closed") from None
                continue
            except OSError as e:
                raise ConnectionClosed(f"connection to {self.peer} broke: {e.strerror or e}") from None
            if n == 0:
                raise ConnectionClosed(f"{self.peer} closed the connection in the middle of a frame")
            got += n
            clock.progress()

    def recv_bytes(self, n: int, timeout: float | None = None) -> bytes:
        buf = bytearray(n)
        self.recv_into(buf, timeout)
        return bytes(buf)

    def recv_frame(
        self, timeout: float | None = None, max_length: int | None = None
    ) -> tuple[Header, bytes, list[int]]:
        """A whole small frame (handshake, control); data frames use recv_header + recv_into.

        `max_length` bounds what an unauthenticated peer can make us allocate.
        """
        h, fds = self.recv_header(timeout=timeout)
        if max_length is not None and h.length > max_length:
            _close_fds(fds)
            raise ProtocolError(
                f"{self.peer} sent {h.type.name} with {h.length} bytes where {max_length} fit"
            )
        return h, self.recv_bytes(h.length, timeout), fds

    def discard(self, n: int, timeout: float | None = None) -> None:
        while n > 0:
            step = min(n, 1 << 20)
            self.recv_bytes(step, timeout)
            n -= step

    # -- lifetime ------------------------------------------------------------------------------

    def hang_up(self) -> None:
        """Ends the connection both ways and keeps the socket: the peer sees it end, and a thread
        blocked on it wakes (end of stream), but its descriptor stays this object's until close().
        Closing it while another thread is still inside a receive on it races that call (the number
        may be reused meanwhile): hang up, let that thread leave, then close."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.hang_up()
        self.sock.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def peer_uid(self) -> int:
        """The uid of the process on the other end of a unix socket (SO_PEERCRED)."""
        return self._peercred()[1]

    def peer_pid(self) -> int:
        return self._peercred()[0]

    def _peercred(self) -> tuple[int, int, int]:
        creds = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", creds)
        return pid, uid, gid


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
