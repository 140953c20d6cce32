"""The engine's kernel for uint8, int32, int64, float32 and float64 gives numpy's bits: special values
(NaN payloads, signalling NaNs, signed zeros, infinities, subnormals, integer overflow and negative
averages), every op, 1 to 6 inputs, any length, with `out` aliasing an input or not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smddp_rigs import _engine_testing

from smddp.proto.dtypes import DType, ReduceOp

TYPES = [DType.UINT8, DType.INT32, DType.INT64, DType.FLOAT32, DType.FLOAT64]

SPECIAL = {
    DType.FLOAT32: [0x7FC00001, 0x7FC00002, 0x7F800001, 0xFF800003, 0x00000000, 0x80000000, 0x7F800000,
                    0xFF800000, 0x00000001, 0x80000001, 0x3F800000, 0x7F7FFFFF, 0xFF7FFFFF],
    DType.FLOAT64: [0x7FF8000000000001, 0x7FF8000000000002, 0x7FF0000000000001, 0xFFF0000000000003, 0,
                    0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000, 1, 0x8000000000000001,
                    0x3FF0000000000000, 0x7FEFFFFFFFFFFFFF],
}  # fmt: skip
UINT = {DType.FLOAT32: np.uint32, DType.FLOAT64: np.uint64}


def numpy_fold(
    inputs: list[np.ndarray], out: np.ndarray, dtype: DType, op: ReduceOp, divisor: int | None
) -> None:
    """numpy's ufuncs folded left to right; an average divides once at the end (None: a plain sum),
    an integer average truncating toward zero as C division does."""
    fn = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}[op]
    with np.errstate(all="ignore"):
        acc = inputs[0].copy()
        for x in inputs[1:]:
            fn(acc, x, out=acc)
        if op == ReduceOp.AVG and divisor is not None:
            if dtype.is_float:
                np.divide(acc, acc.dtype.type(divisor), out=acc)
            else:
                d = np.int64(divisor)  # a divisor above the dtype's range (uint8, 256 ranks) stays exact
                q = np.floor_divide(acc, d)
                if np.issubdtype(acc.dtype, np.signedinteger):
                    q += ((acc % d) != 0) & (acc < 0)
                acc = q.astype(dtype.storage)
    np.copyto(out, acc, casting="unsafe")


def values(dtype: DType, n: int, rng: np.random.Generator) -> np.ndarray:
    st_ = dtype.storage
    if dtype in SPECIAL:
        bits = rng.choice(np.array(SPECIAL[dtype], dtype=UINT[dtype]), n)
        x = bits.view(st_).copy()
        normal = rng.random(n) < 0.5
        x[normal] = rng.standard_normal(int(normal.sum())).astype(st_) * 1e3
        return x
    info = np.iinfo(st_)
    edge = np.array([info.min, info.max, 0, 1, -1 if info.min < 0 else 2], dtype=np.int64).astype(st_)
    x = rng.integers(info.min, info.max, n, dtype=st_, endpoint=True)
    pick = rng.random(n) < 0.3
    x[pick] = rng.choice(edge, int(pick.sum()))
    return x


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(TYPES),
    st.sampled_from(list(ReduceOp)),
    st.integers(1, 9),  # 2, 3, 4 and 8 take the one-pass loops, the others the general one
    st.integers(0, 9000),
    st.sampled_from([None, 1, 2, 3, 7, 64]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_engine_kernel_gives_numpys_bits(dtype, op, k, n, divisor, alias, seed):
    rng = np.random.default_rng(seed)
    inputs = [values(dtype, n, rng) for _ in range(k)]
    want = np.empty(n, dtype.storage)
    numpy_fold([x.copy() for x in inputs], want, dtype, op, divisor)
    div = divisor if op == ReduceOp.AVG and divisor is not None else 0
    if alias:
        out = inputs[-1]  # the engine's daemon reduces into an input's memory this way
        _engine_testing.reduce(int(dtype), int(op), inputs, out, div)
    else:
        out = np.full(n, 7, dtype.storage)
        _engine_testing.reduce(int(dtype), int(op), inputs, out, div)
    if dtype.is_float:
        # Where two NaNs meet, numpy itself returns one or the other depending on the array's
        # length (its vector loop takes the second, its scalar loop the first): a NaN is a NaN
        # there, and which payload the engine keeps is its own rule, checked below.
        both = np.isnan(out) & np.isnan(want)
        out, want = out[~both], want[~both]
    assert out.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT64])
def test_where_nans_meet_the_first_one_wins(dtype):
    """The engine's own rule, whatever the length: sum keeps the first NaN (quieted), min and max
    keep the first NaN as it is; a NaN made by inf - inf is the first NaN of the next addition."""
    u = UINT[dtype]
    q = 0x00400000 if dtype == DType.FLOAT32 else 0x0008000000000000
    nan1, snan3 = SPECIAL[dtype][0], SPECIAL[dtype][2]
    for n in (1, 3, 17, 100, 5000):
        a = np.full(n, nan1, u).view(dtype.storage)
        s = np.full(n, snan3, u).view(dtype.storage)
        one = np.ones(n, dtype.storage)
        out = np.empty(n, dtype.storage)
        for op, inputs, want in [
            (ReduceOp.SUM, [a, s], nan1),
            (ReduceOp.SUM, [s, a], snan3 | q),
            (ReduceOp.SUM, [one, s], snan3 | q),
            (ReduceOp.AVG, [s, one], snan3 | q),
            (ReduceOp.MIN, [s, a], snan3),
            (ReduceOp.MAX, [one, s, a], snan3),
            (ReduceOp.SUM, [np.full(n, np.inf, dtype.storage), np.full(n, -np.inf, dtype.storage), a], None),
        ]:
            _engine_testing.reduce(int(dtype), int(op), inputs, out, 2 if op == ReduceOp.AVG else 0)
            got = out.view(u)
            if want is None:  # inf - inf: the CPU's default NaN, then kept by the next addition
                assert np.isnan(out).all() and (got == got[0]).all() and got[0] != nan1
            else:
                assert (got == want).all(), (op, n, hex(got[0]), hex(want))


def test_refusals():
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="dtype 8 is not a wire dtype"):
        _engine_testing.reduce(8, 1, [a], a, 0)
    with pytest.raises(ValueError, match="unknown op"):
        _engine_testing.reduce(int(DType.FLOAT32), 9, [a], a, 0)
    with pytest.raises(ValueError, match="between 1 and"):
        _engine_testing.reduce(int(DType.FLOAT32), 1, [], a, 0)
    with pytest.raises(ValueError, match="input 1 holds 8 bytes"):
        _engine_testing.reduce(int(DType.FLOAT32), 1, [a, a[:2]], a, 0)
    with pytest.raises(ValueError, match="not whole elements"):
        _engine_testing.reduce(int(DType.FLOAT32), 1, [a.view(np.uint8)[:6]], a.view(np.uint8)[:6], 0)
    with pytest.raises(BufferError):
        _engine_testing.reduce(int(DType.FLOAT32), 1, [a], bytes(16), 0)  # read-only out
    with pytest.raises(ValueError, match="not C-contiguous"):
        _engine_testing.reduce(int(DType.FLOAT32), 1, [a[::2]], a[:2], 0)
