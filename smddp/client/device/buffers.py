"""CUDA buffers read in place: the CUDA Array Interface and DLPack, and the caller's streams."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from smddp.client.device.dlpack import (
    KDL_CUDA,
    KDL_CUDA_MANAGED,
    KDL_ROCM,
    SUPPORTED,
    check_contiguous,
    dl_tensor,
)
from smddp.client.device.runtime import STREAM_LEGACY, DeviceRuntime
from smddp.errors import InvalidArgumentError, UnsupportedBufferError
from smddp.proto.dtypes import DType, dtype_from_numpy


@dataclass(frozen=True)
class DeviceBuffer:
    """A contiguous range of device memory that the caller handed smddp, and what it holds."""

    ptr: int
    dtype: DType
    shape: tuple[int, ...]
    count: int
    device: int
    readonly: bool
    stream: int | None  # the stream the producer named (CUDA Array Interface v3), else None
    stream_given: bool  # the producer named a stream or said None ("no synchronization needed")
    via: str  # "cai", "dlpack" or "described" (by its framework's front end: described())
    library: str  # top-level module of the buffer's type: "torch" answers current_stream itself
    result_dtype: np.dtype  # dtype for result arrays smddp allocates (raw uint16 for DLPack bfloat16)
    keepalive: Any = None

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def device_kind(buf: Any) -> tuple[str, int] | None:
    """("dlpack" | "cai", device id or -1) when `buf` is CUDA memory; None for host memory. Exports nothing.

    DLPack's device query is asked first: it is cheap, and torch's CUDA Array Interface fails for
    bfloat16 and for tensors that require grad, where DLPack works.
    """
    if isinstance(buf, np.ndarray):
        return None
    query = getattr(buf, "__dlpack_device__", None)
    if query is not None:
        try:
            dev_type, dev_id = query()
        except Exception:
            dev_type, dev_id = None, -1
        if dev_type in (KDL_CUDA, KDL_CUDA_MANAGED):
            return "dlpack", int(dev_id)
        if dev_type == KDL_ROCM:
            raise UnsupportedBufferError(
                "buffer: the tensor lives on a ROCm device; smddp's device path is CUDA"
            )
        if dev_type is not None:
            return None  # host memory (or a device as_buffer refuses by name)
    try:
        _ = buf.__cuda_array_interface__
    except AttributeError:
        return None
    except Exception:
        return "cai", -1  # it has one and reading it failed: read_cai says why
    return "cai", -1


def read_cai(buf: Any, what: str) -> DeviceBuffer:
    """The CUDA Array Interface (v2 or v3) of `buf`; device -1 (the runtime finds it from the pointer)."""
    try:
        cai = buf.__cuda_array_interface__
    except Exception as e:
        raise UnsupportedBufferError(
            f"{what}: {type(buf).__name__}.__cuda_array_interface__ failed: {e!r}"
        ) from None
    try:
        shape = tuple(int(n) for n in cai["shape"])
        typestr = cai["typestr"]
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedBufferError(f"{what}: malformed __cuda_array_interface__ ({e!r})") from None
    if cai.get("mask") is not None:
        raise UnsupportedBufferError(f"{what}: masked CUDA arrays are not supported")
    try:
        np_dtype = np.dtype(typestr)
    except TypeError:
        np_dtype = None
    dt = dtype_from_numpy(np_dtype) if np_dtype is not None else None
    if dt is None or np_dtype is None:
        raise UnsupportedBufferError(f"{what}: dtype {typestr!r} is not supported (supported: {SUPPORTED})")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    strides = cai.get("strides")
    if strides is not None and count > 1:
        if any(int(s) % dt.itemsize for s in strides):
            raise UnsupportedBufferError(f"{what}: strides {tuple(strides)} are not whole elements")
        check_contiguous(shape, [int(s) // dt.itemsize for s in strides], what)
    stream_given = int(cai.get("version", 0)) >= 3 and "stream" in cai
    stream = cai.get("stream") if stream_given else None
    if stream is not None:
        stream = int(stream)
        if stream == 0:
            raise UnsupportedBufferError(
                f"{what}: __cuda_array_interface__ names stream 0, which the interface (v3) forbids"
            )
    return DeviceBuffer(
        ptr=int(ptr or 0),
        dtype=dt,
        shape=shape,
        count=count,
        device=-1,
        readonly=bool(readonly),
        stream=stream,
        stream_given=stream_given,
        via="cai",
        library=library_of(buf),
        result_dtype=np_dtype,
        keepalive=buf,
    )


def read_dlpack(buf: Any, what: str, device: int, consumer_stream: int) -> DeviceBuffer:
    """Export `buf` through DLPack for use on `consumer_stream`: the producer orders its work before it."""
    try:
        capsule = buf.__dlpack__(stream=consumer_stream)
    except TypeError:
        try:
            capsule = buf.__dlpack__()  # a producer from before the `stream` argument
        except Exception as e:
            raise UnsupportedBufferError(
                f"{what}: cannot export {type(buf).__name__} through DLPack: {e}"
            ) from None
    except Exception as e:
        raise UnsupportedBufferError(
            f"{what}: cannot export {type(buf).__name__} through DLPack: {e}"
        ) from None
    t, dt, shape, count = dl_tensor(capsule, what)
    if t.device.device_type not in (KDL_CUDA, KDL_CUDA_MANAGED) or t.device.device_id != device:
        raise UnsupportedBufferError(
            f"{what}: __dlpack__ exported device ({t.device.device_type}, {t.device.device_id}), "
            f"but __dlpack_device__ said cuda:{device}"
        )
    return DeviceBuffer(
        ptr=int(t.data or 0) + int(t.byte_offset),
        dtype=dt,
        shape=shape,
        count=count,
        device=device,
        readonly=False,  # DLPack before 1.0 has no read-only flag
        stream=None,
        stream_given=False,
        via="dlpack",
        library=library_of(buf),
        result_dtype=dt.storage,
        keepalive=(buf, capsule),
    )


def described(
    ptr: int, dtype: DType, shape: tuple[int, ...], device: int, library: str, keepalive: Any
) -> DeviceBuffer:
    """A contiguous device buffer as the framework that owns it describes it (address, dtype, shape,
    device), read without an export: a front end's tensors (smddp.torch), where a DLPack export costs
    an estimated 30 us on a GPU's host (torch's __dlpack__ makes a stream wait for the current one
    in Python). Nothing is ordered here: the collective's `stream=` must name the stream that
    produced it. `keepalive` holds the memory (and is what the device runtime is asked to refuse or
    take)."""
    count = 1
    for n in shape:
        count *= n
    return DeviceBuffer(
        ptr=ptr if count else 0,
        dtype=dtype,
        shape=shape,
        count=count,
        device=device,
        readonly=False,
        stream=None,
        stream_given=False,
        via="described",
        library=library,
        result_dtype=dtype.storage,
        keepalive=keepalive,
    )


def library_of(buf: Any) -> str:
    return type(buf).__module__.partition(".")[0]


def stream_handle(stream: Any) -> int:
    """A stream argument as a raw handle: an int, a torch.cuda.Stream, a cupy.cuda.Stream, or __cuda_stream__."""
    if isinstance(stream, bool):
        raise InvalidArgumentError(f"stream must be a CUDA stream or its handle, got {stream!r}")
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        _version, ptr = proto()
        return int(ptr)
    for attr in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attr, None)
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value)
    raise InvalidArgumentError(f"stream must be a CUDA stream or its handle, got {type(stream).__name__}")


def library_stream(rt: DeviceRuntime, library: str, device: int) -> int:
    """The stream a buffer that names none (CUDA Array Interface v2, DLPack, a consumer at wait())
    is ordered against: the calling thread's current stream of the library that made it, where smddp
    knows that library's notion of one (torch keeps its own; the runtime's own library, CuPy, is the
    runtime's current stream); else the legacy default stream. A library smddp does not know names
    no current stream it could read, and its v2 buffers predate streams in the interface: their
    producers worked on the legacy default stream, which every blocking stream is ordered with, or
    synchronised before the export. CuPy's current stream would order against an unrelated stream."""
    if library == "torch":
        torch = sys.modules.get("torch")
        if torch is not None:
            return int(torch.cuda.current_stream(device).cuda_stream)
    if library == getattr(rt, "library", None):  # (a registered runtime may not say)
        return rt.current_stream(device)
    return STREAM_LEGACY
