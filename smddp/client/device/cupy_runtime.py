"""The real device runtime: CUDA through CuPy (streams, events, cudaHostRegister, cudaMemcpyAsync)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from smddp.errors import DeviceError, DeviceUnavailableError

# cudaHostRegister flags (driver_types.h); CuPy passes them through as plain ints.
HOST_REGISTER_PORTABLE = 0x01  # pinned for every CUDA context, not only the current device's
HOST_REGISTER_READ_ONLY = 0x08  # the device only reads it: needed for a PROT_READ mapping
# cudaMemoryType, as cudaPointerGetAttributes reports it.
_MEMORY_DEVICE = 2
_MEMORY_MANAGED = 3


class CupyRuntime:
    """`DeviceRuntime` on CuPy. Every call selects the device it works on, from whichever thread calls it.

    Streams are created non-blocking, so they never synchronise implicitly with the legacy default
    stream a user's compute may run on; events are created with blocking sync and without timing,
    so a host wait sleeps instead of spinning and a record costs the least.
    """

    name = "cupy"
    library = "cupy"

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as e:
            raise DeviceUnavailableError(
                f"a CUDA buffer needs CuPy, which is not importable ({e}); install smddp[cuda13] "
                "(cupy-cuda13x), smddp[cuda12] (cupy-cuda12x) or smddp[cuda11] (cupy-cuda11x): the one of "
                "the CUDA major version your torch and driver use (torch.version.cuda)"
            ) from None
        self._cp = cupy
        self._rt = cupy.cuda.runtime
        try:
            self._count = int(self._rt.getDeviceCount())
        except Exception as e:
            raise DeviceUnavailableError(f"CuPy cannot reach a CUDA device: {e}") from None
        if self._count == 0:
            raise DeviceUnavailableError("CuPy sees no CUDA device on this machine")
        self._lock = threading.Lock()
        self._streams: list[Any] = []  # cupy.cuda.Stream objects: alive until close()

    def _device(self, device: int) -> Any:
        return self._cp.cuda.Device(device)

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._rt.CUDARuntimeError as e:
            raise DeviceError(f"{what} failed: {e}") from None

    def device_count(self) -> int:
        return self._count

    def describe(self, device: int) -> str:
        name = self._rt.getDeviceProperties(device)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def pointer_device(self, ptr: int) -> int:
        if ptr == 0:
            return int(self._rt.getDevice())
        attrs = self._call("cudaPointerGetAttributes", self._rt.pointerGetAttributes, ptr)
        kind = getattr(attrs, "type", None)  # older CuPy does not report the memory type
        if kind is not None and kind not in (_MEMORY_DEVICE, _MEMORY_MANAGED):
            raise DeviceError(f"pointer {ptr:#x} is not CUDA device or managed memory (memory type {kind})")
        return int(attrs.device)

    def current_stream(self, device: int) -> int:
        # Inside the device's context: CuPy before v13 takes no device argument here.
        with self._device(device):
            return int(self._cp.cuda.get_current_stream().ptr)

    def new_stream(self, device: int) -> int:
        with self._device(device):
            s = self._cp.cuda.Stream(non_blocking=True)
        with self._lock:
            self._streams.append(s)
        return int(s.ptr)

    def new_event(self, device: int) -> Any:
        with self._device(device):
            return self._cp.cuda.Event(block=True, disable_timing=True)

    def record(self, event: Any, stream: int, device: int) -> None:
        with self._device(device):
            self._call("cudaEventRecord", self._rt.eventRecord, event.ptr, stream)

    def wait_event(self, stream: int, event: Any, device: int) -> None:
        with self._device(device):
            self._call("cudaStreamWaitEvent", self._rt.streamWaitEvent, stream, event.ptr)

    def event_synchronize(self, event: Any) -> None:
        # CuPy releases the GIL in cudaEventSynchronize: other Python threads keep running.
        self._call("cudaEventSynchronize", self._rt.eventSynchronize, event.ptr)

    def event_done(self, event: Any) -> bool:
        return bool(event.done)

    def driver_library(self) -> str:
        return "libcuda.so.1"  # (the one the GPU's kernel module goes with; CuPy's runtime uses it)

    def event_handle(self, event: Any) -> int:
        return int(event.ptr)  # a cudaEvent_t is the driver's CUevent

    def register_host(self, ptr: int, nbytes: int, readonly: bool) -> None:
        flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if readonly else 0)
        self._call("cudaHostRegister", self._rt.hostRegister, ptr, nbytes, flags)

    def unregister_host(self, ptr: int) -> None:
        self._call("cudaHostUnregister", self._rt.hostUnregister, ptr)

    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: int, device: int) -> None:
        if nbytes:
            with self._device(device):
                self._call(
                    "cudaMemcpyAsync (device to host)",
                    self._rt.memcpyAsync,
                    dst,
                    src,
                    nbytes,
                    self._rt.memcpyDeviceToHost,
                    stream,
                )

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: int, device: int) -> None:
        if nbytes:
            with self._device(device):
                self._call(
                    "cudaMemcpyAsync (host to device)",
                    self._rt.memcpyAsync,
                    dst,
                    src,
                    nbytes,
                    self._rt.memcpyHostToDevice,
                    stream,
                )

    def new_array(self, shape: tuple[int, ...], dtype: np.dtype, device: int) -> tuple[Any, int]:
        with self._device(device):
            arr = self._cp.empty(shape, dtype=dtype)
        return arr, int(arr.data.ptr)

    def refuse(self, buf: Any) -> str | None:
        other = getattr(buf, "__smddp_device_runtime__", None)
        if isinstance(other, str) and other != self.name:
            return f"it is memory of the {other!r} device runtime; set SMDDP_DEVICE_RUNTIME={other} to use it"
        return None

    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, []
        for s in streams:
            try:
                s.synchronize()
            except Exception:
                pass
