"""DLPack read with ctypes, so that torch tensors (bfloat16 too) work without importing torch."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from smddp.errors import UnsupportedBufferError
from smddp.proto.dtypes import DType

SUPPORTED = "float16, bfloat16, float32, float64, int32, int64, uint8"

# DLDeviceType values (dlpack.h).
KDL_CPU = 1
KDL_CUDA = 2
KDL_ROCM = 10
KDL_CUDA_MANAGED = 13
DEVICE_NAMES = {
    2: "cuda",
    3: "cuda_host",
    4: "opencl",
    7: "vulkan",
    8: "metal",
    10: "rocm",
    13: "cuda_managed",
}

#: (DLDataTypeCode, bits) -> smddp dtype; lanes must be 1.
DL_DTYPES = {
    (0, 32): DType.INT32,
    (0, 64): DType.INT64,
    (1, 8): DType.UINT8,
    (2, 16): DType.FLOAT16,
    (2, 32): DType.FLOAT32,
    (2, 64): DType.FLOAT64,
    (4, 16): DType.BFLOAT16,
}
#: The capsule name DLPack (before 1.0) gives a tensor that has not been consumed yet.
CAPSULE_NAME = b"dltensor"


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def _capsule_pointer(capsule: Any) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return int(get(capsule, CAPSULE_NAME) or 0)


def dl_tensor(capsule: Any, what: str) -> tuple[DLTensor, DType, tuple[int, ...], int]:
    """The DLTensor of a DLPack capsule, its dtype, shape and element count; refuses an unsupported
    dtype or a non-contiguous layout (the device, host or CUDA, is for the caller to check)."""
    try:
        ptr = _capsule_pointer(capsule)
    except ValueError:
        raise UnsupportedBufferError(f"{what}: __dlpack__ did not return a DLPack tensor capsule") from None
    t = DLTensor.from_address(ptr)
    if t.dtype.lanes != 1 or (t.dtype.code, t.dtype.bits) not in DL_DTYPES:
        raise UnsupportedBufferError(
            f"{what}: DLPack dtype (code={t.dtype.code}, bits={t.dtype.bits}, lanes={t.dtype.lanes}) "
            f"is not supported (supported: {SUPPORTED})"
        )
    dt = DL_DTYPES[(t.dtype.code, t.dtype.bits)]
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if t.strides and count > 1:
        check_contiguous(shape, [int(t.strides[i]) for i in range(t.ndim)], what)
    return t, dt, shape, count


def check_contiguous(shape: tuple[int, ...], strides: list[int], what: str) -> None:
    """Strides in elements; dimensions of extent 1 may have any stride."""
    expect = 1
    for i in reversed(range(len(shape))):
        if shape[i] != 1 and strides[i] != expect:
            raise UnsupportedBufferError(
                f"{what}: the array is not C-contiguous (element strides {tuple(strides)}); "
                "make a contiguous copy first (torch: .contiguous())"
            )
        expect *= shape[i]
