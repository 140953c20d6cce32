"""Element types and reduction ops as they appear on the wire."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


class DType(enum.IntEnum):
    """Element type of a buffer; bfloat16 has no numpy dtype, so it travels as raw uint16 bits."""

    UINT8 = 1
    INT32 = 2
    INT64 = 3
    FLOAT16 = 4
    BFLOAT16 = 5
    FLOAT32 = 6
    FLOAT64 = 7

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype that holds the raw elements (uint16 for bfloat16)."""
        found = _STORAGE.get(self)
        return found if found is not None else _numpy_dtypes()[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)

    @property
    def accumulator(self) -> np.dtype:
        """The dtype sums are carried in: float32 for the 16-bit floats, else the type itself."""
        if self in (DType.FLOAT16, DType.BFLOAT16):
            return DType.FLOAT32.storage
        return self.storage

    @property
    def label(self) -> str:
        return self.name.lower()


_ITEMSIZE: dict[DType, int] = {
    DType.UINT8: 1,
    DType.INT32: 4,
    DType.INT64: 8,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
}

# The numpy dtypes, made on first use: the wire needs none, and the daemon and the launcher, which
# import this module and never hold an array, then start without numpy (a third of their start-up).
_STORAGE: dict[DType, np.dtype] = {}

_FROM_NUMPY = {
    "uint8": DType.UINT8,
    "int32": DType.INT32,
    "int64": DType.INT64,
    "float16": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16,  # ml_dtypes' bfloat16, recognised by name so we need not import it
    "float32": DType.FLOAT32,
    "float64": DType.FLOAT64,
}


# Native-order numpy dtypes by identity: a dict hit costs far less than `dtype.name` (computed in
# Python by numpy on every access), and this runs on every collective call. Filled with _STORAGE.
_BY_DTYPE: dict[np.dtype, DType] = {}


def _numpy_dtypes() -> dict[DType, np.dtype]:
    """Fill _STORAGE and _BY_DTYPE (numpy imported here); returns the storage dtypes, whole. (Threads
    may fill them at once, with the same values; a reader of one half filled misses, and asks here.)"""
    import numpy as np

    storage = {dt: np.dtype("uint16" if dt is DType.BFLOAT16 else dt.label) for dt in DType}
    _BY_DTYPE.update({np.dtype(name): dt for name, dt in _FROM_NUMPY.items() if name != "bfloat16"})
    _STORAGE.update(storage)
    return storage


def dtype_from_numpy(dt: np.dtype) -> DType | None:
    """The wire dtype for a numpy dtype, or None when smddp does not carry it."""
    hit = _BY_DTYPE.get(dt)
    if hit is not None:
        return hit
    if not _BY_DTYPE:
        _numpy_dtypes()
    if dt.byteorder == ">":
        return None
    return _FROM_NUMPY.get(dt.name)


class ReduceOp(enum.IntEnum):
    """Reduction applied by an all-reduce or reduce-scatter."""

    SUM = 1
    AVG = 2
    MIN = 3
    MAX = 4


class Kind(enum.IntEnum):
    """Which collective a frame belongs to (part of the fingerprint every rank must agree on)."""

    ALLREDUCE = 1
    BROADCAST = 2
    ALLGATHER = 3
    REDUCE_SCATTER = 4
    BARRIER = 5

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def is_gather(self) -> bool:
        """Gather-style collectives move blocks to everyone instead of reducing shards."""
        return self in (Kind.BROADCAST, Kind.ALLGATHER)
