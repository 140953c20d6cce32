"""A client's device copies: page-locked arena segments, a copy-in and a copy-out stream per device, ordering."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from smddp.client.device.buffers import DeviceBuffer, library_stream
from smddp.client.device.runtime import DeviceRuntime
from smddp.errors import DeviceError, SmddpError

log = logging.getLogger("smddp.client")


@dataclass(frozen=True)
class Lane:
    """The two streams smddp copies on for one device: device-to-host, and host-to-device.

    Two, so that a copy-in waiting for the producer's kernels never holds up an earlier
    collective's result on its way back (and the GPU's two copy engines both work).
    """

    device: int
    d2h: int
    h2d: int


@dataclass
class DevicePlan:
    """How one collective uses device memory: what is copied in, where the result goes, which streams."""

    device: int
    src: DeviceBuffer | None  # copied into the input slot (None: this rank sends no data)
    # The engine's event on the caller's stream at the call (DeviceEngine.mark): copies in and out
    # wait for it (None: no wait).
    before: Any
    outputs: list[tuple[DeviceBuffer, int, int]]  # (destination, byte offset in the result, bytes)
    consumer: int | None  # the stream wait() orders the result before (None: decided at wait())
    library: str  # for the current stream at wait() when `consumer` is None
    keepalive: Any = None
    # A collective its caller waits for at once (Client.waiting), in one piece: both copies run on
    # the caller's stream itself, in line, as a bare copy round trip would (None: on the lanes,
    # ordered by `before`). The caller is blocked until the result is back, so nothing of its own
    # can run on that stream meanwhile; and on a GPU that several processes share, every wait of
    # one stream for another's event costs a turn of the GPU (issue 28: 4 KiB took 2.2-2.6x a bare
    # copy round trip on the lanes).
    inline: int | None = None


class DeviceIO:
    """One client's device machinery in Python: its streams (the lanes) and their ordering. No thread of
    its own: a collective's copies in and back and what follows them are the engine's (DeviceEngine),
    which also page-locks the input and result segments. `pin`, `copy_in` and `copy_out` are the same
    copies made from Python, for what measures them bare (smddp.bench.gpu, the unit tests of the
    runtimes), tracked for `copies_done` as the engine tracks its own.

    The host blocks only in these places: pinning a segment the first time it is used, copies to or
    from memory that could not be pinned, and `host_wait`.
    """

    def __init__(self, rt: DeviceRuntime) -> None:
        self.rt = rt
        self._lock = threading.Lock()
        self._lanes: dict[int, Lane] = {}
        self._pinned: dict[tuple[str, int], int | None] = {}  # key -> registered address, None: not pinnable
        self._pinning: dict[tuple[str, int], threading.Event] = {}  # being registered: set once done
        # The event after every copy into smddp's memory (and out of it, copy_out's), oldest first
        # (done ones dropped from the front as new ones come): shutdown waits for them all, on the
        # callers' streams too (the in-line copies), before anything is unpinned or unmapped
        # (copies_done).
        self._copies: collections.deque[Any] = collections.deque()

    # -- streams and pinned memory ---------------------------------------------------------------

    def lane(self, device: int) -> Lane:
        with self._lock:
            lane = self._lanes.get(device)
        if lane is not None:
            return lane
        if not 0 <= device < self.rt.device_count():
            raise DeviceError(f"device {device} does not exist ({self.rt.device_count()} devices)")
        new = Lane(device, self.rt.new_stream(device), self.rt.new_stream(device))
        with self._lock:
            return self._lanes.setdefault(device, new)

    def pin(self, key: tuple[str, int], array: np.ndarray, readonly: bool) -> None:
        """Page-lock `array` (a whole arena segment) once, so copies to and from it are asynchronous DMA.

        The registration (which touches every page of the segment) runs outside this object's lock,
        which every copy's bookkeeping takes: a second caller for the same segment waits for the
        first's registration, nobody else waits at all."""
        with self._lock:
            if key in self._pinned:
                return
            first = self._pinning.get(key)
            if first is None:
                mine = self._pinning[key] = threading.Event()
        if first is not None:
            first.wait()
            return
        ptr: int | None = None
        try:
            self.rt.register_host(int(array.ctypes.data), array.nbytes, readonly)
            ptr = int(array.ctypes.data)
        except SmddpError as e:
            # Still correct, only slower: copies from pageable memory are staged and block the caller.
            ptr = None
            log.warning("could not page-lock %s segment %d (%d bytes): %s", key[0], key[1], array.nbytes, e)
        finally:
            with self._lock:
                self._pinned[key] = ptr
                del self._pinning[key]
            mine.set()

    def unpin(self, key: tuple[str, int]) -> None:
        with self._lock:
            ptr = self._pinned.pop(key, None)
        if ptr is not None:
            self.rt.unregister_host(ptr)

    # -- copies ----------------------------------------------------------------------------------

    def producer_stream(self, buf: DeviceBuffer, explicit: int | None) -> int | None:
        """The stream the caller works on `buf` with: the one passed, the interface's, or the current one.

        (A DLPack export has also made the copy-in stream wait for its producer; this covers the
        copy-out too, which must not write a buffer before the work enqueued on it is done.)
        """
        if explicit is not None:
            return explicit
        if buf.stream_given:
            return buf.stream  # the producer said which (or that no synchronisation is needed)
        return library_stream(self.rt, buf.library, buf.device)

    def mark(self, stream: int | None, device: int) -> Any:
        """An event of the runtime's at the current end of `stream` (None: nothing to wait for), for
        the bare copies below; a collective's is the engine's (DeviceEngine.mark)."""
        if stream is None:
            return None
        ev = self.rt.new_event(device)
        self.rt.record(ev, stream, device)
        return ev

    def consumer_stream(self, plan: DevicePlan) -> int:
        if plan.consumer is not None:
            return plan.consumer
        return library_stream(self.rt, plan.library, plan.device)

    def copy_in(self, src: DeviceBuffer, dst: np.ndarray, before: Any, inline: int | None = None) -> Any:
        """Enqueue the device-to-host copy of `src` into `dst` after event `before`; returns its event.

        The copy-in stream waits for an event on the producer's stream: nothing else waits, and the
        producer's stream never waits for the copy. `inline`: the copy runs on that stream (the
        producer's, whose caller waits at once: DevicePlan.inline), after what is queued there.
        """
        stream = self._copy_stream(src.device, "d2h", before, inline)
        self.rt.copy_d2h(int(dst.ctypes.data), src.ptr, src.nbytes, stream, src.device)
        copied = self.rt.new_event(src.device)
        self.rt.record(copied, stream, src.device)
        self._track(copied)
        return copied

    def copy_out(
        self,
        device: int,
        parts: list[tuple[DeviceBuffer, np.ndarray]],
        before: Any,
        inline: int | None = None,
    ) -> Any:
        """Enqueue host-to-device copies of result bytes into device buffers; returns the event after them.

        They wait for `before` first: a broadcast's or gather's destination may still have work of
        the caller's queued on it (a buffer it was just filling, or zeroing). `inline`: they run on
        that stream (the caller's, DevicePlan.inline), after that work.
        """
        stream = self._copy_stream(device, "h2d", before, inline)
        for dst, src in parts:
            self.rt.copy_h2d(dst.ptr, int(src.ctypes.data), src.nbytes, stream, device)
        done = self.rt.new_event(device)
        self.rt.record(done, stream, device)
        self._track(done)
        return done

    def _track(self, event: Any) -> None:
        with self._lock:
            while self._copies and self.rt.event_done(self._copies[0]):
                self._copies.popleft()
            self._copies.append(event)

    def copies_done(self, timeout: float) -> bool:
        """Whether every copy into or out of smddp's memory has ended within `timeout` (polled: a copy
        in line on a caller's stream may wait behind that caller's kernels for as long as they run)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                while self._copies and self.rt.event_done(self._copies[0]):
                    self._copies.popleft()
                if not self._copies:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def _copy_stream(self, device: int, direction: str, before: Any, inline: int | None) -> int:
        """Where a copy runs: `inline` as it is, else the lane's `direction` stream, made to wait for
        `before` (the caller's stream at the call) first."""
        if inline is not None:
            return inline
        stream: int = getattr(self.lane(device), direction)
        if before is not None:
            self.rt.wait_event(stream, before, device)
        return stream

    def host_wait(self, event: Any) -> None:
        self.rt.event_synchronize(event)

    def stream_wait(self, stream: int, event: Any, device: int) -> None:
        self.rt.wait_event(stream, event, device)

    def close(self) -> None:
        """Wait for the copy streams, unpin every segment (before anything unmaps it)."""
        with self._lock:
            lanes = list(self._lanes.values())
            pinned = list(self._pinned.keys())
        for lane in lanes:
            for s in (lane.d2h, lane.h2d):
                try:
                    ev = self.rt.new_event(lane.device)
                    self.rt.record(ev, s, lane.device)
                    self.rt.event_synchronize(ev)
                except SmddpError as e:
                    log.warning("device %d: a copy stream failed at shutdown: %s", lane.device, e)
        for key in pinned:
            try:
                self.unpin(key)
            except SmddpError as e:
                log.warning("could not unpin %s segment %d: %s", key[0], key[1], e)
