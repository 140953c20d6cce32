"""as_buffer: every kind of caller buffer becomes a zero-copy numpy view, or is refused up front."""

from __future__ import annotations

import array
import itertools

import ml_dtypes
import numpy as np
import pytest

from smddp.client.buffers import BufferView, as_buffer, as_parts
from smddp.client.collectives import pieces
from smddp.errors import InvalidArgumentError, UnsupportedBufferError
from smddp.proto import DType
from tests.conftest import need_module

NUMPY_DTYPES = [
    (np.uint8, DType.UINT8),
    (np.int32, DType.INT32),
    (np.int64, DType.INT64),
    (np.float16, DType.FLOAT16),
    (ml_dtypes.bfloat16, DType.BFLOAT16),
    (np.float32, DType.FLOAT32),
    (np.float64, DType.FLOAT64),
]


def check_shares(view: BufferView, original, read_back) -> None:
    """Write through the view and see the caller's buffer change (and back)."""
    assert view.count > 0
    before = view.array.copy()
    raw = view.array.view(np.uint8)
    raw[:] = 0x3C  # a pattern that is a valid element in every dtype
    assert read_back(original) == bytes(raw), "the view does not share the caller's memory"
    view.array[:] = before
    assert read_back(original) == before.tobytes()


def np_bytes(a) -> bytes:
    return np.asarray(a).tobytes()


def test_unsupported_is_an_invalid_argument_and_a_type_error():
    assert issubclass(UnsupportedBufferError, InvalidArgumentError)
    assert issubclass(UnsupportedBufferError, TypeError)


@pytest.mark.parametrize("np_dtype,wire", NUMPY_DTYPES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_numpy_arrays(np_dtype, wire):
    a = (np.arange(12).reshape(3, 4) % 7).astype(np_dtype)
    v = as_buffer(a, writable=True)
    assert v.dtype is wire
    assert v.shape == (3, 4)
    assert v.count == 12 and v.nbytes == 12 * wire.itemsize
    assert v.array.ndim == 1 and v.array.dtype == wire.storage
    assert v.result_dtype == np.dtype(np_dtype)
    assert np.shares_memory(v.array, a)
    check_shares(v, a, np_bytes)


def test_bfloat16_is_carried_as_raw_bits():
    a = np.array([1.0, -2.5, 3.0], ml_dtypes.bfloat16)
    v = as_buffer(a, writable=False)
    assert v.dtype is DType.BFLOAT16 and v.array.dtype == np.uint16
    assert v.array.tolist() == [0x3F80, 0xC020, 0x4040]


def test_zero_d_and_empty_arrays():
    s = np.array(5.0, np.float32)
    v = as_buffer(s, writable=True)
    assert v.shape == () and v.count == 1
    v.array[0] = 7.0
    assert s == 7.0
    e = np.zeros((0, 3), np.int64)
    ve = as_buffer(e, writable=True)
    assert ve.count == 0 and ve.shape == (0, 3) and ve.dtype is DType.INT64


def test_bytearray():
    b = bytearray(b"hello world")
    v = as_buffer(b, writable=True)
    assert v.dtype is DType.UINT8 and v.count == 11
    check_shares(v, b, bytes)


def test_memoryview():
    backing = bytearray(64)
    m = memoryview(backing)
    v = as_buffer(m, writable=True)
    assert v.dtype is DType.UINT8 and v.count == 64
    check_shares(v, backing, bytes)
    ints = memoryview(bytearray(16)).cast("i")
    vi = as_buffer(ints, writable=True)
    assert vi.dtype is DType.INT32 and vi.count == 4


def test_array_array():
    a = array.array("d", [1.0, 2.0, 3.5])
    v = as_buffer(a, writable=True)
    assert v.dtype is DType.FLOAT64 and v.count == 3
    assert v.array.tolist() == [1.0, 2.0, 3.5]
    check_shares(v, a, lambda x: x.tobytes())
    v.array[1] = 42.0
    assert a[1] == 42.0


class OnlyArrayInterface:
    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr
        self.__array_interface__ = arr.__array_interface__


class OnlyDLPack:
    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def __dlpack__(self, *a, **k):
        return self._arr.__dlpack__()

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def test_array_interface_object():
    arr = np.arange(10, dtype=np.float32)
    obj = OnlyArrayInterface(arr)
    assert not hasattr(obj, "__dlpack__") and not hasattr(obj, "__buffer__")
    v = as_buffer(obj, writable=True)
    assert v.dtype is DType.FLOAT32 and v.count == 10
    check_shares(v, arr, np_bytes)


@pytest.mark.parametrize("np_dtype,wire", [d for d in NUMPY_DTYPES if d[0] is not ml_dtypes.bfloat16])
def test_dlpack_object(np_dtype, wire):
    arr = (np.arange(24).reshape(2, 3, 4) % 5).astype(np_dtype)
    obj = OnlyDLPack(arr)
    v = as_buffer(obj, writable=True)
    assert v.dtype is wire
    assert v.shape == (2, 3, 4) and v.count == 24
    assert v.array.dtype == wire.storage
    assert v.array.tobytes() == arr.tobytes()
    assert v.keepalive is not None
    check_shares(v, arr, np_bytes)


def test_dlpack_object_with_offset_and_empty():
    base = np.arange(20, dtype=np.int32)
    v = as_buffer(OnlyDLPack(base[5:9]), writable=True)
    assert v.array.tolist() == [5, 6, 7, 8]
    v.array[0] = -1
    assert base[5] == -1 and base[4] == 4
    e = as_buffer(OnlyDLPack(np.zeros(0, np.float32)), writable=True)
    assert e.count == 0 and e.dtype is DType.FLOAT32


def test_dlpack_refusals():
    with pytest.raises(UnsupportedBufferError, match="contiguous"):
        as_buffer(OnlyDLPack(np.arange(10, dtype=np.float32)[::2]), writable=False)
    with pytest.raises(UnsupportedBufferError, match="contiguous"):
        as_buffer(OnlyDLPack(np.zeros((3, 4), np.float32).T), writable=False)
    for dt in (np.int16, np.complex64, np.bool_, np.uint16, np.int8):
        with pytest.raises(UnsupportedBufferError):
            as_buffer(OnlyDLPack(np.zeros(4, dt)), writable=False)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(UnsupportedBufferError):
        as_buffer(OnlyDLPack(ro), writable=True)

    class NotACapsule:
        def __dlpack__(self, *a, **k):
            return object()

    with pytest.raises(UnsupportedBufferError):
        as_buffer(NotACapsule(), writable=False)


def test_refuses_non_contiguous():
    a = np.arange(20, dtype=np.float32)
    with pytest.raises(UnsupportedBufferError, match="contiguous"):
        as_buffer(a[::2], writable=False)
    with pytest.raises(UnsupportedBufferError, match="contiguous"):
        as_buffer(np.zeros((4, 5), np.float64, order="F"), writable=False)
    with pytest.raises(UnsupportedBufferError, match="contiguous"):
        as_buffer(memoryview(bytearray(10))[::2], writable=False)
    with pytest.raises(UnsupportedBufferError):
        as_buffer(np.broadcast_to(np.zeros(1, np.float32), (8,)), writable=False)


def test_refuses_read_only_when_writing():
    a = np.zeros(4, np.float32)
    a.flags.writeable = False
    with pytest.raises(UnsupportedBufferError, match="read-only"):
        as_buffer(a, writable=True)
    assert as_buffer(a, writable=False).count == 4
    with pytest.raises(UnsupportedBufferError, match="read-only"):
        as_buffer(b"immutable", writable=True)
    assert as_buffer(b"immutable", writable=False).count == 9
    with pytest.raises(UnsupportedBufferError, match="read-only"):
        as_buffer(memoryview(bytearray(8)).toreadonly(), writable=True)


UNSUPPORTED = [np.int16, np.uint16, np.int8, np.uint32, np.uint64, np.complex64, np.complex128, np.bool_]
if hasattr(np, "float128"):
    UNSUPPORTED.append(np.float128)


@pytest.mark.parametrize("dt", UNSUPPORTED, ids=lambda d: np.dtype(d).name)
def test_refuses_unsupported_dtypes(dt):
    with pytest.raises(UnsupportedBufferError, match="not supported"):
        as_buffer(np.zeros(4, dt), writable=False)


@pytest.mark.parametrize("code", ["h", "b", "f"])
def test_refuses_unsupported_array_array(code):
    if code == "f":  # float32 is supported: the control case
        assert as_buffer(array.array(code, [1.0]), writable=False).dtype is DType.FLOAT32
        return
    with pytest.raises(UnsupportedBufferError):
        as_buffer(array.array(code, [1, 2]), writable=False)


@pytest.mark.parametrize("dt", [">f4", ">f8", ">i4", ">i8", ">f2"])
def test_refuses_big_endian(dt):
    with pytest.raises(UnsupportedBufferError):
        as_buffer(np.zeros(4, dt), writable=False)
    # the same values in native order are fine
    assert as_buffer(np.zeros(4, dt).astype(np.dtype(dt).newbyteorder("=")), writable=False).count == 4


@pytest.mark.parametrize("obj", [[1.0, 2.0], (1, 2), "text", 3.0, None, {"a": 1}], ids=repr)
def test_refuses_non_buffers(obj):
    with pytest.raises(UnsupportedBufferError):
        as_buffer(obj, writable=False)


def test_torch_cpu_tensors():
    torch = need_module("torch", "pip install -e '.[torch]'")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    v = as_buffer(t, writable=True)
    assert v.dtype is DType.FLOAT32 and v.shape == (3, 4) and v.count == 12
    v.array[5] = -1.0
    assert t[1, 1].item() == -1.0
    b = torch.tensor([1.0, -2.5, 3.0], dtype=torch.bfloat16)
    vb = as_buffer(b, writable=True)
    assert vb.dtype is DType.BFLOAT16 and vb.array.dtype == np.uint16
    assert vb.array.tolist() == [0x3F80, 0xC020, 0x4040]
    vb.array[0] = 0x4000  # 2.0
    assert b[0].item() == 2.0
    with pytest.raises(UnsupportedBufferError, match="contiguous"):
        as_buffer(t.t(), writable=False)
    with pytest.raises(UnsupportedBufferError):
        as_buffer(torch.zeros(3, dtype=torch.int16), writable=False)


def test_parts_are_copied_one_after_another_without_packing():
    a, b = np.arange(5, dtype=np.float32), np.arange(10, 13, dtype=np.float32).reshape(3, 1)
    pv = as_parts([a, b])
    assert pv.dtype is DType.FLOAT32 and pv.count == 8
    assert np.shares_memory(pv.parts[0].array, a) and np.shares_memory(pv.parts[1].array, b)  # no copies
    dst = np.full(8, -1, np.float32)
    pv.copy_into(dst)
    assert dst.tolist() == [0, 1, 2, 3, 4, 10, 11, 12]


def test_parts_of_different_dtypes_or_none_are_refused():
    with pytest.raises(UnsupportedBufferError, match=r"parts\[1\]: dtype float64 differs"):
        as_parts([np.ones(2, np.float32), np.ones(2, np.float64)])
    with pytest.raises(UnsupportedBufferError, match="no arrays"):
        as_parts([])
    with pytest.raises(UnsupportedBufferError, match=r"parts\[0\].*C-contiguous"):
        as_parts([np.ones((4, 4), np.float32)[:, 1]])


@pytest.mark.parametrize(
    ("count", "itemsize", "piece_bytes"),
    [(0, 4, 16), (4, 4, 16), (5, 4, 16), (1000, 4, 4096), (1001, 4, 4096), (16 << 20, 4, 8 << 20), (7, 2, 0)],
)
def test_pieces_cover_the_buffer_in_order_and_respect_the_size(count, itemsize, piece_bytes):
    ranges = pieces(count, itemsize, piece_bytes)
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    if piece_bytes and count * itemsize > piece_bytes:
        sizes = [b - a for a, b in ranges]
        assert len(ranges) > 1 and max(sizes) * itemsize <= piece_bytes and max(sizes) - min(sizes) <= 1
    else:
        assert ranges == [(0, count)]


def test_pieces_of_parts_and_views_share_memory_and_cut_across_parts():
    a = np.arange(5, dtype=np.float32)
    b = np.arange(5, 12, dtype=np.float32)
    pv = as_parts([a, b])
    got = np.full(6, -1, np.float32)
    piece = pv.piece(3, 9)
    assert [p.count for p in piece.parts] == [2, 4] and piece.count == 6
    assert all(np.shares_memory(p.array, src) for p, src in zip(piece.parts, (a, b), strict=True))
    piece.copy_into(got)
    assert got.tolist() == list(range(3, 9))
    view = as_buffer(b, writable=True).piece(2, 5)
    assert view.count == 3 and np.shares_memory(view.array, b) and view.array.tolist() == [7, 8, 9]
