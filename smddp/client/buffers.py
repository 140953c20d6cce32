"""Turning a user's buffer (numpy, buffer protocol, __array_interface__, DLPack) into a numpy view, no copies."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from smddp.client.device.dlpack import DEVICE_NAMES, KDL_CPU, SUPPORTED, dl_tensor
from smddp.errors import UnsupportedBufferError
from smddp.proto.dtypes import DType, dtype_from_numpy


@dataclass(frozen=True)
class BufferView:
    """A C-contiguous numpy view of the caller's memory (raw uint16 for bfloat16), and what it holds."""

    array: np.ndarray  # 1-D, dtype.storage, shares memory with the caller's buffer
    dtype: DType
    shape: tuple[int, ...]
    keepalive: Any = None  # the DLPack capsule, held while we use its pointer
    result_dtype: np.dtype | None = None  # dtype for new result arrays (ml_dtypes' bfloat16 stays itself)

    @property
    def count(self) -> int:
        return self.array.shape[0]

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def copy_into(self, dst: np.ndarray) -> None:
        """Copy the elements into `dst` (a shared slot, dtype.storage)."""
        dst[:] = self.array

    def piece(self, a: int, b: int) -> BufferView:
        """Elements [a, b) as a 1-D view of the same memory (a piece of a pipelined collective)."""
        return BufferView(self.array[a:b], self.dtype, (b - a,), self.keepalive, self.result_dtype)


@dataclass(frozen=True)
class PartsView:
    """Several arrays of one dtype sent as one buffer: each is copied straight into its place in the
    shared slot, so a front end's fusion buffer needs no packing copy of its own."""

    parts: tuple[BufferView, ...]
    dtype: DType
    keepalive: Any = None

    @property
    def count(self) -> int:
        return sum(p.count for p in self.parts)

    def copy_into(self, dst: np.ndarray) -> None:
        at = 0
        for p in self.parts:
            dst[at : at + p.count] = p.array
            at += p.count

    def piece(self, a: int, b: int) -> PartsView:
        """Elements [a, b) of the concatenation, as the pieces of the parts that hold them."""
        pieces: list[BufferView] = []
        at = 0
        for p in self.parts:
            lo, hi = max(a, at), min(b, at + p.count)
            if lo < hi:
                pieces.append(p.piece(lo - at, hi - at))
            at += p.count
        return PartsView(tuple(pieces), self.dtype, self.keepalive)


def as_parts(bufs: Any, what: str = "parts") -> PartsView:
    """Host arrays of one dtype as a PartsView (read only); refused like as_buffer, before any I/O."""
    views = tuple(as_buffer(b, writable=False, what=f"{what}[{i}]") for i, b in enumerate(bufs))
    if not views:
        raise UnsupportedBufferError(f"{what}: no arrays")
    for i, v in enumerate(views):
        if v.dtype != views[0].dtype:
            raise UnsupportedBufferError(
                f"{what}[{i}]: dtype {v.dtype.label} differs from {what}[0]'s {views[0].dtype.label}"
            )
    return PartsView(views, views[0].dtype, keepalive=tuple(v.keepalive for v in views))


def as_buffer(buf: Any, writable: bool, what: str = "buffer") -> BufferView:
    """The caller's buffer as a BufferView; refuses anything smddp cannot use in place, before any I/O."""
    if isinstance(buf, np.ndarray):
        return _from_numpy(buf, writable, what)
    if hasattr(buf, "__dlpack__") and not hasattr(buf, "__array_interface__"):
        return _from_dlpack(buf, writable, what)
    if hasattr(buf, "__array_interface__"):
        return _from_numpy(np.asarray(buf), writable, what)
    try:
        mv = memoryview(buf)
    except TypeError:
        raise UnsupportedBufferError(
            f"{what}: {type(buf).__name__} is not an array smddp can use "
            "(numpy, the buffer protocol, __array_interface__ or DLPack)"
        ) from None
    return _from_numpy(np.asarray(mv), writable, what)


def _from_numpy(arr: np.ndarray, writable: bool, what: str) -> BufferView:
    dt = dtype_from_numpy(arr.dtype)
    if dt is None:
        raise UnsupportedBufferError(f"{what}: dtype {arr.dtype} is not supported (supported: {SUPPORTED})")
    if not arr.flags.c_contiguous:
        raise UnsupportedBufferError(f"{what}: the array is not C-contiguous (make a contiguous copy first)")
    if writable and not arr.flags.writeable:
        raise UnsupportedBufferError(f"{what}: the array is read-only, and this collective writes into it")
    flat = arr.reshape(-1).view(dt.storage)
    return BufferView(flat, dt, tuple(arr.shape), result_dtype=arr.dtype)


def _from_dlpack(buf: Any, writable: bool, what: str) -> BufferView:
    try:
        capsule = buf.__dlpack__()
    except (BufferError, RuntimeError, TypeError) as e:
        raise UnsupportedBufferError(
            f"{what}: cannot export {type(buf).__name__} through DLPack: {e}"
        ) from None
    t, dt, shape, count = dl_tensor(capsule, what)
    if t.device.device_type != KDL_CPU:
        dev = DEVICE_NAMES.get(t.device.device_type, f"device type {t.device.device_type}")
        raise UnsupportedBufferError(
            f"{what}: the tensor lives on {dev}:{t.device.device_id}; smddp takes CPU memory"
        )
    if count == 0:
        arr = np.empty(0, dt.storage)
    else:
        raw = (ctypes.c_char * (count * dt.itemsize)).from_address(t.data + t.byte_offset)
        arr = np.frombuffer(memoryview(raw).cast("B"), dtype=dt.storage)
    # DLPack (before 1.0) has no read-only flag; the torch tensors it exports are writable.
    del writable
    return BufferView(arr, dt, shape, keepalive=(buf, capsule))
