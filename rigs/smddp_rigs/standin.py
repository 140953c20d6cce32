"""A stand-in CUDA runtime backed by numpy: in-order asynchronous streams (a thread each), events, pinned memory."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from smddp.client.device.dlpack import CAPSULE_NAME, DL_DTYPES, KDL_CUDA, DLDataType, DLDevice, DLTensor
from smddp.client.device.runtime import STREAM_LEGACY, STREAM_PER_THREAD
from smddp.errors import DeviceError
from smddp.proto.dtypes import DType, dtype_from_numpy

# Stand-in device addresses start far above any user-space host address, so that host code which
# dereferences one crashes instead of quietly reading host memory: the bug a real GPU would show.
_DEVICE_BASE = 0xD000_0000_0000_0000
_ALIGN = 256
_GUARD = 1 << 20  # address gap between allocations: an overrun lands on no allocation
_UNSET = 0xA5  # fresh allocations hold this byte, as cudaMalloc'd memory holds garbage
_DL_CODES = {dt: code for code, dt in DL_DTYPES.items()}
_NUMPY_DL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


class _Mark:
    """One record of an event: reached when the stream that holds it gets there. `captured`: recorded
    into a CUDA graph under capture, where no host may wait for it (it is reached when the graph runs)."""

    __slots__ = ("done", "error", "graph")

    def __init__(self, graph: list[Any] | None = None) -> None:
        self.done = threading.Event()
        self.error: str | None = None
        self.graph = graph  # the graph it was recorded into (None: recorded on a running stream)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def reach(self, error: str | None) -> None:
        self.error = error
        self.done.set()


class StandinEvent:
    """A stand-in cudaEvent_t: each record() replaces the point in a stream that waits refer to."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.mark: _Mark | None = None

    @property
    def done(self) -> bool:
        return self.mark is None or self.mark.done.is_set()


class _Stream:
    """A stream: a thread that runs enqueued operations one at a time, in order."""

    def __init__(self, handle: int, device: int, immediate: bool = False) -> None:
        self.handle = handle
        self.device = device
        self.error: str | None = None  # sticky, as CUDA errors are: later copies and kernels are skipped
        self._immediate = immediate
        self._q: queue.SimpleQueue[tuple[Callable[[], None], bool] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # none at all where every operation runs at once
        # Under capture (begin_capture): what is put is recorded into this graph instead of run, as
        # CUDA does on a capturing stream, until end_capture hands the graph back.
        self.graph: list[tuple[Callable[[], None], bool]] | None = None
        if not immediate:
            self._thread = threading.Thread(target=self._run, name=f"standin-stream-{handle:#x}", daemon=True)
            self._thread.start()

    def put(self, op: Callable[[], None], always: bool = False) -> None:
        """`always`: run even after an error (event records and waits, so that nothing hangs)."""
        if self.graph is not None:
            self.graph.append((op, always))
        elif self._immediate:
            self._step(op, always)
        else:
            self._q.put((op, always))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            self._step(*item)

    def _step(self, op: Callable[[], None], always: bool) -> None:
        if self.error is not None and not always:
            return
        try:
            op()
        except Exception as e:
            if self.error is None:
                self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=10.0)


#: What CUDA says of a host wait on work under capture (cudaErrorStreamCaptureUnsupported).
_CAPTURING = "stand-in device: operation not permitted when stream is capturing"


def _not_captured(mark: _Mark) -> None:
    """A host may not wait for, nor ask about, a record made under capture (CUDA refuses, and the
    capture is invalidated): the record is reached only when the graph runs."""
    if mark.captured and not mark.done.is_set():
        raise DeviceError(_CAPTURING)


def make_runtime() -> StandinRuntime:
    """The registry's factory (entry point smddp.device_runtimes:standin); SMDDP_STANDIN_DELAY_MS delays every copy,
    SMDDP_STANDIN_IMMEDIATE=1 runs every operation at once instead (for measuring, never for ordering tests)."""
    return StandinRuntime(
        copy_delay_s=float(os.environ.get("SMDDP_STANDIN_DELAY_MS", "0") or 0) / 1000.0,
        immediate=os.environ.get("SMDDP_STANDIN_IMMEDIATE", "") == "1",
    )


class StandinRuntime:
    """The test double of `CupyRuntime`: device memory is numpy memory reachable only through the runtime.

    Streams really are asynchronous: each is a thread that runs copies, kernels (`launch`), event
    records and event waits in order, so a missing wait gives stale data, as on a GPU;
    `copy_delay_s` makes every copy wait first, so that such a race is lost every time. Copies to
    or from host memory that is not registered (`register_host`) block the caller until they are
    done, as CUDA's copies from pageable memory do, and are counted in `stats`.
    """

    name = "standin"
    library = "smddp_rigs"  # StandinArray plays CuPy's arrays: their current stream is current_stream()

    def __init__(self, devices: int = 1, copy_delay_s: float = 0.0, immediate: bool = False) -> None:
        self.devices = devices
        self._joined: dict[int, list[_Stream]] = {}  # the streams each capture drew in (by its graph)
        self.copy_delay_s = copy_delay_s
        # Every operation runs in the enqueuing thread at once (one order of the streams' work that a
        # GPU may take, with no thread hand-off): what is left of a device call's time is smddp's and
        # torch's own, which is what `immediate` is for. It orders everything, so an ordering bug
        # never shows: never for the ordering tests.
        self.immediate = immediate
        self.stats = {"d2h": 0, "h2d": 0, "pinned": 0, "pageable": 0, "kernels": 0}
        self._lock = threading.Lock()
        self._closed = False
        self._streams: dict[int, _Stream] = {}
        self._defaults: dict[int, _Stream] = {}
        self._handles = itertools.count(0x5000, 0x10)
        self._bases: list[int] = []
        self._allocs: dict[int, tuple[np.ndarray, int]] = {}  # base address -> (bytes, device)
        self._next_addr = _DEVICE_BASE
        self._pinned: dict[int, tuple[int, bool]] = {}  # host address -> (bytes, read-only)
        self._tls = threading.local()

    # -- devices and streams ---------------------------------------------------------------------

    def device_count(self) -> int:
        return self.devices

    def describe(self, device: int) -> str:
        return f"stand-in device {device} (numpy memory, stream threads; no GPU)"

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self.devices:
            raise DeviceError(f"stand-in device: no device {device} (it has {self.devices})")

    def _stream(self, handle: int, device: int) -> _Stream:
        with self._lock:
            if self._closed:
                raise DeviceError("stand-in device: the runtime is closed")
            if handle in (0, STREAM_LEGACY, STREAM_PER_THREAD):
                self._check_device(device)
                s = self._defaults.get(device)
                if s is None:
                    s = self._defaults[device] = _Stream(STREAM_LEGACY, device, self.immediate)
                return s
            s = self._streams.get(handle)
        if s is None:
            raise DeviceError(f"stand-in device: {handle:#x} is not a stream of this runtime")
        if s.device != device:
            raise DeviceError(f"stand-in device: stream {handle:#x} is on device {s.device}, not {device}")
        return s

    def new_stream(self, device: int = 0) -> int:
        self._check_device(device)
        handle = next(self._handles)
        with self._lock:
            if self._closed:
                raise DeviceError("stand-in device: the runtime is closed")
            self._streams[handle] = _Stream(handle, device, self.immediate)
        return handle

    def current_stream(self, device: int = 0) -> int:
        stack = getattr(self._tls, "stack", None)
        return stack[-1] if stack else STREAM_LEGACY

    @contextlib.contextmanager
    def use(self, stream: int) -> Iterator[int]:
        """Make `stream` the calling thread's current stream inside the block (as `with cupy_stream:`)."""
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    # -- events ----------------------------------------------------------------------------------

    def new_event(self, device: int = 0) -> StandinEvent:
        self._check_device(device)
        return StandinEvent(device)

    def record(self, event: StandinEvent, stream: int, device: int = 0) -> None:
        s = self._stream(stream, device)
        if event.device != s.device:
            raise DeviceError(
                f"stand-in device: an event of device {event.device} recorded on device {s.device}"
            )
        mark = _Mark(s.graph)
        event.mark = mark
        s.put(lambda: mark.reach(s.error), always=True)

    def wait_event(self, stream: int, event: StandinEvent, device: int = 0) -> None:
        s = self._stream(stream, device)
        mark = event.mark
        if mark is None:
            return  # never recorded: nothing to wait for, as with cudaStreamWaitEvent
        if mark.graph is not None and not mark.done.is_set() and s.graph is None:
            # Waiting for a record made under capture draws this stream into the capture, as CUDA
            # does: what it is given from now on is recorded into that graph too, not run.
            s.graph = mark.graph
            with self._lock:
                self._joined.setdefault(id(mark.graph), []).append(s)
            return

        def wait() -> None:
            mark.done.wait()
            if mark.error is not None and s.error is None:
                s.error = mark.error

        s.put(wait, always=True)

    def event_synchronize(self, event: StandinEvent) -> None:
        mark = event.mark
        if mark is None:
            return
        _not_captured(mark)
        mark.done.wait()
        if mark.error is not None:
            raise DeviceError(f"stand-in device: {mark.error}")

    def event_done(self, event: StandinEvent) -> bool:
        if event.mark is not None:
            _not_captured(event.mark)
        return event.done

    # -- CUDA graphs: stream capture -------------------------------------------------------------

    def begin_capture(self, stream: int, device: int = 0) -> None:
        """cudaStreamBeginCapture: from now on what is enqueued on `stream` is recorded, not run."""
        s = self._stream(stream, device)
        if stream in (0, 1):
            raise DeviceError("stand-in device: the legacy default stream cannot be captured (as with CUDA)")
        if s.graph is not None:
            raise DeviceError(f"stand-in device: stream {stream:#x} is capturing already")
        s.graph = []

    def end_capture(self, stream: int, device: int = 0) -> list[tuple[Callable[[], None], bool]]:
        """cudaStreamEndCapture: the graph of what was enqueued meanwhile (launch_graph runs it). Streams
        the capture drew in (wait_event) leave it too; as CUDA says (cudaErrorStreamCaptureUnjoined),
        that is an error: their work was recorded into the graph instead of running."""
        s = self._stream(stream, device)
        graph, s.graph = s.graph, None
        if graph is None:
            raise DeviceError(f"stand-in device: stream {stream:#x} is not capturing")
        with self._lock:
            joined = self._joined.pop(id(graph), [])
        for j in joined:
            j.graph = None
        if joined:
            names = ", ".join(f"{j.handle:#x}" for j in joined)
            raise DeviceError(
                f"stand-in device: the capture on {stream:#x} drew in stream(s) {names} (unjoined)"
            )
        return graph

    def launch_graph(
        self, graph: list[tuple[Callable[[], None], bool]], stream: int, device: int = 0
    ) -> None:
        s = self._stream(stream, device)
        for op, always in graph:
            s.put(op, always)

    def is_capturing(self, stream: int, device: int = 0) -> bool:
        return self._stream(stream, device).graph is not None

    def stream_synchronize(self, stream: int, device: int = 0) -> None:
        ev = self.new_event(device)
        self.record(ev, stream, device)
        self.event_synchronize(ev)

    def synchronize(self) -> None:
        """Every stream reaches what was enqueued so far (cudaDeviceSynchronize)."""
        with self._lock:
            streams = [*self._defaults.values(), *self._streams.values()]
        for s in streams:
            self.stream_synchronize(s.handle, s.device)

    # -- memory ----------------------------------------------------------------------------------

    def _alloc(self, host: np.ndarray, device: int) -> int:
        with self._lock:
            base = self._next_addr
            self._next_addr += _round_up(max(host.nbytes, 1), _ALIGN) + _GUARD
            self._allocs[base] = (host, device)
            bisect.insort(self._bases, base)
        return base

    def _free(self, base: int) -> None:
        with self._lock:
            if self._allocs.pop(base, None) is not None:
                self._bases.remove(base)

    def _resolve(self, ptr: int, nbytes: int) -> tuple[np.ndarray, int]:
        """The host bytes standing for device range [ptr, ptr+nbytes), and their device."""
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i >= 0:
                base = self._bases[i]
                mem, device = self._allocs[base]
                off = ptr - base
                if off + nbytes <= mem.nbytes:
                    return mem[off : off + nbytes], device
        raise DeviceError(
            f"stand-in device: [{ptr:#x}, +{nbytes}) is not stand-in device memory "
            "(a host pointer, a real CUDA pointer, or freed memory)"
        )

    def pointer_device(self, ptr: int) -> int:
        if ptr == 0:
            return 0
        return self._resolve(ptr, 0)[1]

    def empty(self, shape: tuple[int, ...], dtype: Any, device: int = 0) -> StandinArray:
        """Uninitialised device memory (it holds 0xA5 bytes, not zeros)."""
        self._check_device(device)
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        host = np.full(max(count * dt.itemsize, 1), _UNSET, np.uint8)
        arr = StandinArray(self, self._alloc(host, device), tuple(shape), dt, device)
        weakref.finalize(arr, self._free, arr.ptr)
        return arr

    def asarray(self, host: np.ndarray, device: int = 0) -> StandinArray:
        """A device copy of `host`, uploaded on the current stream (the call returns when it is there)."""
        host = np.ascontiguousarray(host)
        arr = self.empty(host.shape, host.dtype, device)
        arr.set(host)
        return arr

    def alias(self, host: np.ndarray, wire: DType | None = None, device: int = 0) -> StandinArray:
        """Device memory that *is* `host`'s memory: lets host-side code (torch on CPU) stand in for kernels.

        `wire` names the element type when numpy cannot (bfloat16 held as uint16).
        """
        if not host.flags.c_contiguous:
            raise DeviceError("stand-in device: alias() needs a C-contiguous array")
        self._check_device(device)
        raw = host.reshape(-1).view(np.uint8)
        arr = StandinArray(self, self._alloc(raw, device), tuple(host.shape), host.dtype, device, wire=wire)
        weakref.finalize(arr, self._free, arr.ptr)
        return arr

    def new_array(self, shape: tuple[int, ...], dtype: Any, device: int) -> tuple[StandinArray, int]:
        """`DeviceRuntime.empty`: a new array and its device address."""
        arr = self.empty(shape, dtype, device)
        return arr, arr.ptr

    def refuse(self, buf: Any) -> str | None:
        owner = getattr(buf, "__smddp_standin__", None)
        if owner is self:
            return None
        if owner is not None:
            return "it belongs to another stand-in runtime than this client's (use smddp.client().device_runtime())"
        return (
            f"{type(buf).__name__} is not stand-in memory, and SMDDP_DEVICE_RUNTIME=standin takes only arrays "
            "from smddp.client().device_runtime()"
        )

    # -- host memory -----------------------------------------------------------------------------

    def register_host(self, ptr: int, nbytes: int, readonly: bool = False) -> None:
        with self._lock:
            for p, (n, _ro) in self._pinned.items():
                if ptr < p + n and p < ptr + nbytes:
                    raise DeviceError(
                        f"stand-in device: host range [{ptr:#x}, +{nbytes}) is already registered "
                        "(cudaErrorHostMemoryAlreadyRegistered)"
                    )
            self._pinned[ptr] = (nbytes, readonly)

    def unregister_host(self, ptr: int) -> None:
        with self._lock:
            if self._pinned.pop(ptr, None) is None:
                raise DeviceError(
                    f"stand-in device: host address {ptr:#x} is not registered (cudaErrorHostMemoryNotRegistered)"
                )

    def registered(self) -> dict[int, tuple[int, bool]]:
        """Host address -> (bytes, read-only) of every registered range (for tests)."""
        with self._lock:
            return dict(self._pinned)

    def _pinned_range(self, ptr: int, nbytes: int, device_writes: bool) -> bool:
        with self._lock:
            for p, (n, readonly) in self._pinned.items():
                if p <= ptr and ptr + nbytes <= p + n:
                    if readonly and device_writes:
                        raise DeviceError(
                            f"stand-in device: a device-to-host copy into read-only registered memory at {ptr:#x}"
                        )
                    return True
        return False

    # -- copies and kernels ----------------------------------------------------------------------

    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: int, device: int = 0) -> None:
        s = self._stream(stream, device)
        if nbytes == 0:
            return
        mem = self._device_range(src, nbytes, s)
        pinned = self._pinned_range(dst, nbytes, device_writes=True)
        self._count("d2h", pinned)

        def copy() -> None:
            if self.copy_delay_s:
                time.sleep(self.copy_delay_s)
            ctypes.memmove(dst, mem.ctypes.data, nbytes)

        self._enqueue(s, copy, wait=not pinned)

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: int, device: int = 0) -> None:
        s = self._stream(stream, device)
        if nbytes == 0:
            return
        mem = self._device_range(dst, nbytes, s)
        pinned = self._pinned_range(src, nbytes, device_writes=False)
        self._count("h2d", pinned)

        def copy() -> None:
            if self.copy_delay_s:
                time.sleep(self.copy_delay_s)
            ctypes.memmove(mem.ctypes.data, src, nbytes)

        self._enqueue(s, copy, wait=not pinned)

    def _device_range(self, ptr: int, nbytes: int, s: _Stream) -> np.ndarray:
        mem, device = self._resolve(ptr, nbytes)
        if device != s.device:
            raise DeviceError(
                f"stand-in device: memory of device {device} copied on a stream of device {s.device}"
            )
        return mem

    def _count(self, kind: str, pinned: bool) -> None:
        with self._lock:
            self.stats[kind] += 1
            self.stats["pinned" if pinned else "pageable"] += 1

    def _enqueue(self, s: _Stream, op: Callable[[], None], wait: bool) -> None:
        """Enqueue `op`; with `wait`, return only once it ran (a copy from or to pageable memory)."""
        if wait and s.graph is not None:
            raise DeviceError(_CAPTURING)  # a copy the host waits for cannot be captured
        s.put(op)
        if wait:
            mark = _Mark()
            s.put(lambda: mark.reach(s.error), always=True)
            mark.done.wait()
            if mark.error is not None:
                raise DeviceError(f"stand-in device: {mark.error}")

    def launch(self, stream: int, fn: Callable[..., None], *arrays: StandinArray, device: int = 0) -> None:
        """Run `fn(*host views of arrays)` on `stream`, in order: the stand-in's kernel launch."""
        s = self._stream(stream, device)
        for a in arrays:
            if a.device_id != s.device:
                raise DeviceError(
                    f"stand-in device: a kernel on device {s.device} given memory of {a.device_id}"
                )
        with self._lock:
            self.stats["kernels"] += 1
        s.put(lambda: fn(*[a._host_view() for a in arrays]))

    def sleep(self, stream: int, seconds: float, device: int = 0) -> None:
        """A kernel that keeps `stream` busy for `seconds` (a long compute kernel)."""
        self.launch(stream, lambda: time.sleep(seconds), device=device)

    def hold(self, stream: int, device: int = 0, limit_s: float = 20.0) -> threading.Event:
        """A kernel that keeps `stream` busy until the returned gate is set: what a test orders work
        against (this ran while that was held) without betting on how long a loaded host takes to get
        anywhere. A gate never set fails the stream after `limit_s` (sticky), instead of hanging it."""
        gate = threading.Event()

        def held() -> None:
            if not gate.wait(limit_s):
                raise DeviceError(f"stand-in: stream {stream:#x} held for {limit_s:g}s and never let go")

        self.launch(stream, held, device=device)
        return gate

    def torch_streams(self) -> Any:
        """The smddp torch backend's streams for CPU tensors under this runtime (it claims them all)."""
        from smddp_rigs.standin_torch import StandinStreams

        return StandinStreams(self)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = [*self._defaults.values(), *self._streams.values()]
        for s in streams:
            s.stop()


class StandinArray:
    """Device memory of a StandinRuntime. Host code reaches its bytes only through the runtime.

    Exposes the CUDA Array Interface (v3, with the producer's `stream`) and DLPack (device type
    kDLCUDA, with the consumer-stream handshake), so smddp reads it down the same paths as CuPy
    arrays and torch CUDA tensors.
    """

    def __init__(
        self,
        rt: StandinRuntime,
        ptr: int,
        shape: tuple[int, ...],
        dtype: np.dtype,
        device: int,
        strides: tuple[int, ...] | None = None,
        owner: StandinArray | None = None,
        wire: DType | None = None,
    ) -> None:
        self.runtime = rt
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.device_id = device
        self.strides = strides  # in elements; None: C-contiguous
        self.wire = wire if wire is not None else dtype_from_numpy(dtype)
        self._owner = owner  # a view keeps the allocation's owner alive

    __smddp_device_runtime__ = "standin"

    @property
    def __smddp_standin__(self) -> StandinRuntime:
        return self.runtime

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"StandinArray(shape={self.shape}, dtype={self.dtype}, device={self.device_id}, ptr={self.ptr:#x})"

    def every(self, step: int) -> StandinArray:
        """A non-contiguous view of every `step`-th element of a 1-D array."""
        n = (self.shape[0] + step - 1) // step
        return StandinArray(
            self.runtime, self.ptr, (n,), self.dtype, self.device_id, (step,), self._owner or self, self.wire
        )

    def reshape(self, *shape: int) -> StandinArray:
        new = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else tuple(shape)
        if int(np.prod(new, dtype=np.int64)) != self.size or self.strides is not None:
            raise ValueError(f"cannot reshape {self.shape} to {new}")
        return StandinArray(
            self.runtime, self.ptr, new, self.dtype, self.device_id, None, self._owner or self, self.wire
        )

    def _span(self) -> int:
        if self.size == 0:
            return 0
        if self.strides is None:
            return self.nbytes
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return (last + 1) * self.dtype.itemsize

    def _host_view(self) -> np.ndarray:
        """The numpy view of these device bytes: for the runtime's own threads (kernels, get, set) only."""
        mem, _ = self.runtime._resolve(self.ptr, self._span())
        flat = mem.view(self.dtype)
        if self.strides is None:
            return flat.reshape(self.shape)
        byte_strides = tuple(s * self.dtype.itemsize for s in self.strides)
        return np.lib.stride_tricks.as_strided(flat, self.shape, byte_strides)

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        """A host copy, taken on the current stream (the call returns once it is taken), into `out` if
        given, as cupy's get()."""
        if out is None:
            out = np.empty(self.shape, self.dtype)
        elif out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError(f"get(out=): {out.dtype}{out.shape} for an array of {self.dtype}{self.shape}")
        rt = self.runtime
        s = rt._stream(rt.current_stream(self.device_id), self.device_id)
        rt._enqueue(s, lambda: np.copyto(out, self._host_view()), wait=True)
        return out

    def set(self, host: np.ndarray) -> None:
        """Upload `host` on the current stream; returns once it is there."""
        src = np.array(host, dtype=self.dtype, copy=True).reshape(self.shape)
        rt = self.runtime
        s = rt._stream(rt.current_stream(self.device_id), self.device_id)

        def upload() -> None:
            self._host_view()[...] = src

        rt._enqueue(s, upload, wait=True)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.dtype.kind == "V":
            # As torch's: the interface's typestr has no bfloat16; DLPack has.
            raise TypeError(f"dtype {self.dtype} has no __cuda_array_interface__ typestr; use DLPack")
        stream = self.runtime.current_stream(self.device_id)
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr if self.size else 0, False),
            "strides": None if self.strides is None else tuple(s * self.dtype.itemsize for s in self.strides),
            "version": 3,
            "stream": stream,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.device_id)

    def __dlpack__(self, *, stream: int | None = None, **_ignored: Any) -> Any:
        """A legacy DLPack capsule; `stream` (the consumer's) is made to wait for the current stream's work."""
        rt = self.runtime
        consumer = STREAM_LEGACY if stream is None else int(stream)
        producer = rt.current_stream(self.device_id)
        if consumer != -1 and consumer != producer:
            ev = rt.new_event(self.device_id)
            rt.record(ev, producer, self.device_id)
            rt.wait_event(consumer, ev, self.device_id)
        return _capsule(self)


class CaiOnly:
    """Wraps a stand-in array behind the CUDA Array Interface alone (as numba's device arrays are)."""

    def __init__(self, arr: StandinArray, stream: Any = "current", version: int = 3) -> None:
        self._arr = arr
        self._stream = stream
        self._version = version

    __smddp_device_runtime__ = "standin"

    @property
    def __smddp_standin__(self) -> StandinRuntime:
        return self._arr.runtime

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        cai = dict(self._arr.__cuda_array_interface__)
        cai["version"] = self._version
        if self._version < 3:
            del cai["stream"]
        elif self._stream != "current":
            cai["stream"] = self._stream
        return cai


# -- a DLPack capsule built with ctypes ------------------------------------------------------------


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.CFUNCTYPE(None, ctypes.c_void_p)),
    ]


_DESTRUCTOR_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _DESTRUCTOR_T)(
    ("PyCapsule_New", ctypes.pythonapi)
)
_capsule_set_context = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p)(
    ("PyCapsule_SetContext", ctypes.pythonapi)
)
_capsule_get_context = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
    ("PyCapsule_GetContext", ctypes.pythonapi)
)
_incref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))
_decref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_DecRef", ctypes.pythonapi))
_DLTENSOR_NAME = CAPSULE_NAME  # lives as long as the module: the capsule keeps a pointer to it


def _release_capsule(capsule: int) -> None:
    """Capsule destructor: drop the reference that kept the DLPack structs (and the array) alive."""
    ctx = _capsule_get_context(capsule)
    if ctx:
        keep = ctypes.cast(ctx, ctypes.py_object).value
        _decref(keep)


_RELEASE = _DESTRUCTOR_T(_release_capsule)


def _capsule(arr: StandinArray) -> Any:
    ndim = len(arr.shape)
    shape = (ctypes.c_int64 * max(ndim, 1))(*arr.shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*arr.strides) if arr.strides is not None else None
    mt = _DLManagedTensor()
    t = mt.dl_tensor
    t.data = arr.ptr if arr.size else 0
    t.device = DLDevice(KDL_CUDA, arr.device_id)
    t.ndim = ndim
    if arr.wire is not None:
        code, bits = _DL_CODES[arr.wire]
    else:
        code, bits = _NUMPY_DL_CODES.get(arr.dtype.kind, 7), arr.dtype.itemsize * 8
    t.dtype = DLDataType(code, bits, 1)
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)) if strides is not None else None
    t.byte_offset = 0
    keep = (mt, shape, strides, arr)
    capsule = _capsule_new(ctypes.addressof(mt), _DLTENSOR_NAME, _RELEASE)
    _incref(keep)  # released by the capsule's destructor
    _capsule_set_context(capsule, id(keep))
    return capsule


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k
