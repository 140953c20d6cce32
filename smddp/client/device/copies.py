"""A client's device copies: page-locked arena segments, a copy-in and a copy-out stream per device, ordering."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
    before: Any  # event on the caller's stream at the call: copies in and out wait for it (None: no wait)
    outputs: list[tuple[DeviceBuffer, int, int]]  # (destination, byte offset in the result, bytes)
    consumer: int | None  # the stream wait() orders the result before (None: decided at wait())
    library: str  # for the current stream at wait() when `consumer` is None
    keepalive: Any = None
    done: Any = field(default=None)  # the event recorded after the copy-out
    # A collective its caller waits for at once (Client.waiting), in one piece: both copies run on
    # the caller's stream itself, in line, as a bare copy round trip would (None: on the lanes,
    # ordered by `before`). The caller is blocked until the result is back, so nothing of its own
    # can run on that stream meanwhile; and on a GPU that several processes share, every wait of
    # one stream for another's event costs a turn of the GPU (issue 28: 4 KiB took 2.2-2.6x a bare
    # copy round trip on the lanes).
    inline: int | None = None
    # Its caller was told it failed (a blocking call that timed out): its result is never copied to
    # the device (Client._copy_out), only RELEASEd, so that nothing writes the caller's memory after.
    dropped: bool = False


class DeviceIO:
    """One client's device machinery. Threads: its own releaser; the client's submitter and reader call in.

    The host blocks only in these places: `host_wait` (the client's submitter thread, until a
    copy-in is complete; the releaser thread, until a copy-out is complete), pinning a segment the
    first time it is used, and copies to or from memory that could not be pinned.
    """

    def __init__(self, rt: DeviceRuntime, on_error: Callable[[SmddpError], None]) -> None:
        self.rt = rt
        self._on_error = on_error
        self._lock = threading.Lock()
        self._lanes: dict[int, Lane] = {}
        self._pinned: dict[tuple[str, int], int | None] = {}  # key -> registered address, None: not pinnable
        self._pinning: dict[tuple[str, int], threading.Event] = {}  # being registered: set once done
        self._after: queue.SimpleQueue[tuple[Any, Callable[[], None], Any] | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        # The event after every copy into or out of smddp's memory, oldest first (done ones dropped
        # from the front as new ones come): shutdown waits for them all, on the callers' streams too
        # (the in-line copies), before anything is unpinned or unmapped (copies_done).
        self._copies: collections.deque[Any] = collections.deque()
        self._releaser = threading.Thread(
            target=self._release_loop, name="smddp-device-releaser", daemon=True
        )
        self._releaser.start()

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
        which the releaser and every copy's bookkeeping take: a second caller for the same segment
        waits for the first's registration, nobody else waits at all."""
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
        """An event at the current end of `stream` (None: nothing to wait for)."""
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

    # -- work after a copy-out -------------------------------------------------------------------

    def after(self, event: Any, then: Callable[[], None], keepalive: Any) -> None:
        """Run `then` on the releaser thread once `event` is reached, holding `keepalive` until then."""
        with self._lock:
            self._pending += 1
        self._after.put((event, then, keepalive))

    def _release_loop(self) -> None:
        while True:
            item = self._after.get()
            if item is None:
                return
            event, then, _keepalive = item
            try:
                self.host_wait(event)
                then()
            except SmddpError as e:
                self._on_error(e)
            except Exception as e:  # a bug: fail the job rather than hang it
                log.exception("smddp device releaser crashed")
                self._on_error(DeviceError(f"internal error after a device copy: {e!r}"))
            finally:
                del item, event, then, _keepalive
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until every queued `after` has run; False if `timeout` ran out first."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued work, wait for the copy streams, unpin every segment (before anything unmaps it)."""
        self.drain(timeout)
        self._after.put(None)
        self._releaser.join(timeout=timeout)
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
