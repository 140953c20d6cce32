"""The device runtime interface, and the registry that finds a runtime by name (SMDDP_DEVICE_RUNTIME)."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, Protocol

import numpy as np

from smddp.errors import ConfigError

# CUDA's special stream handles (also the values the CUDA Array Interface and DLPack use for them).
STREAM_LEGACY = 1
STREAM_PER_THREAD = 2

#: Other distributions add runtimes under this entry-point group (name = SMDDP_DEVICE_RUNTIME's
#: value, object = a callable taking no arguments that returns a DeviceRuntime). smddp's own test
#: rigs add "standin" there, a numpy-backed double of CUDA; the package itself ships CuPy's.
ENTRY_POINT_GROUP = "smddp.device_runtimes"
BUILTIN = ("auto", "cupy")


class DeviceRuntime(Protocol):
    """What smddp needs from a CUDA runtime. Streams are raw handles (cudaStream_t as int), events opaque.

    `CupyRuntime` drives a real GPU; `StandinRuntime` is the numpy-backed test double with the same
    semantics (asynchronous in-order streams, events, pinned-host bookkeeping).
    """

    name: str
    #: The top-level module of the arrays this runtime's library makes ("cupy"): a buffer of theirs
    #: that names no stream was made on the runtime's current stream (library_stream).
    library: str

    def device_count(self) -> int: ...

    def describe(self, device: int) -> str:
        """The device's name, for reports ("NVIDIA H100 80GB HBM3")."""
        ...

    def pointer_device(self, ptr: int) -> int:
        """The device that owns device pointer `ptr` (the CUDA Array Interface does not say)."""
        ...

    def current_stream(self, device: int) -> int:
        """The calling thread's current stream on `device` (the runtime's own notion of it)."""
        ...

    def new_stream(self, device: int) -> int:
        """A new non-blocking stream on `device`, owned (and destroyed at close) by the runtime."""
        ...

    def new_event(self, device: int) -> Any: ...

    def record(self, event: Any, stream: int, device: int) -> None: ...

    def wait_event(self, stream: int, event: Any, device: int) -> None:
        """Later work on `stream` waits for the event's last record (the host does not block)."""
        ...

    def event_synchronize(self, event: Any) -> None:
        """Block the calling thread until the event's last record has been reached."""
        ...

    def event_done(self, event: Any) -> bool: ...

    def register_host(self, ptr: int, nbytes: int, readonly: bool) -> None:
        """Page-lock host memory so that copies to and from it are asynchronous DMA."""
        ...

    def unregister_host(self, ptr: int) -> None: ...

    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: int, device: int) -> None: ...

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: int, device: int) -> None: ...

    def new_array(self, shape: tuple[int, ...], dtype: np.dtype, device: int) -> tuple[Any, int]:
        """A new device array of the runtime's own kind (for results smddp allocates), and its address."""
        ...

    def refuse(self, buf: Any) -> str | None:
        """Why this runtime cannot use buffer `buf` (another runtime's memory), or None.

        Arrays of a registered runtime name it in a `__smddp_device_runtime__` attribute, so that
        every other runtime can say which SMDDP_DEVICE_RUNTIME they need.
        """
        ...

    def driver_library(self) -> str:
        """The CUDA driver library this runtime's streams and events belong to (libcuda.so.1 on a
        GPU): the engine loads it too, and reaches the same streams and events through it."""
        ...

    def event_handle(self, event: Any) -> int:
        """The driver's handle (CUevent) of one of this runtime's events."""
        ...

    def close(self) -> None: ...


def runtime_names() -> list[str]:
    """Every runtime SMDDP_DEVICE_RUNTIME may name here: the built-in ones, then the registered ones."""
    return [
        *BUILTIN,
        *sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in BUILTIN),
    ]


def check_runtime_name(name: str) -> str:
    """`name` if a runtime of that name exists here; else ConfigError naming the ones that do."""
    if name in BUILTIN or entry_points(group=ENTRY_POINT_GROUP, name=name):
        return name
    raise ConfigError(f"SMDDP_DEVICE_RUNTIME={name!r}: expected one of {', '.join(runtime_names())}")


def load_runtime(name: str) -> DeviceRuntime:
    """The device runtime `name` ("auto" means CuPy); raises DeviceUnavailableError naming what is missing."""
    check_runtime_name(name)
    if name in BUILTIN:
        from smddp.client.device.cupy_runtime import CupyRuntime

        return CupyRuntime()
    (ep,) = entry_points(group=ENTRY_POINT_GROUP, name=name)
    make: Any = ep.load()
    return make()
