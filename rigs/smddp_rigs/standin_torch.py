"""The stand-in runtime's torch side: CPU tensors as its device memory, and doubles of torch.cuda's streams and futures."""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from smddp.client.device.buffers import described
from smddp.errors import DeviceError
from smddp.proto.dtypes import DType

if TYPE_CHECKING:
    from smddp_rigs.standin import StandinEvent, StandinRuntime

# torch keeps a pool of streams per device for future callbacks (getStreamFromGlobalPool, 32 of
# them); a few are enough to give each callback a stream that has not waited for anything.
_POOL = 4


class StandinStreams:
    """`smddp.torch.backend.DeviceStreams` over the stand-in runtime (SMDDP_DEVICE_RUNTIME=standin).

    Every CPU tensor of a collective reaches smddp as stand-in device memory (an alias of its
    bytes), so the torch backend runs its device route, completion included, exactly as for CUDA;
    only these calls are doubled. One rule follows from torch running CPU operations on the host at
    once: whatever would wait on a stream in CUDA (the caller's stream in `wait`, a future's
    readers) is work the host is about to do, so the host waits. Never earlier: a stream or an
    event that CUDA would not order before the reader leaves the reader racing delayed copies here
    too (SMDDP_STANDIN_DELAY_MS makes it lose).
    """

    def __init__(self, rt: StandinRuntime) -> None:
        self.rt = rt
        self._pool: list[int] = []
        self._turn = itertools.count()
        self._lock = threading.Lock()
        # Futures whose completion waits for their events, completed in order by one thread (_mark_loop).
        self._marks: queue.SimpleQueue[tuple[StandinFuture, Any]] = queue.SimpleQueue()
        self._marker: threading.Thread | None = None

    def buf(self, t: torch.Tensor) -> Any:
        """`t`'s bytes as stand-in device memory, described as CudaStreams describes a CUDA tensor."""
        if t.dtype == torch.bfloat16:
            arr = self.rt.alias(t.view(torch.int16).numpy().view(np.uint16), wire=DType.BFLOAT16)
        else:
            arr = self.rt.alias(t.numpy())
        assert arr.wire is not None  # (alias() names it, from numpy's dtype where not given)
        return described(arr.ptr, arr.wire, tuple(t.shape), 0, "smddp_rigs", arr)

    def current(self) -> int:
        return self.rt.current_stream(0)

    def handle(self, stream: Any) -> int:
        return int(stream)

    def current_handle(self) -> int:
        return self.rt.current_stream(0)

    def new_stream(self) -> int:
        return self.rt.new_stream(0)

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.rt.use(int(stream))

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        self.rt.launch(int(stream), fn)  # runs on the stream's thread, after what is queued there

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """Nothing: no caching allocator here (the Work's references keep its tensors alive)."""

    def new_event(self) -> StandinEvent:
        return self.rt.new_event(0)

    def record(self, event: Any, stream: Any) -> None:
        self.rt.record(event, int(stream), 0)

    def wait(self, stream: Any, event: Any) -> None:
        """`stream` waits for `event`; the caller's next torch operations run on the host, so it waits too."""
        self.rt.wait_event(int(stream), event, 0)
        self.rt.event_synchronize(event)

    def follow(self, event: Any) -> None:
        """The current stream waits for `event` already; the caller's next torch operations run on the
        host, so the host waits for it (only for it: an event that the stream's waits do not order
        after the copies leaves the host racing them, as CUDA would leave the caller's kernels)."""
        self.rt.event_synchronize(event)

    def follow_copy(self, record: Any) -> None:
        """follow() for smddp's device record whose copy back ran in line on the current stream: the
        host waits for that copy (its synchronize), and only for it."""
        record.synchronize()

    def query(self, event: Any) -> bool:
        return self.rt.event_done(event)

    def future(self) -> StandinFuture:
        return StandinFuture(self)

    def complete_later(self, fut: StandinFuture, value: Any) -> None:
        """Complete `fut` with `value` once its events are reached, on this route's marker thread:
        readers (DDP's reducer in C++ too) see it complete only after the device got there, and the
        thread that set the result goes on at once, as markCompleted does on a GPU."""
        with self._lock:
            if self._marker is None:
                self._marker = threading.Thread(
                    target=self._mark_loop, name="standin-future-marker", daemon=True
                )
                self._marker.start()
        self._marks.put((fut, value))

    def _mark_loop(self) -> None:
        while True:
            fut, value = self._marks.get()
            fut._complete(value)

    def pool_stream(self) -> int:
        """A stream of the callback pool (made on first use), as torch's future callbacks get."""
        with self._lock:
            if len(self._pool) < _POOL:
                self._pool.append(self.rt.new_stream(0))
                return self._pool[-1]
            return self._pool[next(self._turn) % _POOL]


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    return False


class StandinFuture(torch.futures.Future):
    """torch's device-aware Future (`Future(devices=[...])`) as its readers meet it, on the stand-in.

    torch's rules (ivalue::Future::markCompleted, invokeCallback): completing records an event on
    the completing thread's current stream of each device the value's tensors are on, and nothing
    for a value without tensors; `wait()`, `value()` and callbacks order the reader's stream after
    those events; a `then` callback runs with a stream from the pool current, which waited for them,
    and its child future records on that stream. Readers here are host code (DDP's reducer in C++,
    `wait()` then a CPU operation), so the events are waited for on the host before the real future
    is completed: a reader is ordered after exactly what CUDA would order it after, no more. That
    wait is another thread's (StandinStreams.complete_later), never the one that sets the result:
    on a GPU, markCompleted does not block, so a thread that completes a future and then reads the
    tensors itself reads them unordered unless something else orders it (a Work's wait()).
    """

    def __init__(self, streams: StandinStreams) -> None:
        super().__init__()
        self._streams = streams
        self._events: list[StandinEvent] = []
        self._device_error: DeviceError | None = None

    def _mark(self, value: Any) -> list[StandinEvent]:
        """markCompleted's events: one on the calling thread's current stream if `value` holds tensors."""
        if not _holds_tensors(value):
            return []
        s = self._streams
        ev = s.new_event()
        s.record(ev, s.current())
        return [ev]

    def _reach(self, events: list[StandinEvent]) -> None:
        for ev in events:
            self._streams.rt.event_synchronize(ev)

    def set_result(self, result: Any) -> None:
        self._events = self._mark(result)
        self._streams.complete_later(self, result)

    def _complete(self, result: Any) -> None:
        """On the marker thread: the host is the reader, so it waits where a stream would, then completes."""
        try:
            self._reach(self._events)
        except DeviceError as e:  # a copy or kernel failed: the chained futures raise it
            self._device_error = e
        super().set_result(result)

    def then(self, callback: Callable[[Any], Any]) -> Any:
        streams = self._streams

        def run(fut: Any) -> Any:
            pool = streams.pool_stream()
            with streams.on(pool):
                for ev in self._events:
                    streams.rt.wait_event(pool, ev, 0)  # synchronizeWithCurrentStreams
                if self._device_error is not None:
                    raise self._device_error
                value = callback(fut)
                self._reach(self._mark(value))  # the child's markCompleted, on the pool stream
            return value

        return super().then(run)
