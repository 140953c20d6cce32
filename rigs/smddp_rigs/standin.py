"""A stand-in CUDA runtime over the stand-in CUDA driver: numpy memory, the driver's in-order streams, events, pinned memory."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import importlib.util
import itertools
import os
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


#: What CUDA says of a host wait on work under capture (cudaErrorStreamCaptureUnsupported).
_CAPTURING = "stand-in device: operation not permitted when stream is capturing"

# The stand-in driver's codes this module tells apart (smddp/engine/cuda_abi.h).
_SUCCESS = 0
_NOT_READY = 600
_CAPTURE_UNSUPPORTED = 900
_KERNEL_FAULT = 999  # CUDA_ERROR_UNKNOWN: what a Python kernel that raised fails its stream with

_LIBRARY: ctypes.CDLL | None = None
_LIBRARY_LOCK = threading.Lock()


def driver_path() -> str:
    """The stand-in CUDA driver (rigs/smddp_rigs/standin_cuda.cc, built with the rigs as
    smddp_rigs._standin_cuda): the library this runtime drives, and the one the engine loads in
    place of libcuda.so.1, so that both reach the same streams, events and memory. SMDDP_STANDIN_CUDA
    names another build of it (the sanitized jobs' own)."""
    given = os.environ.get("SMDDP_STANDIN_CUDA")
    if given:
        return given
    spec = importlib.util.find_spec("smddp_rigs._standin_cuda")
    if spec is None or spec.origin is None:
        raise DeviceError(
            "the stand-in CUDA driver smddp_rigs._standin_cuda is not built (pip install -e rigs/)"
        )
    return spec.origin


def _lib() -> ctypes.CDLL:
    """The stand-in driver, loaded and initialised once per process (as a process has one driver)."""
    global _LIBRARY
    with _LIBRARY_LOCK:
        if _LIBRARY is None:
            lib = ctypes.CDLL(driver_path())
            c = ctypes
            vp, u64, i64, sz = c.c_void_p, c.c_uint64, c.c_int64, c.c_size_t
            sigs: dict[str, tuple[list[Any], Any]] = {
                "cuInit": ([c.c_uint], c.c_int),
                "cuDevicePrimaryCtxRetain": ([c.POINTER(vp), c.c_int], c.c_int),
                "cuCtxSetCurrent": ([vp], c.c_int),
                "cuStreamCreate": ([c.POINTER(vp), c.c_uint], c.c_int),
                "cuStreamBeginCapture_v2": ([vp, c.c_int], c.c_int),
                "cuStreamEndCapture": ([vp, c.POINTER(vp)], c.c_int),
                "cuEventCreate": ([c.POINTER(vp), c.c_uint], c.c_int),
                "cuEventDestroy_v2": ([vp], c.c_int),
                "cuEventRecord": ([vp, vp], c.c_int),
                "cuEventQuery": ([vp], c.c_int),
                "cuEventSynchronize": ([vp], c.c_int),
                "cuStreamWaitEvent": ([vp, vp, c.c_uint], c.c_int),
                "cuMemcpyDtoHAsync_v2": ([vp, u64, sz, vp], c.c_int),
                "cuMemcpyHtoDAsync_v2": ([u64, vp, sz, vp], c.c_int),
                "cuMemHostRegister_v2": ([vp, sz, c.c_uint], c.c_int),
                "cuMemHostUnregister": ([vp], c.c_int),
                "cuLaunchHostFunc": ([vp, _HOST_FN, vp], c.c_int),
                "smddp_standin_set_devices": ([c.c_int], c.c_int),
                "smddp_standin_stream_config": ([vp, i64, c.c_int], c.c_int),
                "smddp_standin_set_copy_delay_us": ([i64], None),
                "smddp_standin_stream_release": ([vp], c.c_int),
                "smddp_standin_map": ([u64, vp, sz, c.c_int], c.c_int),
                "smddp_standin_unmap": ([u64], c.c_int),
                "smddp_standin_fail_running": ([c.c_int, c.c_char_p], c.c_int),
                "smddp_standin_event_failure": ([vp, c.c_char_p, sz], c.c_int),
                "smddp_standin_copy_counts": ([c.POINTER(u64)], None),
                "smddp_standin_trace": ([c.c_int], None),
                "smddp_standin_register_mode": ([c.c_int], c.c_int),
                "smddp_standin_registered": (
                    [c.POINTER(c.c_size_t), c.POINTER(c.c_size_t), c.POINTER(c.c_int), sz],
                    sz,
                ),
                "smddp_standin_trace_take": ([c.POINTER(c.c_int), c.POINTER(c.c_size_t), sz], sz),
                "smddp_standin_push_current": ([vp], None),
                "smddp_standin_pop_current": ([], None),
                "smddp_standin_current": ([], vp),
            }
            for name, (args, res) in sigs.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, res
            if lib.cuInit(0) != _SUCCESS:
                raise DeviceError("the stand-in CUDA driver did not initialise")
            _LIBRARY = lib
        return _LIBRARY


def _copy_counts() -> tuple[int, ...]:
    """The driver's copies since the process began: device to host, host to device, pinned, pageable."""
    out = (ctypes.c_uint64 * 4)()
    _lib().smddp_standin_copy_counts(out)
    return tuple(out)


def _check(code: int, what: str) -> None:
    if code != _SUCCESS:
        raise DeviceError(f"stand-in device: {what} failed (CUDA error {code})")


# Python kernels run as the driver's host functions (cuLaunchHostFunc), on its stream threads: one
# callback for all, its data the key of the call in _CALLS.
_CALLS: dict[int, Callable[[], None]] = {}
_CALL_KEYS = itertools.count(1)
_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _run_call(key: int | None) -> None:
    call = _CALLS.pop(key or 0, None)
    if call is None:
        return
    try:
        call()
    except Exception as e:  # a faulting kernel: its stream fails, sticky, with these words
        _lib().smddp_standin_fail_running(_KERNEL_FAULT, f"{type(e).__name__}: {e}".encode())


_RUN_CALL = _HOST_FN(_run_call)


class StandinEvent:
    """A stand-in cudaEvent_t: the driver's event. Recorded under capture, it stands for the graph's
    record (`captured`) until the graph runs, and no host may wait for it meanwhile."""

    def __init__(self, device: int, handle: int) -> None:
        self.device = device
        self.handle = handle
        self.captured: list[Any] | None = None
        self._finalizer = weakref.finalize(self, _lib().cuEventDestroy_v2, handle)

    @property
    def done(self) -> bool:
        if self.captured is not None:
            return False
        return int(_lib().cuEventQuery(self.handle)) != _NOT_READY


class _Stream:
    """A stream of the driver (its handle), and, under capture, the graph its work goes into instead."""

    __slots__ = ("device", "graph", "handle")

    def __init__(self, handle: int, device: int) -> None:
        self.handle = handle
        self.device = device
        self.graph: list[Callable[[_Stream], None]] | None = None


def make_runtime() -> StandinRuntime:
    """The registry's factory (entry point smddp.device_runtimes:standin); SMDDP_STANDIN_DELAY_MS delays every copy,
    SMDDP_STANDIN_IMMEDIATE=1 runs every operation at once instead (for measuring, never for ordering tests)."""
    return StandinRuntime(
        copy_delay_s=float(os.environ.get("SMDDP_STANDIN_DELAY_MS", "0") or 0) / 1000.0,
        immediate=os.environ.get("SMDDP_STANDIN_IMMEDIATE", "") == "1",
    )


class StandinRuntime:
    """The test double of `CupyRuntime`, over the stand-in CUDA driver (`driver_path()`): device memory
    is numpy memory reachable only through the runtime (and the driver, at the same addresses).

    Streams really are asynchronous: each is a thread of the driver's that runs copies, kernels
    (`launch`: Python functions, as the driver's host functions), event records and waits in order,
    so a missing wait gives stale data, as on a GPU; `copy_delay_s` makes every copy wait first, so
    that such a race is lost every time. Copies to or from host memory that is not registered
    (`register_host`) block the caller until they are done, as CUDA's copies from pageable memory
    do. `stats` counts copies by direction and by kind (pinned, pageable) as the driver made them,
    this runtime's and the engine's alike, since this runtime began (the driver's counts are the
    process's), and the kernels launched here. The engine, handed the same driver, sees the same
    streams, events and memory: what a real GPU's driver gives CuPy and the engine alike.
    """

    name = "standin"
    library = "smddp_rigs"  # StandinArray plays CuPy's arrays: their current stream is current_stream()

    def __init__(self, devices: int = 1, copy_delay_s: float = 0.0, immediate: bool = False) -> None:
        lib = _lib()
        _check(lib.smddp_standin_set_devices(devices), f"{devices} devices")
        self.devices = devices
        self._contexts: list[int] = []
        for d in range(devices):
            ctx = ctypes.c_void_p()
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d), "cuDevicePrimaryCtxRetain")
            self._contexts.append(int(ctx.value or 0))
        self._joined: dict[int, list[_Stream]] = {}  # the streams each capture drew in (by its graph)
        self._copy_delay_s = copy_delay_s
        if copy_delay_s > 0:
            # Every stream's copies are late on a GPU, the engine's own too (the device path's lanes and
            # the GPU step's, which no runtime makes): the driver's default for the streams it did not
            # configure (_configure) is this runtime's delay.
            lib.smddp_standin_set_copy_delay_us(int(copy_delay_s * 1e6))
        # Every operation runs in the enqueuing thread at once (one order of the streams' work that a
        # GPU may take, with no thread hand-off): what is left of a device call's time is smddp's and
        # torch's own, which is what `immediate` is for. It orders everything, so an ordering bug
        # never shows: never for the ordering tests.
        self.immediate = immediate
        self._kernels = 0
        self._copies_at = _copy_counts()  # the driver's counts when this runtime began
        self._lock = threading.Lock()
        self._closed = False
        self._streams: dict[int, _Stream] = {}
        self._defaults: dict[int, _Stream] = {}
        self._bases: list[int] = []
        self._allocs: dict[int, tuple[np.ndarray, int]] = {}  # base address -> (bytes, device)
        self._next_addr = _next_base(1 << 40)  # this runtime's own range of addresses
        self._pinned: dict[int, tuple[int, bool]] = {}  # host address -> (bytes, read-only)
        self._tls = threading.local()
        # The driver's registrations are the process's: this runtime's go with it (closed, or
        # collected), as a process's go with it, so that a later runtime may register that memory.
        self._unpin_all = weakref.finalize(self, _unregister_all, self._pinned)

    # -- devices and streams ---------------------------------------------------------------------

    def device_count(self) -> int:
        return self.devices

    def describe(self, device: int) -> str:
        return f"stand-in device {device} (numpy memory, the stand-in driver's stream threads; no GPU)"

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self.devices:
            raise DeviceError(f"stand-in device: no device {device} (it has {self.devices})")

    def _bind(self, device: int) -> None:
        """Make `device`'s context current on the calling thread (the driver refuses a thread without one)."""
        if getattr(self._tls, "bound", None) != (id(self), device):
            _check(_lib().cuCtxSetCurrent(self._contexts[device]), "cuCtxSetCurrent")
            self._tls.bound = (id(self), device)

    @property
    def copy_delay_s(self) -> float:
        return self._copy_delay_s

    @copy_delay_s.setter
    def copy_delay_s(self, seconds: float) -> None:
        self._copy_delay_s = seconds
        _lib().smddp_standin_set_copy_delay_us(int(seconds * 1e6))  # (the streams no runtime made: __init__)
        with self._lock:
            streams = [*self._defaults.values(), *self._streams.values()]
        for s in streams:
            self._configure(s)

    def _configure(self, s: _Stream) -> None:
        self._bind(s.device)
        delay_us = int(self._copy_delay_s * 1e6)
        _check(_lib().smddp_standin_stream_config(s.handle, delay_us, int(self.immediate)), "stream config")

    def _stream(self, handle: int, device: int) -> _Stream:
        with self._lock:
            if self._closed:
                raise DeviceError("stand-in device: the runtime is closed")
            if handle in (0, STREAM_LEGACY, STREAM_PER_THREAD):
                self._check_device(device)
                s = self._defaults.get(device)
                fresh = s is None
                if s is None:
                    s = self._defaults[device] = _Stream(STREAM_LEGACY, device)
            else:
                fresh = False
                s = self._streams.get(handle)
        if s is None:
            raise DeviceError(f"stand-in device: {handle:#x} is not a stream of this runtime")
        if s.device != device:
            raise DeviceError(f"stand-in device: stream {handle:#x} is on device {s.device}, not {device}")
        self._bind(device)
        if fresh:
            self._configure(s)  # the driver's legacy stream, with this runtime's settings
        return s

    def new_stream(self, device: int = 0) -> int:
        self._check_device(device)
        self._bind(device)
        out = ctypes.c_void_p()
        _check(_lib().cuStreamCreate(ctypes.byref(out), 1), "cuStreamCreate")
        s = _Stream(int(out.value or 0), device)
        self._configure(s)
        with self._lock:
            if self._closed:
                _lib().smddp_standin_stream_release(s.handle)
                raise DeviceError("stand-in device: the runtime is closed")
            self._streams[s.handle] = s
        return s.handle

    def current_stream(self, device: int = 0) -> int:
        # The thread's current stream is the driver library's (native callers, the C++ torch
        # backend's stand-in hooks, see the same one).
        return int(_lib().smddp_standin_current() or STREAM_LEGACY)

    @contextlib.contextmanager
    def use(self, stream: int) -> Iterator[int]:
        """Make `stream` the calling thread's current stream inside the block (as `with cupy_stream:`)."""
        lib = _lib()
        lib.smddp_standin_push_current(stream)
        try:
            yield stream
        finally:
            lib.smddp_standin_pop_current()

    def _issue(self, s: _Stream, op: Callable[[_Stream], None]) -> None:
        """Put `op` (which enqueues its work on the stream it is given) on `s`, or, under capture,
        into the graph instead."""
        if s.graph is not None:
            s.graph.append(op)
        else:
            op(s)

    def _host(self, s: _Stream, call: Callable[[], None]) -> None:
        """`call` on `s`'s thread, in stream order (cuLaunchHostFunc)."""
        key = next(_CALL_KEYS)
        _CALLS[key] = call
        self._bind(s.device)
        _check(_lib().cuLaunchHostFunc(s.handle, _RUN_CALL, key), "cuLaunchHostFunc")

    def _failure(self, event: StandinEvent) -> str:
        buf = ctypes.create_string_buffer(512)
        code = _lib().smddp_standin_event_failure(event.handle, buf, 512)
        return buf.value.decode(errors="replace") or f"CUDA error {code}"

    # -- events ----------------------------------------------------------------------------------

    def new_event(self, device: int = 0) -> StandinEvent:
        self._check_device(device)
        self._bind(device)
        out = ctypes.c_void_p()
        _check(_lib().cuEventCreate(ctypes.byref(out), 2), "cuEventCreate")
        return StandinEvent(device, int(out.value or 0))

    def record(self, event: StandinEvent, stream: int, device: int = 0) -> None:
        s = self._stream(stream, device)
        if event.device != s.device:
            raise DeviceError(
                f"stand-in device: an event of device {event.device} recorded on device {s.device}"
            )
        if s.graph is not None:
            event.captured = s.graph  # reached when the graph runs, not before

        def rec(t: _Stream) -> None:
            self._bind(t.device)
            _check(_lib().cuEventRecord(event.handle, t.handle), "cuEventRecord")
            event.captured = None

        self._issue(s, rec)

    def wait_event(self, stream: int, event: StandinEvent, device: int = 0) -> None:
        s = self._stream(stream, device)
        if event.captured is not None and s.graph is None:
            # Waiting for a record made under capture draws this stream into the capture, as CUDA
            # does: what it is given from now on is recorded into that graph too, not run.
            s.graph = event.captured
            with self._lock:
                self._joined.setdefault(id(event.captured), []).append(s)
            if s.handle != STREAM_LEGACY:
                _lib().cuStreamBeginCapture_v2(s.handle, 0)  # (the driver's view, for the engine)
            return

        def wait(t: _Stream) -> None:
            self._bind(t.device)
            # (never recorded: nothing to wait for, as with cudaStreamWaitEvent; a failure of the
            # producer's stream becomes this stream's)
            _check(_lib().cuStreamWaitEvent(t.handle, event.handle, 0), "cuStreamWaitEvent")

        self._issue(s, wait)

    def event_synchronize(self, event: StandinEvent) -> None:
        if event.captured is not None:
            raise DeviceError(_CAPTURING)
        code = int(_lib().cuEventSynchronize(event.handle))
        if code == _CAPTURE_UNSUPPORTED:
            raise DeviceError(_CAPTURING)
        if code != _SUCCESS:
            raise DeviceError(f"stand-in device: {self._failure(event)}")

    def event_done(self, event: StandinEvent) -> bool:
        if event.captured is not None:
            raise DeviceError(_CAPTURING)
        return event.done

    def driver_library(self) -> str:
        return driver_path()

    def event_handle(self, event: StandinEvent) -> int:
        return event.handle

    # -- CUDA graphs: stream capture -------------------------------------------------------------

    def begin_capture(self, stream: int, device: int = 0) -> None:
        """cudaStreamBeginCapture: from now on what is enqueued on `stream` is recorded, not run."""
        s = self._stream(stream, device)
        if stream in (0, 1):
            raise DeviceError("stand-in device: the legacy default stream cannot be captured (as with CUDA)")
        if s.graph is not None:
            raise DeviceError(f"stand-in device: stream {stream:#x} is capturing already")
        s.graph = []
        _check(_lib().cuStreamBeginCapture_v2(s.handle, 0), "cuStreamBeginCapture")

    def end_capture(self, stream: int, device: int = 0) -> list[Callable[[_Stream], None]]:
        """cudaStreamEndCapture: the graph of what was enqueued meanwhile (launch_graph runs it). Streams
        the capture drew in (wait_event) leave it too; as CUDA says (cudaErrorStreamCaptureUnjoined),
        that is an error: their work was recorded into the graph instead of running."""
        s = self._stream(stream, device)
        graph, s.graph = s.graph, None
        if graph is None:
            raise DeviceError(f"stand-in device: stream {stream:#x} is not capturing")
        lib = _lib()
        ended = ctypes.c_void_p()
        lib.cuStreamEndCapture(s.handle, ctypes.byref(ended))
        with self._lock:
            joined = self._joined.pop(id(graph), [])
        for j in joined:
            j.graph = None
            if j.handle != STREAM_LEGACY:
                self._bind(j.device)
                lib.cuStreamEndCapture(j.handle, ctypes.byref(ended))
        if joined:
            names = ", ".join(f"{j.handle:#x}" for j in joined)
            raise DeviceError(
                f"stand-in device: the capture on {stream:#x} drew in stream(s) {names} (unjoined)"
            )
        return graph

    def launch_graph(self, graph: list[Callable[[_Stream], None]], stream: int, device: int = 0) -> None:
        s = self._stream(stream, device)
        for op in graph:
            self._issue(s, op)

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
        # The driver's copies (the engine's too) reach it through its address, as a GPU's would.
        _check(_lib().smddp_standin_map(base, host.ctypes.data, max(host.nbytes, 1), device), "map")
        return base

    def _free(self, base: int) -> None:
        with self._lock:
            if self._allocs.pop(base, None) is None:
                return
            self._bases.remove(base)
        _lib().smddp_standin_unmap(base)

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
            self._bind(0)
            _check(_lib().cuMemHostRegister_v2(ptr, nbytes, 0x08 if readonly else 0), "cuMemHostRegister")
            self._pinned[ptr] = (nbytes, readonly)

    def unregister_host(self, ptr: int) -> None:
        with self._lock:
            if self._pinned.pop(ptr, None) is None:
                raise DeviceError(
                    f"stand-in device: host address {ptr:#x} is not registered (cudaErrorHostMemoryNotRegistered)"
                )
        _lib().cuMemHostUnregister(ptr)

    def registered(self) -> dict[int, tuple[int, bool]]:
        """Host address -> (bytes, read-only) of every registered range (for tests)."""
        with self._lock:
            return dict(self._pinned)

    def driver_registered(self) -> dict[int, tuple[int, bool]]:
        """Host address -> (bytes, read-only) of every range the driver has registered, whoever asked
        (the engine's page-locked segments too): what registered() says of this runtime's own."""
        lib = _lib()
        while True:
            n = lib.smddp_standin_registered(None, None, None, 0)
            addrs, sizes, ro = (ctypes.c_size_t * n)(), (ctypes.c_size_t * n)(), (ctypes.c_int * n)()
            if lib.smddp_standin_registered(addrs, sizes, ro, n) == n:
                return {int(addrs[i]): (int(sizes[i]), bool(ro[i])) for i in range(n)}

    @contextlib.contextmanager
    def registrations(self, mode: str) -> Iterator[Callable[[], int]]:
        """Inside: the driver's registrations of memory the device may write (an input segment's, not
        a read-only result segment's) are `held` (each waits until the block ends) or `refused`
        (CUDA_ERROR_NOT_PERMITTED, as a driver that cannot page-lock them). Yields how many wait held
        now. Whoever registers, the engine included."""
        lib = _lib()
        lib.smddp_standin_register_mode({"held": 1, "refused": 2}[mode])
        try:
            yield lambda: int(lib.smddp_standin_register_mode(-1))
        finally:
            lib.smddp_standin_register_mode(0)

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
        self._copy(s, pinned, mem, lambda t: _lib().cuMemcpyDtoHAsync_v2(dst, src, nbytes, t.handle))

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: int, device: int = 0) -> None:
        s = self._stream(stream, device)
        if nbytes == 0:
            return
        mem = self._device_range(dst, nbytes, s)
        pinned = self._pinned_range(src, nbytes, device_writes=False)
        self._copy(s, pinned, mem, lambda t: _lib().cuMemcpyHtoDAsync_v2(dst, src, nbytes, t.handle))

    def _copy(self, s: _Stream, pinned: bool, mem: np.ndarray, issue: Callable[[_Stream], int]) -> None:
        """A copy the driver makes on `s`: asynchronous from pinned memory (the device bytes, `mem`,
        kept alive until it has run), else blocking until it is done, as CUDA's pageable copies."""
        if not pinned and s.graph is not None:
            raise DeviceError(_CAPTURING)  # a copy the host waits for cannot be captured

        def op(t: _Stream) -> None:
            self._bind(t.device)
            code = int(issue(t))
            if code != _SUCCESS:
                ev = self.new_event(t.device)  # (the stream's failure, in words)
                self.record(ev, t.handle, t.device)
                self.event_synchronize(ev)
                raise DeviceError(f"stand-in device: a copy failed (CUDA error {code})")
            if pinned:

                def keep(_held: np.ndarray = mem) -> None:
                    """Runs after the copy: until then its closure holds the device bytes."""

                self._host(t, keep)

        self._issue(s, op)

    def _device_range(self, ptr: int, nbytes: int, s: _Stream) -> np.ndarray:
        mem, device = self._resolve(ptr, nbytes)
        if device != s.device:
            raise DeviceError(
                f"stand-in device: memory of device {device} copied on a stream of device {s.device}"
            )
        return mem

    @contextlib.contextmanager
    def traced(self) -> Iterator[list[tuple[str, int]]]:
        """The driver's copies and waits inside the block, whoever made them (this runtime, the engine):
        ("copy_d2h" | "copy_h2d" | "wait_event", the stream handle as passed), in call order, in the
        list yielded, filled at the block's end (the trace is the process's: one block at a time)."""
        lib = _lib()
        got: list[tuple[str, int]] = []
        lib.smddp_standin_trace(1)
        try:
            yield got
        finally:
            lib.smddp_standin_trace(0)
            n = lib.smddp_standin_trace_take(None, None, 0)
            what = (ctypes.c_int * max(n, 1))()
            streams = (ctypes.c_size_t * max(n, 1))()
            lib.smddp_standin_trace_take(what, streams, n)
            names = ("copy_d2h", "copy_h2d", "wait_event")
            got.extend((names[what[i]], int(streams[i])) for i in range(n))

    @property
    def stats(self) -> dict[str, int]:
        """Copies the driver made since this runtime began ("d2h", "h2d", "pinned", "pageable"), and
        "kernels" launched here."""
        now = _copy_counts()
        names = ("d2h", "h2d", "pinned", "pageable")
        return {**{n: now[i] - self._copies_at[i] for i, n in enumerate(names)}, "kernels": self._kernels}

    def _enqueue(self, s: _Stream, op: Callable[[], None], wait: bool) -> None:
        """Enqueue `op` (a host function); with `wait`, return only once it ran (as a copy from or to
        pageable memory)."""
        if wait and s.graph is not None:
            raise DeviceError(_CAPTURING)  # a copy the host waits for cannot be captured
        self._issue(s, lambda t: self._host(t, op))
        if wait:
            ev = self.new_event(s.device)
            self.record(ev, s.handle, s.device)
            self.event_synchronize(ev)

    def launch(self, stream: int, fn: Callable[..., None], *arrays: StandinArray, device: int = 0) -> None:
        """Run `fn(*host views of arrays)` on `stream`, in order: the stand-in's kernel launch."""
        s = self._stream(stream, device)
        for a in arrays:
            if a.device_id != s.device:
                raise DeviceError(
                    f"stand-in device: a kernel on device {s.device} given memory of {a.device_id}"
                )
        with self._lock:
            self._kernels += 1
        self._issue(s, lambda t: self._host(t, lambda: fn(*[a._host_view() for a in arrays])))

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

    def torch_native(self) -> dict[str, int]:
        """The C++ torch backend's doubles for CPU tensors under this runtime, as function addresses
        (smddp/torch/c10d.cpp, StandinSide): the calling thread's current stream, host memory
        aliased as device memory and unmapped, a host wait for a stream, a new stream."""
        lib = _lib()
        names = {
            "current": "smddp_standin_current",
            "alias": "smddp_standin_alias",
            "unmap": "smddp_standin_unmap",
            "synchronize": "smddp_standin_synchronize",
            "new_stream": "smddp_standin_new_stream",
        }
        return {k: ctypes.cast(getattr(lib, v), ctypes.c_void_p).value or 0 for k, v in names.items()}

    def close(self) -> None:
        """Lets go of this runtime's streams: each ends once what was put on it has run (the driver's
        legacy streams are the process's, and stay)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = list(self._streams.values())
        for s in streams:
            _lib().smddp_standin_stream_release(s.handle)
        self._unpin_all()


def _unregister_all(pinned: dict[int, tuple[int, bool]]) -> None:
    lib = _lib()
    for ptr in list(pinned):
        lib.cuMemHostUnregister(ptr)
    pinned.clear()


_BASES_LOCK = threading.Lock()
_BASES = [_DEVICE_BASE]


def _next_base(span: int) -> int:
    """A range of stand-in device addresses of its own for each runtime of the process: the driver
    maps them all, so two runtimes' arrays must never share an address."""
    with _BASES_LOCK:
        base = _BASES[0]
        _BASES[0] += span
        return base


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
