"""The device path without a GPU: stand-in stream and event semantics, reading CUDA buffers, DeviceIO ordering."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import threading
import time
import weakref
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from smddp_rigs.standin import CaiOnly, StandinRuntime

from smddp.client.device.buffers import (
    DeviceBuffer,
    device_kind,
    library_stream,
    read_cai,
    read_dlpack,
    stream_handle,
)
from smddp.client.device.copies import DeviceIO, DevicePlan
from smddp.client.device.runtime import STREAM_LEGACY, load_runtime, runtime_names
from smddp.client.session import ClientConfig
from smddp.errors import (
    ConfigError,
    DeviceError,
    DeviceUnavailableError,
    InvalidArgumentError,
    UnsupportedBufferError,
)
from smddp.proto import DType
from smddp.transport.shm import Arena
from tests.conftest import need_module

SLOW = 0.3  # a "long kernel": long enough that a copy which does not wait for it runs first


@pytest.fixture
def rt():
    r = StandinRuntime()
    yield r
    r.close()


def pinned(rt: StandinRuntime, nbytes: int) -> np.ndarray:
    """Host memory registered with the stand-in runtime (as an arena segment would be)."""
    a = np.zeros(nbytes, np.uint8)
    rt.register_host(a.ctypes.data, a.nbytes, readonly=False)
    return a


# -- the stand-in runtime: streams are asynchronous and in order ---------------------------------------


def test_copies_are_asynchronous_and_in_order(rt):
    s = rt.new_stream()
    dev = rt.asarray(np.arange(1000, dtype=np.float32))
    host = pinned(rt, dev.nbytes)
    gate = rt.hold(s)  # a kernel that runs until the test lets it end
    rt.copy_d2h(host.ctypes.data, dev.ptr, dev.nbytes, s)  # returns with the kernel still running
    assert not host.any(), "the copy ran before the kernel enqueued ahead of it"
    ev = rt.new_event()
    rt.record(ev, s)
    assert not rt.event_done(ev)
    gate.set()
    rt.event_synchronize(ev)
    assert rt.event_done(ev)
    assert np.array_equal(host.view(np.float32), np.arange(1000, dtype=np.float32))
    assert rt.stats["pinned"] == 1 and rt.stats["pageable"] == 0


def test_pageable_copies_block_the_caller(rt):
    s = rt.new_stream()
    dev = rt.asarray(np.ones(10, np.float64))
    host = np.zeros(10, np.float64)  # not registered
    ended: list[bool] = []
    gate = rt.hold(s)
    rt.launch(s, lambda: ended.append(True))  # the kernel ahead of the copy has ended
    returned: list[bool] = []
    call = threading.Thread(
        target=lambda: (rt.copy_d2h(host.ctypes.data, dev.ptr, dev.nbytes, s), returned.append(bool(ended)))
    )
    call.start()
    call.join(0.2)  # a copy that did not block would return while the stream is held
    gate.set()
    call.join(30)
    assert returned == [True], (
        "a copy into pageable memory returns when it is done, after the work ahead of it"
    )
    assert (host == 1).all()
    assert rt.stats["pageable"] == 1


def test_event_wait_orders_streams_and_a_missing_wait_reads_stale_data(rt):
    producer, consumer = rt.new_stream(), rt.new_stream()
    x = rt.asarray(np.zeros(100, np.int32))
    seen_without: list[np.ndarray] = []
    seen_with: list[np.ndarray] = []
    gate = rt.hold(producer)
    rt.launch(producer, lambda v: v.fill(7), x)
    # Without a wait the consumer runs now, before the producer's kernel wrote anything.
    rt.launch(consumer, lambda v: seen_without.append(v.copy()), x)
    ran = rt.new_event()
    rt.record(ran, consumer)
    rt.event_synchronize(ran)
    gate.set()
    ev = rt.new_event()
    rt.record(ev, producer)
    rt.wait_event(consumer, ev)
    rt.launch(consumer, lambda v: seen_with.append(v.copy()), x)
    rt.synchronize()
    assert (seen_without[0] == 0).all(), "the stand-in must expose a missing wait as stale data"
    assert (seen_with[0] == 7).all()


def test_a_wait_refers_to_the_last_record_before_it(rt):
    a, b = rt.new_stream(), rt.new_stream()
    x = rt.asarray(np.zeros(4, np.int64))
    ev = rt.new_event()
    rt.record(ev, a)  # an early, empty point of stream a
    gate = rt.hold(a)
    rt.launch(a, lambda v: v.fill(1), x)
    seen: list[int] = []
    rt.wait_event(b, ev)  # waits for the early record only
    rt.launch(b, lambda v: seen.append(int(v[0])), x)
    first = rt.new_event()
    rt.record(first, b)
    rt.record(ev, a)  # re-recorded after the write: later waits see it
    rt.wait_event(b, ev)
    rt.launch(b, lambda v: seen.append(int(v[0])), x)
    rt.event_synchronize(first)  # b's first read is done, with a still held
    gate.set()
    rt.synchronize()
    assert seen == [0, 1]


def test_an_event_never_recorded_is_complete(rt):
    ev = rt.new_event()
    assert rt.event_done(ev)
    rt.event_synchronize(ev)
    rt.wait_event(rt.new_stream(), ev)  # no-op, as cudaStreamWaitEvent on a never-recorded event


def test_errors_are_sticky_and_reported_at_synchronize(rt):
    s = rt.new_stream()
    x = rt.asarray(np.zeros(3, np.float32))
    host = pinned(rt, x.nbytes)

    def bad(v: np.ndarray) -> None:
        raise ValueError("kernel fault")

    rt.launch(s, bad, x)
    rt.launch(s, lambda v: v.fill(5), x)  # skipped: the stream is in error
    rt.copy_d2h(host.ctypes.data, x.ptr, x.nbytes, s)
    ev = rt.new_event()
    rt.record(ev, s)
    with pytest.raises(DeviceError, match="kernel fault"):
        rt.event_synchronize(ev)
    assert not host.any()


def test_memory_is_only_reachable_through_the_runtime(rt):
    s = rt.new_stream()
    x = rt.asarray(np.arange(4, dtype=np.float32))
    host = np.zeros(4, np.float32)
    assert x.ptr >= 1 << 63, "stand-in addresses are no valid host addresses"
    with pytest.raises(DeviceError, match="not stand-in device memory"):
        rt.copy_d2h(host.ctypes.data, host.ctypes.data, 16, s)  # a host pointer as the source
    with pytest.raises(DeviceError, match="not stand-in device memory"):
        rt.copy_d2h(host.ctypes.data, x.ptr, 17, s)  # one byte past the end
    ref = weakref.ref(x)
    ptr = x.ptr
    del x
    assert ref() is None
    with pytest.raises(DeviceError, match="freed"):
        rt.copy_d2h(host.ctypes.data, ptr, 16, s)


def test_host_registration_rules(rt):
    a = np.zeros(4096, np.uint8)
    rt.register_host(a.ctypes.data, a.nbytes, readonly=True)
    with pytest.raises(DeviceError, match="already registered"):
        rt.register_host(a.ctypes.data + 100, 10, readonly=False)
    x = rt.asarray(np.ones(8, np.uint8))
    with pytest.raises(DeviceError, match="read-only"):
        rt.copy_d2h(a.ctypes.data, x.ptr, 8, rt.new_stream())
    rt.unregister_host(a.ctypes.data)
    with pytest.raises(DeviceError, match="not registered"):
        rt.unregister_host(a.ctypes.data)
    assert rt.registered() == {}


def test_streams_and_events_belong_to_a_device():
    rt = StandinRuntime(devices=2)
    try:
        s1 = rt.new_stream(1)
        with pytest.raises(DeviceError, match="device 1, not 0"):
            rt.record(rt.new_event(0), s1, 0)
        with pytest.raises(DeviceError, match="recorded on device 1"):
            rt.record(rt.new_event(0), s1, 1)
        x = rt.asarray(np.ones(4, np.float32), device=0)
        with pytest.raises(DeviceError, match="device 0 copied on a stream of device 1"):
            rt.copy_d2h(np.zeros(4, np.float32).ctypes.data, x.ptr, 16, s1, 1)
        with pytest.raises(DeviceError, match="no device 2"):
            rt.new_stream(2)
    finally:
        rt.close()


def test_current_stream_is_per_thread(rt):
    s = rt.new_stream()
    seen: list[int] = []
    with rt.use(s):
        assert rt.current_stream() == s
        t = threading.Thread(target=lambda: seen.append(rt.current_stream()))
        t.start()
        t.join()
    assert rt.current_stream() == 1 and seen == [1]


def test_get_and_set_run_on_the_current_stream(rt):
    s = rt.new_stream()
    x = rt.empty((3,), np.float32)
    assert x.get().view(np.uint8).tolist() == [0xA5] * 12, "fresh device memory holds garbage, not zeros"
    with rt.use(s):
        rt.sleep(s, SLOW / 2)
        x.set(np.array([1.0, 2.0, 3.0], np.float32))  # after the kernel on s
        assert x.get().tolist() == [1.0, 2.0, 3.0]


# -- the interfaces the client reads: CUDA Array Interface and DLPack ------------------------------


def test_device_kind_asks_nothing_of_host_memory(rt):
    import torch

    assert device_kind(np.zeros(3)) is None
    assert device_kind(torch.zeros(3)) is None
    assert device_kind(memoryview(b"abc")) is None
    assert device_kind(rt.asarray(np.zeros(3))) == ("dlpack", 0)
    assert device_kind(CaiOnly(rt.asarray(np.zeros(3)))) == ("cai", -1)


def test_rocm_and_broken_interfaces_are_refused():
    class Rocm:
        def __dlpack_device__(self):
            return (10, 0)

        def __dlpack__(self, **kw):
            raise AssertionError("must not be exported")

    class BrokenCai:
        @property
        def __cuda_array_interface__(self):
            raise KeyError("bfloat16")  # what torch's raises for bfloat16

    with pytest.raises(UnsupportedBufferError, match="ROCm"):
        device_kind(Rocm())
    assert device_kind(BrokenCai()) == ("cai", -1)
    with pytest.raises(UnsupportedBufferError, match="__cuda_array_interface__ failed"):
        read_cai(BrokenCai(), "buf")


@pytest.mark.parametrize(
    "np_dtype,wire",
    [
        (np.uint8, DType.UINT8),
        (np.int32, DType.INT32),
        (np.int64, DType.INT64),
        (np.float16, DType.FLOAT16),
        (ml_dtypes.bfloat16, DType.BFLOAT16),
        (np.float32, DType.FLOAT32),
        (np.float64, DType.FLOAT64),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_dlpack_and_cai_read_every_dtype(rt, np_dtype, wire):
    x = rt.asarray(np.arange(12).reshape(3, 4).astype(np_dtype))
    s = rt.new_stream()
    d = read_dlpack(x, "buf", 0, s)
    assert (d.ptr, d.dtype, d.shape, d.count, d.device, d.via) == (x.ptr, wire, (3, 4), 12, 0, "dlpack")
    assert d.nbytes == 12 * wire.itemsize and d.library == "smddp_rigs"
    if wire is DType.BFLOAT16:
        assert d.result_dtype == np.uint16  # raw bits, as for a host DLPack bfloat16
        with pytest.raises(UnsupportedBufferError, match="__cuda_array_interface__ failed"):
            read_cai(CaiOnly(x), "buf")
        return
    c = read_cai(CaiOnly(x), "buf")
    assert (c.ptr, c.dtype, c.shape, c.count, c.via, c.readonly) == (x.ptr, wire, (3, 4), 12, "cai", False)
    assert c.result_dtype == np.dtype(np_dtype)


def test_cai_stream_field_v2_v3(rt):
    x = rt.asarray(np.zeros(4, np.float32))
    s = rt.new_stream()
    with rt.use(s):
        v3 = read_cai(CaiOnly(x), "buf")
    assert v3.stream_given and v3.stream == s
    none = read_cai(CaiOnly(x, stream=None), "buf")
    assert none.stream_given and none.stream is None  # the producer says: no synchronisation needed
    v2 = read_cai(CaiOnly(x, version=2), "buf")
    assert not v2.stream_given and v2.stream is None
    with pytest.raises(UnsupportedBufferError, match="stream 0"):
        read_cai(CaiOnly(x, stream=0), "buf")


def test_non_contiguous_unsupported_and_masked_device_arrays_are_refused(rt):
    x = rt.asarray(np.arange(10, dtype=np.float32))
    with pytest.raises(UnsupportedBufferError, match="not C-contiguous"):
        read_dlpack(x.every(2), "buf", 0, rt.new_stream())
    with pytest.raises(UnsupportedBufferError, match="not C-contiguous"):
        read_cai(CaiOnly(x.every(3)), "buf")
    for dt in (np.int16, np.uint16, np.complex64, np.bool_, np.int8):
        y = rt.asarray(np.zeros(4, dt))
        with pytest.raises(UnsupportedBufferError, match="not supported"):
            read_dlpack(y, "buf", 0, rt.new_stream())
        with pytest.raises(UnsupportedBufferError, match="not supported"):
            read_cai(CaiOnly(y), "buf")

    class Masked:
        __cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (x.ptr, True),
            "version": 3,
            "mask": object(),
        }

    with pytest.raises(UnsupportedBufferError, match="masked"):
        read_cai(Masked(), "buf")
    Masked.__cuda_array_interface__["mask"] = None
    assert read_cai(Masked(), "buf").readonly


def test_dlpack_export_makes_the_consumer_stream_wait_for_the_producer(rt):
    producer, consumer = rt.new_stream(), rt.new_stream()
    x = rt.empty((64,), np.float32)
    with rt.use(producer):
        gate = rt.hold(producer)
        rt.launch(producer, lambda v: v.fill(3.0), x)
        read_dlpack(x, "buf", 0, consumer)
    seen: list[float] = []
    rt.launch(consumer, lambda v: seen.append(float(v[0])), x)
    time.sleep(0.05)  # (a consumer made to wait for nothing would read garbage meanwhile)
    gate.set()
    rt.synchronize()
    assert seen == [3.0]


def test_dlpack_capsules_do_not_leak(rt):
    x = rt.asarray(np.ones(16, np.float32))
    before = sys.getrefcount(x)
    for _ in range(2000):
        c = x.__dlpack__(stream=None)
        del c
    assert sys.getrefcount(x) == before
    ref = weakref.ref(x)
    held = read_dlpack(x, "buf", 0, rt.new_stream())
    del x
    assert ref() is not None, "a DeviceBuffer keeps its array alive"
    del held
    assert ref() is None


def test_stream_handles():
    class TorchLike:
        cuda_stream = 0x7F00

    class CupyLike:
        ptr = 0x7F10

    class Protocol:
        def __cuda_stream__(self):
            return (0, 0x7F20)

    assert stream_handle(5) == 5 and stream_handle(np.int64(9)) == 9
    assert stream_handle(TorchLike()) == 0x7F00
    assert stream_handle(CupyLike()) == 0x7F10
    assert stream_handle(Protocol()) == 0x7F20
    for bad in (True, "s", 1.5, object()):
        with pytest.raises(InvalidArgumentError, match="stream"):
            stream_handle(bad)


def test_runtime_selection(monkeypatch):
    with pytest.raises(ConfigError, match="SMDDP_DEVICE_RUNTIME"):
        load_runtime("opencl")
    with pytest.raises(ConfigError, match="SMDDP_DEVICE_RUNTIME"):
        ClientConfig.from_env({"SMDDP_DEVICE_RUNTIME": "gpu"})
    c = ClientConfig.from_env({"SMDDP_DEVICE_RUNTIME": "standin"})
    assert c.device_runtime == "standin"
    assert ClientConfig.from_env({}).device_runtime == "auto"
    # The stand-in is not part of smddp: the registry finds it through the rigs' entry point, and it
    # reads its own setting (SMDDP_STANDIN_DELAY_MS) itself.
    assert runtime_names() == ["auto", "cupy", "standin"]
    monkeypatch.setenv("SMDDP_STANDIN_DELAY_MS", "2.5")
    r = load_runtime("standin")
    try:
        assert isinstance(r, StandinRuntime) and r.copy_delay_s == 0.0025
    finally:
        r.close()


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_cupy_runtime_unavailable_is_a_clear_error():
    for name in ("cupy", "auto"):
        with pytest.raises(DeviceUnavailableError, match=r"CuPy.*smddp\[cuda13\].*smddp\[cuda12\]"):
            load_runtime(name)


# -- DeviceIO: the client's copy machinery, ordered by events ---------------------------------------


def _io(rt: StandinRuntime) -> DeviceIO:
    return DeviceIO(rt)


def _segment(arena: Arena, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    slot, _seg = arena.alloc(nbytes)
    seg = arena.segments[slot.segment]
    return seg.array, arena.view(slot)


def dataclass_device(b: DeviceBuffer) -> DeviceBuffer:
    """A CUDA Array Interface buffer with its device found (the client asks the runtime for it)."""
    return dataclasses.replace(b, device=0)


def test_copy_in_waits_for_the_producer_and_would_be_stale_without(rt):
    io = _io(rt)
    arena = Arena(1 << 20, "t")
    try:
        whole, slot = _segment(arena, 4000)
        io.pin(("in", 0), whole, readonly=False)
        io.pin(("in", 0), whole, readonly=False)  # once per segment
        assert len(rt.registered()) == 1
        compute = rt.new_stream()
        for wait in (True, False):
            x = rt.empty((1000,), np.float32)
            with rt.use(compute):
                gate = rt.hold(compute)
                rt.launch(compute, lambda v: v.fill(2.5), x)
                b = dataclass_device(read_cai(CaiOnly(x), "buf"))
                before = io.mark(io.producer_stream(b, None), 0) if wait else None
            done = io.copy_in(b, slot, before)  # returns with the producer held: it does not block
            if not wait:
                io.host_wait(done)  # the copy did not wait for the producer, still held
            gate.set()
            io.host_wait(done)
            got = slot.view(np.float32)
            if wait:
                assert (got == 2.5).all()
            else:
                assert not (got == 2.5).any(), "without the producer's event the copy reads garbage"
            rt.synchronize()
        assert rt.stats["pageable"] == 0
        io.close()
        assert rt.registered() == {}
    finally:
        arena.close()


class ForeignCai(CaiOnly):
    """A CUDA Array Interface v2 array of a library smddp does not know (JAX's, older numba's): it
    names no stream, and it is not the runtime's own (library_of: "tests", this module's)."""

    def __init__(self, arr: Any) -> None:
        super().__init__(arr, version=2)


def test_a_v2_buffer_of_another_library_is_ordered_against_the_legacy_stream_not_the_current_one(rt):
    """A v2 buffer names no stream: one of a library smddp does not know was made on the legacy
    default stream (or synchronised before its export). Its copy-in waits for the legacy stream's
    work, not for the caller's current stream (CuPy's notion, unrelated to it): with the producer's
    kernel held on the legacy stream and an idle current stream, the copy reads the kernel's bytes."""
    io = _io(rt)
    arena = Arena(1 << 20, "t")
    try:
        whole, slot = _segment(arena, 4000)
        io.pin(("in", 0), whole, readonly=False)
        idle = rt.new_stream()
        x = rt.empty((1000,), np.float32)
        gate = rt.hold(STREAM_LEGACY)
        rt.launch(STREAM_LEGACY, lambda v: v.fill(2.5), x)
        with rt.use(idle):
            b = dataclass_device(read_cai(ForeignCai(x), "buf"))
            before = io.mark(io.producer_stream(b, None), 0)
        done = io.copy_in(b, slot, before)
        gate.set()
        io.host_wait(done)
        assert (slot.view(np.float32) == 2.5).all(), "the copy-in did not wait for the legacy stream's kernel"
        rt.synchronize()
        io.close()
    finally:
        arena.close()


def test_copy_out_is_ordered_before_the_consumer_and_would_be_stale_without(rt):
    io = _io(rt)
    result = pinned(rt, 400)
    result.view(np.int32)[:] = np.arange(100, dtype=np.int32)
    consumer = rt.new_stream()
    for ordered in (True, False):
        x = rt.asarray(np.full(100, -1, np.int32))
        b = read_dlpack(x, "buf", 0, io.lane(0).d2h)
        gate = rt.hold(io.lane(0).h2d)  # the copy back is late: a reader that does not wait reads first
        done = io.copy_out(0, [(b, result)], None)
        if ordered:
            io.stream_wait(consumer, done, 0)
        seen: list[np.ndarray] = []
        rt.launch(consumer, lambda v, seen=seen: seen.append(v.copy()), x)
        if not ordered:
            read = rt.new_event()
            rt.record(read, consumer)
            rt.event_synchronize(read)  # it read with the copy still held
        gate.set()
        rt.synchronize()
        if ordered:
            assert np.array_equal(seen[0], np.arange(100))
        else:
            assert (seen[0] == -1).all()
    io.close()


def test_copy_out_waits_for_work_queued_on_its_destination(rt):
    """A broadcast's destination still being written by the caller: the result must land after that."""
    io = _io(rt)
    result = pinned(rt, 40)
    result.view(np.float32)[:] = 9.0
    compute = rt.new_stream()
    for ordered in (True, False):
        x = rt.empty((10,), np.float32)
        with rt.use(compute):
            gate = rt.hold(compute)
            rt.launch(compute, lambda v: v.fill(-1.0), x)  # the caller's own (old) contents, late
            b = read_dlpack(x, "buf", 0, io.lane(0).d2h)
            before = io.mark(io.producer_stream(b, None), 0) if ordered else None
        done = io.copy_out(0, [(b, result)], before)
        if not ordered:
            io.host_wait(done)  # landed with the caller's work still held, which then overwrites it
        gate.set()
        io.host_wait(done)
        rt.synchronize()
        assert (x.get() == (9.0 if ordered else -1.0)).all()
    io.close()


def test_unpinnable_memory_is_still_copied_correctly(rt):
    io = _io(rt)
    seg = np.zeros(4096, np.uint8)
    rt.register_host(seg.ctypes.data, 16, readonly=False)  # overlaps: pinning the segment fails
    io.pin(("in", 3), seg, readonly=False)
    x = rt.asarray(np.arange(256, dtype=np.int64))
    done = io.copy_in(read_dlpack(x, "buf", 0, io.lane(0).d2h), seg[1024 : 1024 + 2048], None)
    io.host_wait(done)
    assert np.array_equal(seg[1024 : 1024 + 2048].view(np.int64), np.arange(256))
    assert rt.stats["pageable"] == 1
    io.close()
    rt.unregister_host(seg.ctypes.data)


def test_producer_and_consumer_stream_resolution(rt):
    io = _io(rt)
    s = rt.new_stream()
    x = rt.asarray(np.zeros(4, np.float32))
    dl = read_dlpack(x, "buf", 0, io.lane(0).d2h)
    with rt.use(s):
        cai = dataclass_device(read_cai(CaiOnly(x), "buf"))
    v2 = dataclass_device(read_cai(CaiOnly(x, version=2), "buf"))
    assert io.producer_stream(dl, 77) == 77  # an explicit stream wins
    assert io.producer_stream(dl, None) == 1  # the current stream (and DLPack's handshake, for copies in)
    assert io.mark(None, 0) is None
    assert io.producer_stream(cai, None) == s  # the interface named it
    with rt.use(s):
        assert io.producer_stream(v2, None) == s  # v2 names none: the runtime's own array, its current stream
        foreign = dataclass_device(read_cai(ForeignCai(x), "buf"))
        assert foreign.library == "tests"
        assert io.producer_stream(foreign, None) == 1  # another library's: the legacy default stream
    plan = DevicePlan(0, None, None, [], None, rt.library)
    with rt.use(s):
        assert io.consumer_stream(plan) == s  # the runtime's own arrays: its current stream
        assert io.consumer_stream(DevicePlan(0, None, None, [], None, "jax")) == 1  # another's: legacy
    assert library_stream(rt, "numpy", 0) == 1
    io.close()


def test_a_torch_tensor_described_is_what_its_dlpack_export_says():
    """smddp.torch hands device tensors as described buffers (address, dtype, shape), not through a
    DLPack export: for every dtype the backend takes, at an offset into its storage and empty,
    the description is the one DLPack's own capsule gives (read on CPU tensors: only the device
    differs), and a non-contiguous tensor is refused rather than described wrongly."""
    torch = need_module("torch", "pip install -e '.[torch]'")
    from smddp.client.device.dlpack import dl_tensor
    from smddp.torch.backend import SUPPORTED_DTYPES, CudaStreams, UnsupportedCollectiveError

    streams = CudaStreams(torch.device("cuda", 3))
    for dt in SUPPORTED_DTYPES:
        base = torch.arange(40).to(dt).reshape(5, 8)
        for t in (base, base[2:], base[1:1]):
            d = streams.buf(t)
            capsule = t.__dlpack__()  # alive while its struct is read
            cap, wire, shape, count = dl_tensor(capsule, "t")
            ptr = (int(cap.data or 0) + int(cap.byte_offset)) if count else 0
            assert (d.ptr, d.dtype, d.shape, d.count) == (ptr, wire, shape, count), (dt, t.shape)
            assert (d.device, d.via, d.library, d.readonly, d.stream_given) == (
                3,
                "described",
                "torch",
                False,
                False,
            )
            assert d.keepalive is t and d.result_dtype == wire.storage
    with pytest.raises(UnsupportedCollectiveError, match="non-contiguous"):
        streams.buf(torch.zeros(4, 4).t())


def test_a_slow_pinning_holds_up_no_copy(rt):
    """cudaHostRegister touches every page of a segment: while one thread pins a new segment, another's
    copy and its bookkeeping go on; a second pin of the same segment waits for the first, and the
    segment is registered once."""
    io = _io(rt)
    result = pinned(rt, 64)  # a result segment pinned already
    result.view(np.float32)[:] = 5.0
    registering = threading.Event()
    let_go = threading.Event()
    real = rt.register_host
    calls: list[int] = []

    def slow_register(ptr: int, nbytes: int, readonly: bool = False) -> None:
        calls.append(ptr)
        registering.set()
        assert let_go.wait(20), "the test never let the registration end"
        real(ptr, nbytes, readonly)

    rt.register_host = slow_register  # type: ignore[method-assign]
    seg = np.zeros(1 << 16, np.uint8)
    pinners = [threading.Thread(target=io.pin, args=(("in", 7), seg, False)) for _ in range(2)]
    pinners[0].start()
    assert registering.wait(10)
    pinners[1].start()
    # Meanwhile, a result's copy to the device and what follows it, on other threads' behalf.
    x = rt.empty((16,), np.float32)
    b = read_dlpack(x, "buf", 0, io.lane(0).d2h)
    copied = threading.Event()
    copier = threading.Thread(
        target=lambda: (io.host_wait(io.copy_out(0, [(b, result)], None)), copied.set())
    )
    copier.start()
    assert copied.wait(10), "a copy waited behind a pinning"
    assert not let_go.is_set() and pinners[0].is_alive() and pinners[1].is_alive()
    let_go.set()
    for t in pinners:
        t.join(10)
    assert calls == [seg.ctypes.data] and seg.ctypes.data in rt.registered()
    assert np.array_equal(x.get(), np.full(16, 5.0, np.float32))
    io.close()
