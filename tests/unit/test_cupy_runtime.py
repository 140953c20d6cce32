"""CupyRuntime's calls against CuPy's API, without a GPU: a CuPy-shaped module over the stand-in runtime.

This checks the one thing that can be checked here: that every CuPy call CupyRuntime makes exists
with the signature CuPy's source gives it (cupy_backends/cuda/api/runtime.pyx, cupy/cuda/stream.pyx)
and is used to the documented effect. What the calls do on a GPU is tested in tests/gpu/test_gpu.py.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from typing import Any

import numpy as np
import pytest
from smddp_rigs.standin import StandinArray, StandinEvent, StandinRuntime

from smddp.client.device.buffers import read_cai, read_dlpack
from smddp.client.device.copies import DeviceIO
from smddp.client.device.cupy_runtime import HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY, CupyRuntime
from smddp.errors import DeviceError


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"cudaError {status}")
        self.status = status


def fake_cupy(sr: StandinRuntime, calls: list[tuple[Any, ...]]) -> types.ModuleType:
    """The parts of CuPy that CupyRuntime uses, with CuPy's signatures, doing their work on `sr`."""
    events: dict[int, StandinEvent] = {}
    state = {"device": 0}

    def check(fn):  # CuPy raises CUDARuntimeError for a failed call
        @functools.wraps(fn)
        def wrapped(*args: Any) -> Any:
            calls.append((fn.__name__, *args))
            try:
                return fn(*args)
            except DeviceError as e:
                raise CUDARuntimeError(1) from e

        return wrapped

    rt = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError,
        memcpyHostToDevice=1,
        memcpyDeviceToHost=2,
    )

    @check
    def getDeviceCount() -> int:
        return sr.devices

    @check
    def getDevice() -> int:
        return state["device"]

    @check
    def getDeviceProperties(device: int) -> dict[str, Any]:
        return {"name": b"Fake CUDA device"}

    @check
    def pointerGetAttributes(ptr: int) -> Any:
        return types.SimpleNamespace(device=sr.pointer_device(ptr), type=2)

    @check
    def eventRecord(event: int, stream: int) -> None:
        sr.record(events[event], stream, state["device"])

    @check
    def streamWaitEvent(stream: int, event: int, flags: int = 0) -> None:
        sr.wait_event(stream, events[event], state["device"])

    @check
    def eventSynchronize(event: int) -> None:
        sr.event_synchronize(events[event])

    @check
    def hostRegister(ptr: int, size: int, flags: int) -> None:
        assert (
            flags & HOST_REGISTER_PORTABLE
            and flags & ~(HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY) == 0
        )
        sr.register_host(ptr, size, readonly=bool(flags & HOST_REGISTER_READ_ONLY))

    @check
    def hostUnregister(ptr: int) -> None:
        sr.unregister_host(ptr)

    @check
    def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        if kind == 2:
            sr.copy_d2h(dst, src, size, stream, state["device"])
        elif kind == 1:
            sr.copy_h2d(dst, src, size, stream, state["device"])
        else:
            raise AssertionError(f"unexpected copy kind {kind}")

    for f in (
        getDeviceCount,
        getDevice,
        getDeviceProperties,
        pointerGetAttributes,
        eventRecord,
        streamWaitEvent,
        eventSynchronize,
        hostRegister,
        hostUnregister,
        memcpyAsync,
    ):
        setattr(rt, f.__name__, f)

    class Device:
        def __init__(self, device: int = -1) -> None:
            self.id = device

        def __enter__(self) -> Device:
            self._prev = state["device"]
            state["device"] = self.id
            return self

        def __exit__(self, *exc: Any) -> None:
            state["device"] = self._prev

    class Stream:
        def __init__(
            self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority: Any = None
        ) -> None:
            assert non_blocking, "smddp's copy streams must not synchronise with the legacy default stream"
            self.ptr = sr.new_stream(state["device"])
            self.device_id = state["device"]

        def synchronize(self) -> None:
            sr.stream_synchronize(self.ptr, self.device_id)

    class Event:
        def __init__(
            self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
        ) -> None:
            ev = sr.new_event(state["device"])
            self.ptr = id(ev)
            events[self.ptr] = ev

        @property
        def done(self) -> bool:
            return sr.event_done(events[self.ptr])

        def synchronize(self) -> None:
            eventSynchronize(self.ptr)

    class CurrentStream:
        ptr = 0  # the legacy default stream, as cupy.cuda.Stream.null

    class Array:
        """A CuPy-like array: its memory is stand-in memory, and it says nothing of being a stand-in."""

        def __init__(self, arr: StandinArray) -> None:
            self._arr = arr
            self.data = types.SimpleNamespace(ptr=arr.ptr)

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return self._arr.__cuda_array_interface__

    def empty(shape: tuple[int, ...], dtype: Any = float) -> Array:
        return Array(sr.empty(shape, dtype, state["device"]))

    cuda = types.SimpleNamespace(
        runtime=rt, Device=Device, Stream=Stream, Event=Event, get_current_stream=lambda: CurrentStream()
    )
    return types.SimpleNamespace(cuda=cuda, empty=empty)  # type: ignore[return-value]


@pytest.fixture
def cupy_rt(monkeypatch):
    sr = StandinRuntime()
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(sr, calls))
    rt = CupyRuntime()
    yield rt, sr, calls
    rt.close()
    sr.close()


def test_copies_in_and_out_through_pinned_arena_memory(cupy_rt):
    rt, sr, calls = cupy_rt
    io = DeviceIO(rt)
    assert rt.device_count() == 1 and rt.describe(0) == "Fake CUDA device"
    src = sr.asarray(np.arange(256, dtype=np.float32))
    seg = np.zeros(4096, np.uint8)
    io.pin(("in", 0), seg, readonly=False)
    res = np.arange(256, dtype=np.float32)[::-1].copy()
    io.pin(("out", 0), res.view(np.uint8), readonly=True)
    buf = read_cai(src, "buf")
    buf = dataclasses.replace(buf, device=rt.pointer_device(buf.ptr))
    before = io.mark(io.producer_stream(buf, None), 0)
    io.host_wait(io.copy_in(buf, seg[:1024], before))
    assert np.array_equal(seg[:1024].view(np.float32), np.arange(256, dtype=np.float32))
    io.host_wait(io.copy_out(0, [(buf, res)], None))
    assert np.array_equal(src.get(), res)
    io.close()
    assert sr.registered() == {} and sr.stats["pageable"] == 0
    names = [c[0] for c in calls]
    for name in ("hostRegister", "memcpyAsync", "eventRecord", "streamWaitEvent", "eventSynchronize"):
        assert name in names, name
    flags = {c[3] for c in calls if c[0] == "hostRegister"}
    assert flags == {HOST_REGISTER_PORTABLE, HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY}
    kinds = {c[4] for c in calls if c[0] == "memcpyAsync"}
    assert kinds == {1, 2}


def test_new_arrays_and_refusals(cupy_rt):
    rt, sr, _calls = cupy_rt
    arr, ptr = rt.new_array((3, 4), np.dtype(np.float32), 0)
    assert ptr == arr.data.ptr and read_cai(arr, "out").count == 12
    assert rt.refuse(arr) is None
    assert "SMDDP_DEVICE_RUNTIME=standin" in (rt.refuse(sr.asarray(np.zeros(2))) or "")
    assert rt.current_stream(0) == 0
    with pytest.raises(DeviceError, match="cudaHostUnregister failed"):
        rt.unregister_host(12345)
    d = read_dlpack(sr.asarray(np.zeros(2, np.float32)), "buf", 0, rt.new_stream(0))
    assert rt.pointer_device(d.ptr) == 0
