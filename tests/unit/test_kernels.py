"""The reduction kernels, bit for bit against the independent reference in tests/reference.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from smddp import _engine
from smddp.daemon.kernels import Reducer, bf16_to_f32, f32_to_bf16
from smddp.proto.dtypes import DType, ReduceOp
from tests import reference as ref

DTYPES = ref.DTYPES
OPS = ref.OPS
LENGTHS = [0, 1, 7, 1000, 4099]


def wire(dtype: str) -> DType:
    return DType[dtype.upper()]


def wire_op(op: str) -> ReduceOp:
    return ReduceOp[op.upper()]


def bits(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x).view(np.uint8).tobytes()


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    if bits(got) == bits(want):
        return
    g = got.view(np.uint8).reshape(len(got), -1)
    w = want.view(np.uint8).reshape(len(want), -1)
    bad = np.flatnonzero((g != w).any(axis=1))
    i = int(bad[0])
    raise AssertionError(
        f"{what}: {len(bad)} of {len(got)} elements differ; first at {i}: got {got[i]!r} "
        f"({bits(got[i : i + 1]).hex()}), want {want[i]!r} ({bits(want[i : i + 1]).hex()})"
    )


# -- data ------------------------------------------------------------------------------------------

_SPECIALS = {
    "float16": np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, -65504.0, 6e-8, 6.1e-5], np.float16
    ),
    "float32": np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-45, 1.2e-38], np.float32
    ),
    "float64": np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.7976931348623157e308, -1.7e308, 5e-324, 2.3e-308],
        np.float64,
    ),
    # canonical quiet NaNs (0x7fc0, 0xffc0), infinities, zeros, max finite, a subnormal, min normal
    "bfloat16": np.array(
        [0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x7F7F, 0xFF7F, 0x0001, 0x0080], np.uint16
    ),
}


def gen(dtype: str, n: int, rng: np.random.Generator, specials: bool = True) -> np.ndarray:
    """Random elements of `dtype` (raw storage): negatives, huge magnitudes, and NaN/inf for floats."""
    st = ref.storage(dtype)
    if dtype == "uint8":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if dtype in ("int32", "int64"):
        info = np.iinfo(st)
        x = rng.integers(info.min, info.max, n, dtype=st, endpoint=True)
        pick = rng.random(n)
        small = rng.integers(-1000, 1000, n, dtype=st)
        x = np.where(pick < 0.4, small, x)
        near_max = (info.max - rng.integers(0, 50, n)).astype(st)
        near_min = (info.min + rng.integers(0, 50, n)).astype(st)
        x = np.where((pick >= 0.4) & (pick < 0.55), near_max, x)
        x = np.where((pick >= 0.55) & (pick < 0.7), near_min, x)
        return x.astype(st)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    # Most values of like magnitude (where summation order and rounding show), some tiny or
    # subnormal, some near the largest finite value (so that sums overflow).
    pick = rng.random(n)
    lo, hi, top = {"float16": (-26, 15, 14), "bfloat16": (-135, 127, 126), "float32": (-150, 127, 126)}.get(
        dtype, (-1075, 1023, 1022)
    )
    e = rng.uniform(-3, 3, n)
    e = np.where(pick < 0.25, rng.uniform(lo, 10, n), e)
    e = np.where(pick > 0.9, rng.uniform(top, hi + 0.99, n), e)
    with np.errstate(all="ignore"):
        v = sign * np.exp2(e)
    if dtype == "float16":
        x = v.astype(np.float16)
    elif dtype == "bfloat16":
        x = v.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    else:
        x = v.astype(st)
    if specials and n:
        sp = _SPECIALS[dtype]
        where = rng.random(n) < 0.03
        x[where] = sp[rng.integers(0, len(sp), int(where.sum()))]
    return x


def make_inputs(dtype: str, count: int, n: int, seed: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(list(seed))
    with np.errstate(all="ignore"):
        return [gen(dtype, n, rng) for _ in range(count)]


def garbage(dtype: str, n: int) -> np.ndarray:
    return np.full(n * ref.storage(dtype).itemsize, 0xA5, np.uint8).view(ref.storage(dtype))


# -- the reference itself, on hand-computed cases ------------------------------------------------


def test_reference_hand_examples():
    f16 = np.float16
    # float16 sums carried in float32: the sum overflows float16 but the average does not
    a, b = np.array([60000], f16), np.array([60000], f16)
    assert np.isinf(ref.allreduce([a, b], "float16", "sum", 1)[0])
    assert ref.allreduce([a, b], "float16", "avg", 1)[0] == f16(60000)
    # ... but with two nodes each partial is rounded to float16 first (and overflows)
    assert np.isinf(ref.allreduce([a, a, b, b], "float16", "avg", 2)[0])
    # integer average truncates toward zero; sums wrap
    x = np.array([-7, 7, -1, np.iinfo(np.int32).max], np.int32)
    z = np.array([0, 0, 0, 1], np.int32)
    assert ref.allreduce([x, z], "int32", "avg", 1).tolist() == [-3, 3, 0, np.iinfo(np.int32).min // 2]
    assert ref.allreduce([np.array([200], np.uint8)] * 2, "uint8", "sum", 1).tolist() == [144]
    # bfloat16 1 + 2**-8 + 2**-8: the fp32 sum is exact (1 + 2**-7), a bf16 value
    one, eps = np.array([0x3F80], np.uint16), np.array([0x3B80], np.uint16)
    assert ref.allreduce([one, eps, eps], "bfloat16", "sum", 1).tolist() == [0x3F81]
    # with two nodes of two, node 0's partial 1 + 2**-8 is rounded to bf16 first: a tie, to even 1.0;
    # the server then adds 2**-8 again, another tie, and the result stays 1.0
    zero = np.array([0], np.uint16)
    assert ref.allreduce([one, eps, eps, zero], "bfloat16", "sum", 1).tolist() == [0x3F81]
    assert ref.allreduce([one, eps, eps, zero], "bfloat16", "sum", 2).tolist() == [0x3F80]
    # ranks alone on their nodes: partials are exact, so the result is the one-node one
    assert ref.allreduce([one, eps, eps], "bfloat16", "sum", 3).tolist() == [0x3F81]
    # float32 average divides in float32
    v = np.array([1.0], np.float32)
    w = np.array([0.0], np.float32)
    assert (
        ref.allreduce([v, w, w], "float32", "avg", 1).tobytes() == (np.float32(1) / np.float32(3)).tobytes()
    )
    # min/max propagate NaN
    n = np.array([np.nan, 1.0], np.float64)
    m = np.array([0.0, np.nan], np.float64)
    assert np.isnan(ref.allreduce([n, m], "float64", "min", 2)).all()
    assert np.isnan(ref.allreduce([n, m], "float64", "max", 1)).all()


def test_reference_refuses_values_of_another_dtype():
    with pytest.raises(TypeError):
        ref.allreduce([np.zeros(2, np.float64)] * 2, "float32", "sum", 1)
    # ml_dtypes' bfloat16 arrays are taken as their raw bits
    b = np.array([1.5, -2.0], ml_dtypes.bfloat16)
    assert ref.allreduce([b, b], "bfloat16", "sum", 1).tolist() == [0x4040, 0xC080]


def test_reference_other_collectives():
    xs = [np.arange(8, dtype=np.int32) * (r + 1) for r in range(4)]
    full = ref.allreduce(xs, "int32", "sum", 2)
    assert full.tolist() == (np.arange(8) * 10).tolist()
    parts = ref.reduce_scatter(xs, "int32", "sum", 2)
    assert [p.tolist() for p in parts] == [[0, 10], [20, 30], [40, 50], [60, 70]]
    g = ref.allgather(xs)
    assert g.shape == (4, 8) and g[2].tolist() == xs[2].tolist()
    assert ref.broadcast(xs, 3).tolist() == xs[3].tolist()


# -- Reducer against the reference ---------------------------------------------------------------
# Every Reducer test runs on both kernels: the numpy path and the compiled ones (smddp/engine/reduce16.cc
# for float16/bfloat16, smddp/engine/reduce.cc for every other type); both must give the reference's bits.


@pytest.fixture(params=["numpy", "compiled"])
def kernel(request):
    return request.param


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("ninputs", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_single_node(kernel, dtype, op, ninputs, n):
    """One node, G = W inputs: one Reducer.reduce with divisor=W is the whole all-reduce."""
    inputs = make_inputs(dtype, ninputs, n, (DTYPES.index(dtype), OPS.index(op), ninputs, n))
    saved = [x.copy() for x in inputs]
    out = garbage(dtype, n)
    with np.errstate(all="ignore"):
        Reducer(kernel).reduce(inputs, out, wire(dtype), wire_op(op), divisor=ninputs)
    want = ref.allreduce(inputs, dtype, op, nnodes=1)
    assert_same_bits(out, want, f"{dtype} {op} x{ninputs} n={n}")
    for x, s in zip(inputs, saved, strict=True):
        assert bits(x) == bits(s), "an input was modified"


TWO_LEVEL = [(2, 1), (2, 2), (3, 2), (2, 3), (4, 1), (3, 1)]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("nnodes,g", TWO_LEVEL, ids=lambda v: str(v))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_two_level(kernel, dtype, op, nnodes, g, n):
    """Node partials in the element type, then the server's fold over nodes with divisor=W."""
    world = nnodes * g
    inputs = make_inputs(dtype, world, n, (100 + DTYPES.index(dtype), OPS.index(op), nnodes, g, n))
    reducer = Reducer(kernel)
    rop = wire_op(op)
    partial_op = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    with np.errstate(all="ignore"):
        partials = []
        for node in range(nnodes):
            p = garbage(dtype, n)
            reducer.reduce(inputs[node * g : (node + 1) * g], p, wire(dtype), partial_op, divisor=None)
            partials.append(p)
        out = garbage(dtype, n)
        reducer.reduce(partials, out, wire(dtype), rop, divisor=world)
    want = ref.allreduce(inputs, dtype, op, nnodes=nnodes)
    assert_same_bits(out, want, f"{dtype} {op} {nnodes}x{g} n={n}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_without_divisor_is_a_sum(kernel, dtype, op):
    inputs = make_inputs(dtype, 3, 257, (7, DTYPES.index(dtype)))
    out = garbage(dtype, 257)
    with np.errstate(all="ignore"):
        Reducer(kernel).reduce(inputs, out, wire(dtype), ReduceOp.AVG, divisor=None)
    assert_same_bits(out, ref.allreduce(inputs, dtype, "sum", nnodes=1), dtype)


ALIASES = [(k, a) for k in (1, 2, 3, 5) for a in (0, 1, -1) if a < k]


@pytest.mark.parametrize("ninputs,alias", ALIASES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_may_alias_an_input(kernel, dtype, op, ninputs, alias):
    n = 1000
    inputs = make_inputs(dtype, ninputs, n, (200 + DTYPES.index(dtype), OPS.index(op), ninputs))
    want = ref.allreduce([x.copy() for x in inputs], dtype, op, nnodes=1)
    out = inputs[alias]
    with np.errstate(all="ignore"):
        Reducer(kernel).reduce(inputs, out, wire(dtype), wire_op(op), divisor=ninputs)
    assert_same_bits(out, want, f"{dtype} {op} x{ninputs} out=inputs[{alias}]")


def test_reducer_reuse_across_dtypes_and_sizes(kernel):
    """One Reducer (as the daemon keeps one per thread) reused with growing and shrinking scratch."""
    reducer = Reducer(kernel)
    rng = np.random.default_rng(99)
    plan = [(d, o, k, n) for d in DTYPES for o in OPS for k in (1, 3, 4) for n in (5, 3000, 17, 4099, 64)]
    order = rng.permutation(len(plan))
    for i in order:
        dtype, op, k, n = plan[i]
        inputs = make_inputs(dtype, k, n, (300, int(i)))
        out = garbage(dtype, n)
        with np.errstate(all="ignore"):
            reducer.reduce(inputs, out, wire(dtype), wire_op(op), divisor=k)
        assert_same_bits(out, ref.allreduce(inputs, dtype, op, nnodes=1), f"{dtype} {op} x{k} n={n}")


def test_reduce_into_slices_of_a_larger_buffer(kernel):
    """The daemon reduces chunk slices of shared buffers; strided offsets must not matter."""
    rng = np.random.default_rng(5)
    for dtype in DTYPES:
        with np.errstate(all="ignore"):
            big = [gen(dtype, 5000, rng) for _ in range(3)]
        res = garbage(dtype, 5000)
        reducer = Reducer(kernel)
        for a, b in [(0, 1024), (1024, 2048), (2048, 3001), (3001, 5000)]:
            with np.errstate(all="ignore"):
                reducer.reduce([x[a:b] for x in big], res[a:b], wire(dtype), ReduceOp.AVG, divisor=3)
        assert_same_bits(res, ref.allreduce(big, dtype, "avg", nnodes=1), dtype)


def test_int_avg_truncates_toward_zero(kernel):
    x = np.array([-7, 7, -8, 8, -1, 1, np.iinfo(np.int64).min, np.iinfo(np.int64).max], np.int64)
    out = np.empty_like(x)
    Reducer(kernel).reduce([x], out, DType.INT64, ReduceOp.AVG, divisor=2)
    assert out.tolist() == [-3, 3, -4, 4, 0, 0, np.iinfo(np.int64).min // 2, np.iinfo(np.int64).max // 2]
    y = np.array([-7, 7], np.int32)
    out32 = np.empty_like(y)
    Reducer(kernel).reduce([y, y, y], out32, DType.INT32, ReduceOp.AVG, divisor=4)  # -21/4, 21/4
    assert out32.tolist() == [-5, 5]


@pytest.mark.parametrize("world", [256, 300, 1024])
def test_uint8_avg_with_a_large_world(kernel, world):
    """A job of 256 or more ranks averaging uint8: the divisor does not fit the element type.

    The sum wraps in uint8 (so it is below 256) and the truncated average is therefore 0;
    the kernel must return that rather than fail to divide.
    """
    rng = np.random.default_rng(world)
    inputs = [rng.integers(0, 256, 9, dtype=np.uint8) for _ in range(world)]
    want = ref.allreduce(inputs, "uint8", "avg", nnodes=1)
    assert want.tolist() == [0] * 9
    out = garbage("uint8", 9)
    Reducer(kernel).reduce(inputs, out, DType.UINT8, ReduceOp.AVG, divisor=world)
    assert_same_bits(out, want, "uint8 avg")
    # and on the server side of a two-node job
    partials = []
    for node in range(2):
        p = garbage("uint8", 9)
        Reducer(kernel).reduce(
            inputs[node * world // 2 : (node + 1) * world // 2], p, DType.UINT8, ReduceOp.SUM
        )
        partials.append(p)
    Reducer(kernel).reduce(partials, out, DType.UINT8, ReduceOp.AVG, divisor=world)
    assert_same_bits(out, ref.allreduce(inputs, "uint8", "avg", nnodes=2), "uint8 avg two-level")


def test_empty_reduce_is_a_no_op_and_nothing_to_reduce_refused(kernel):
    out = np.empty(0, np.float32)
    Reducer(kernel).reduce([], out, DType.FLOAT32, ReduceOp.SUM)  # nothing to do for zero elements
    with pytest.raises(ValueError):
        Reducer(kernel).reduce([], np.empty(3, np.float32), DType.FLOAT32, ReduceOp.SUM)


# -- bfloat16 helpers against ml_dtypes --------------------------------------------------------------


def test_bf16_to_f32_every_pattern():
    allbits = np.arange(2**16, dtype=np.uint16)
    out = np.empty(2**16, np.float32)
    got = bf16_to_f32(allbits, out)
    assert got is out
    want = allbits.view(ml_dtypes.bfloat16).astype(np.float32)
    assert_same_bits(got, want, "bf16 -> f32")
    # widening is exact: the high half is the bf16 pattern, the low half zero
    assert (got.view(np.uint32) == allbits.astype(np.uint32) << 16).all()


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    out = np.full(len(x), 0xDEAD, np.uint16)
    tmp = np.empty(len(x), np.float32)
    saved = x.copy()
    got = f32_to_bf16(x, out, tmp)
    assert got is out
    assert bits(x) == bits(saved), "f32_to_bf16 modified its input"
    return got


def _ml_bf16(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def test_f32_to_bf16_all_high_halves_with_edge_low_halves():
    hi = np.arange(2**16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF], np.uint32)
    u = (hi[:, None] | lows[None, :]).reshape(-1)
    x = u.view(np.float32)
    got = _f32_to_bf16(x)
    want = _ml_bf16(x)
    finite_or_inf = ~np.isnan(x)
    assert_same_bits(got[finite_or_inf], want[finite_or_inf], "f32 -> bf16 (non-NaN)")
    nan = np.isnan(x)
    g = got[nan]
    assert ((g & 0x7F80) == 0x7F80).all() and ((g & 0x0040) != 0).all(), "NaN must round to a quiet NaN"
    assert ((g & 0x8000) == (u[nan] >> 16) & 0x8000).all(), "NaN keeps its sign"


def test_f32_to_bf16_random():
    rng = np.random.default_rng(1)
    u = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    x = u.view(np.float32)
    got = _f32_to_bf16(x)
    ok = ~np.isnan(x)
    assert_same_bits(got[ok], _ml_bf16(x)[ok], "f32 -> bf16 random")
    assert np.isnan(_ml_widen(got[~ok])).all()


def _ml_widen(b: np.ndarray) -> np.ndarray:
    return b.view(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize(
    "f32,bf16",
    [
        (0x3F808000, 0x3F80),  # tie, even below: round down
        (0x3F818000, 0x3F82),  # tie, odd below: round up
        (0x3F808001, 0x3F81),  # just above the tie
        (0x3F807FFF, 0x3F80),  # just below the tie
        (0xBF818000, 0xBF82),  # negative tie
        (0x7F7FFFFF, 0x7F80),  # max finite float32 rounds to +inf
        (0xFF7FFFFF, 0xFF80),  # and to -inf
        (0x7F7F7FFF, 0x7F7F),  # largest value that stays max-finite bf16
        (0x7F7F8000, 0x7F80),  # tie at max finite bf16 (odd): up to inf
        (0x7F800000, 0x7F80),  # +inf
        (0xFF800000, 0xFF80),  # -inf
        (0x00000000, 0x0000),
        (0x80000000, 0x8000),  # -0 keeps its sign
        (0x00008000, 0x0000),  # subnormal tie to even zero
        (0x00018000, 0x0002),  # subnormal tie, odd: up
        (0x00000001, 0x0000),  # smallest subnormal rounds to zero
        (0x007FFFFF, 0x0080),  # largest subnormal rounds up to the smallest normal
        (0x80018000, 0x8002),  # negative subnormal
        (0x7FC00000, 0x7FC0),  # canonical quiet NaN
        (0xFFC00000, 0xFFC0),  # negative quiet NaN
    ],
)
def test_f32_to_bf16_cases(f32, bf16):
    x = np.array([f32], np.uint32).view(np.float32)
    assert _f32_to_bf16(x).tolist() == [bf16]
    assert _ml_bf16(x).tolist() == [bf16]  # ml_dtypes agrees: the table itself is right


@pytest.mark.parametrize(
    "f32", [0x7F800001, 0x7FBFFFFF, 0x7FFF0000, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF, 0xFFFF8001]
)
def test_f32_to_bf16_nan_payloads_stay_nan(f32):
    """Signalling or payload NaNs must come out as quiet NaNs of the same sign, never infinities."""
    x = np.array([f32], np.uint32).view(np.float32)
    (b,) = _f32_to_bf16(x).tolist()
    assert b & 0x7F80 == 0x7F80 and b & 0x7F != 0, hex(b)
    assert b & 0x0040, f"{b:#x} is not a quiet NaN"
    assert b & 0x8000 == (f32 >> 16) & 0x8000
    assert np.isnan(_ml_widen(np.array([b], np.uint16)))[0]


# -- the compiled 16-bit kernel on its own ---------------------------------------------------------


def _no_nan(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Elements of `dtype` with infinities of one sign, zeros of both, subnormals, but no NaN."""
    x = gen(dtype, n, rng, specials=False)
    sp = _SPECIALS[dtype]
    sp = sp[~np.isnan(_as_float(dtype, sp))]
    sp = sp[_as_float(dtype, sp) != -np.inf]  # +inf and -inf together would make a NaN
    where = rng.random(n) < 0.03
    x[where] = sp[rng.integers(0, len(sp), int(where.sum()))]
    return x


def _as_float(dtype: str, x: np.ndarray) -> np.ndarray:
    return x.view(ml_dtypes.bfloat16).astype(np.float32) if dtype == "bfloat16" else x.astype(np.float32)


@pytest.fixture
def compiled():
    return _engine


@pytest.mark.parametrize("ninputs", [1, 2, 4, 7])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_compiled_kernel_without_nan_takes_no_fallback(compiled, dtype, op, ninputs):
    """NaN-free data: the C kernel writes every block itself and matches the reference bit for bit."""
    n = 3 * compiled.BLOCK + 13  # whole blocks and a ragged tail (not a multiple of 8 lanes)
    rng = np.random.default_rng([ninputs, OPS.index(op), len(dtype)])
    with np.errstate(all="ignore"):
        inputs = [_no_nan(dtype, n, rng) for _ in range(ninputs)]
    out = garbage(dtype, n)
    div = float(ninputs) if op == "avg" else 0.0
    code = {"sum": 0, "avg": 0, "min": 1, "max": 2}[op]
    left = compiled.reduce16(0 if dtype == "float16" else 1, code, inputs, out, div)
    want = ref.allreduce(inputs, dtype, op, nnodes=1)
    b = compiled.BLOCK
    for i in range((n + b - 1) // b):
        lo, hi = i * b, min(n, (i + 1) * b)
        if i in left:  # only where overflow to +inf met -inf and made a NaN
            assert np.isnan(_as_float(dtype, want[lo:hi])).any(), (i, left)
        else:
            assert_same_bits(out[lo:hi], want[lo:hi], f"{dtype} {op} x{ninputs} block {i}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_compiled_kernel_leaves_nan_blocks_to_numpy(compiled, dtype):
    """One NaN in the middle block: only that block is left unwritten, and the Reducer fills it exactly."""
    b = compiled.BLOCK
    n = 3 * b
    rng = np.random.default_rng(11)
    inputs = [_no_nan(dtype, n, rng) for _ in range(3)]
    inputs[1][b + 5] = _SPECIALS[dtype][1]  # -NaN
    out = garbage(dtype, n)
    left = compiled.reduce16(0 if dtype == "float16" else 1, 0, inputs, out, 0.0)
    assert left == [1]
    assert bits(out[b : 2 * b]) == bits(garbage(dtype, b)), "a NaN block must stay unwritten"
    out2 = garbage(dtype, n)
    with np.errstate(all="ignore"):
        Reducer("compiled").reduce(inputs, out2, wire(dtype), ReduceOp.SUM)
    assert_same_bits(out2, ref.allreduce(inputs, dtype, "sum", nnodes=1), dtype)


def test_compiled_kernel_refuses_bad_arguments(compiled):
    a = np.zeros(8, np.uint16)
    with pytest.raises(ValueError, match="holds"):
        compiled.reduce16(1, 0, [a, np.zeros(4, np.uint16)], np.zeros(8, np.uint16), 0.0)
    with pytest.raises(ValueError, match="inputs"):
        compiled.reduce16(1, 0, [], a, 0.0)
    with pytest.raises(ValueError, match="kind"):
        compiled.reduce16(5, 0, [a], a, 0.0)
    with pytest.raises(ValueError, match="op"):
        compiled.reduce16(1, 9, [a], a, 0.0)
    with pytest.raises(ValueError, match="not C-contiguous"):
        compiled.reduce16(1, 0, [a], a[::2], 0.0)
    with pytest.raises(ValueError, match="not C-contiguous"):
        compiled.reduce16(1, 0, [np.zeros(16, np.uint16)[::2]], a, 0.0)
    with pytest.raises((TypeError, BufferError, ValueError), match=r"writ|read"):
        compiled.reduce16(1, 0, [a], np.frombuffer(bytes(16), np.uint16), 0.0)  # read-only out


def test_reducer_kernel_choice():
    assert "numpy" in Reducer("numpy").kernel
    with pytest.raises(ValueError, match="kernel must be one of"):
        Reducer("fortran")
    assert Reducer("auto").kernel.endswith("bfloat16: compiled, other types: compiled")
    assert Reducer("numpy").kernel == "float16: numpy, bfloat16: numpy, other types: numpy"
