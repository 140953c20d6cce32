"""The reduction kernels, bit for bit against the independent reference in tests/reference.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from smddp_rigs import _engine_testing

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


# -- the daemon's kernel against the reference ------------------------------------------------------
# `_engine_testing.reduce` is what the daemon's threads run on every chunk (reduce_wire in smddp/engine/reduce.cc:
# reduce.cc for uint8, int32, int64, float32, float64; reduce16.cc for float16 and bfloat16, with the
# blocks that hold a NaN written by the engine's own NaN rule). It must give the reference's bits.


def fold(
    inputs: list[np.ndarray], out: np.ndarray, dtype: DType, op: ReduceOp, divisor: int | None = None
) -> None:
    """out = op(inputs...) by the daemon's kernel; divisor None: an average is a plain sum (a node partial)."""
    _engine_testing.reduce(int(dtype), int(op), inputs, out, divisor if op == ReduceOp.AVG and divisor else 0)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("ninputs", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_single_node(dtype, op, ninputs, n):
    """One node, G = W inputs: one reduce with divisor=W is the whole all-reduce."""
    inputs = make_inputs(dtype, ninputs, n, (DTYPES.index(dtype), OPS.index(op), ninputs, n))
    saved = [x.copy() for x in inputs]
    out = garbage(dtype, n)
    with np.errstate(all="ignore"):
        fold(inputs, out, wire(dtype), wire_op(op), divisor=ninputs)
    want = ref.allreduce(inputs, dtype, op, nnodes=1)
    assert_same_bits(out, want, f"{dtype} {op} x{ninputs} n={n}")
    for x, s in zip(inputs, saved, strict=True):
        assert bits(x) == bits(s), "an input was modified"


TWO_LEVEL = [(2, 1), (2, 2), (3, 2), (2, 3), (4, 1), (3, 1)]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("nnodes,g", TWO_LEVEL, ids=lambda v: str(v))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_two_level(dtype, op, nnodes, g, n):
    """Node partials in the element type, then the server's fold over nodes with divisor=W."""
    world = nnodes * g
    inputs = make_inputs(dtype, world, n, (100 + DTYPES.index(dtype), OPS.index(op), nnodes, g, n))
    rop = wire_op(op)
    partial_op = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    with np.errstate(all="ignore"):
        partials = []
        for node in range(nnodes):
            p = garbage(dtype, n)
            fold(inputs[node * g : (node + 1) * g], p, wire(dtype), partial_op, divisor=None)
            partials.append(p)
        out = garbage(dtype, n)
        fold(partials, out, wire(dtype), rop, divisor=world)
    want = ref.allreduce(inputs, dtype, op, nnodes=nnodes)
    assert_same_bits(out, want, f"{dtype} {op} {nnodes}x{g} n={n}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_without_divisor_is_a_sum(dtype, op):
    inputs = make_inputs(dtype, 3, 257, (7, DTYPES.index(dtype)))
    out = garbage(dtype, 257)
    with np.errstate(all="ignore"):
        fold(inputs, out, wire(dtype), ReduceOp.AVG, divisor=None)
    assert_same_bits(out, ref.allreduce(inputs, dtype, "sum", nnodes=1), dtype)


ALIASES = [(k, a) for k in (1, 2, 3, 4, 5, 8) for a in (0, 1, -1) if a < k]


@pytest.mark.parametrize("ninputs,alias", ALIASES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_may_alias_an_input(dtype, op, ninputs, alias):
    n = 1000
    inputs = make_inputs(dtype, ninputs, n, (200 + DTYPES.index(dtype), OPS.index(op), ninputs))
    want = ref.allreduce([x.copy() for x in inputs], dtype, op, nnodes=1)
    out = inputs[alias]
    with np.errstate(all="ignore"):
        fold(inputs, out, wire(dtype), wire_op(op), divisor=ninputs)
    assert_same_bits(out, want, f"{dtype} {op} x{ninputs} out=inputs[{alias}]")


def test_kernel_across_dtypes_and_sizes_in_any_order():
    """One thread's calls of every dtype and size in a random order (the daemon's threads mix them)."""
    rng = np.random.default_rng(99)
    plan = [(d, o, k, n) for d in DTYPES for o in OPS for k in (1, 3, 4) for n in (5, 3000, 17, 4099, 64)]
    order = rng.permutation(len(plan))
    for i in order:
        dtype, op, k, n = plan[i]
        inputs = make_inputs(dtype, k, n, (300, int(i)))
        out = garbage(dtype, n)
        with np.errstate(all="ignore"):
            fold(inputs, out, wire(dtype), wire_op(op), divisor=k)
        assert_same_bits(out, ref.allreduce(inputs, dtype, op, nnodes=1), f"{dtype} {op} x{k} n={n}")


def test_reduce_into_slices_of_a_larger_buffer():
    """The daemon reduces chunk slices of shared buffers; strided offsets must not matter."""
    rng = np.random.default_rng(5)
    for dtype in DTYPES:
        with np.errstate(all="ignore"):
            big = [gen(dtype, 5000, rng) for _ in range(3)]
        res = garbage(dtype, 5000)
        for a, b in [(0, 1024), (1024, 2048), (2048, 3001), (3001, 5000)]:
            with np.errstate(all="ignore"):
                fold([x[a:b] for x in big], res[a:b], wire(dtype), ReduceOp.AVG, divisor=3)
        assert_same_bits(res, ref.allreduce(big, dtype, "avg", nnodes=1), dtype)


def test_int_avg_truncates_toward_zero():
    x = np.array([-7, 7, -8, 8, -1, 1, np.iinfo(np.int64).min, np.iinfo(np.int64).max], np.int64)
    out = np.empty_like(x)
    fold([x], out, DType.INT64, ReduceOp.AVG, divisor=2)
    assert out.tolist() == [-3, 3, -4, 4, 0, 0, np.iinfo(np.int64).min // 2, np.iinfo(np.int64).max // 2]
    y = np.array([-7, 7], np.int32)
    out32 = np.empty_like(y)
    fold([y, y, y], out32, DType.INT32, ReduceOp.AVG, divisor=4)  # -21/4, 21/4
    assert out32.tolist() == [-5, 5]


@pytest.mark.parametrize("world", [256, 300, 1024])
def test_uint8_avg_with_a_large_world(world):
    """A job of 256 or more ranks averaging uint8: the divisor does not fit the element type.

    The sum wraps in uint8 (so it is below 256) and the truncated average is therefore 0;
    the kernel must return that rather than fail to divide.
    """
    rng = np.random.default_rng(world)
    inputs = [rng.integers(0, 256, 9, dtype=np.uint8) for _ in range(world)]
    want = ref.allreduce(inputs, "uint8", "avg", nnodes=1)
    assert want.tolist() == [0] * 9
    out = garbage("uint8", 9)
    fold(inputs, out, DType.UINT8, ReduceOp.AVG, divisor=world)
    assert_same_bits(out, want, "uint8 avg")
    # and on the server side of a two-node job
    partials = []
    for node in range(2):
        p = garbage("uint8", 9)
        fold(inputs[node * world // 2 : (node + 1) * world // 2], p, DType.UINT8, ReduceOp.SUM)
        partials.append(p)
    fold(partials, out, DType.UINT8, ReduceOp.AVG, divisor=world)
    assert_same_bits(out, ref.allreduce(inputs, "uint8", "avg", nnodes=2), "uint8 avg two-level")


def test_empty_reduce_is_a_no_op_and_nothing_to_reduce_refused():
    out = np.empty(0, np.float32)
    fold([out.copy(), out.copy()], out, DType.FLOAT32, ReduceOp.SUM)  # nothing to do for zero elements
    for dtype in (DType.FLOAT32, DType.BFLOAT16):
        with pytest.raises(ValueError, match="inputs"):
            fold([], np.empty(3, dtype.storage), dtype, ReduceOp.SUM)


def test_the_kernel_refuses_what_is_not_on_the_wire():
    a = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="dtype 9 is not a wire dtype"):
        _engine_testing.reduce(9, int(ReduceOp.SUM), [a], a, 0)
    with pytest.raises(ValueError, match="op"):
        _engine_testing.reduce(int(DType.FLOAT16), 7, [a.view(np.uint16)], a.view(np.uint16), 0)
    with pytest.raises(ValueError, match="holds"):
        _engine_testing.reduce(int(DType.FLOAT32), int(ReduceOp.SUM), [a, np.zeros(4, np.float32)], a, 0)
    with pytest.raises(ValueError, match="whole elements"):
        _engine_testing.reduce(int(DType.FLOAT64), int(ReduceOp.SUM), [a[:3]], a[:3], 0)


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
    return _engine_testing


@pytest.mark.parametrize("ninputs", [1, 2, 3, 4, 7, 8])
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


@pytest.mark.parametrize("ninputs", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("op", OPS)
def test_bfloat16_loops_give_the_same_bits_for_the_baseline_and_avx2(compiled, op, ninputs):
    """The bfloat16 loops are compiled twice (the baseline's, and AVX2's where the CPU has it): the
    same bits from both, NaN blocks left alike, special values and a ragged tail included, with the
    input counts folded in one pass (2, 3, 4, 8) and the others. (On a CPU
    without AVX2 both calls run the baseline's.)"""
    n = 5 * compiled.BLOCK + 29
    rng = np.random.default_rng([ninputs, OPS.index(op), 16])
    with np.errstate(all="ignore"):
        inputs = [gen("bfloat16", n, rng) for _ in range(ninputs)]
    div = float(ninputs) if op == "avg" else 0.0
    code = {"sum": 0, "avg": 0, "min": 1, "max": 2}[op]
    fast, base = garbage("bfloat16", n), garbage("bfloat16", n)
    left = compiled.reduce16(1, code, inputs, fast, div)
    assert compiled.reduce16(1, code, inputs, base, div, True) == left
    assert bits(fast) == bits(base), f"bfloat16 {op} x{ninputs}"
    with np.errstate(all="ignore"):
        clean = [_no_nan("bfloat16", n, rng) for _ in range(ninputs)]
    fast, base = garbage("bfloat16", n), garbage("bfloat16", n)
    assert compiled.reduce16(1, code, clean, fast, div) == compiled.reduce16(1, code, clean, base, div, True)
    assert bits(fast) == bits(base), f"bfloat16 {op} x{ninputs}, no NaN"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_compiled_kernel_leaves_nan_blocks_to_the_nan_rule(compiled, dtype):
    """One NaN in the middle block: the block kernel leaves only that block unwritten, and the
    daemon's kernel (which writes it by the NaN rule) gives the reference's bits."""
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
    fold(inputs, out2, wire(dtype), ReduceOp.SUM)
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
