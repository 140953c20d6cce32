"""Reduction kernels: ordered sums (fp32 accumulation for 16-bit floats), min, max and the average."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from smddp import _engine
from smddp.proto.dtypes import DType, ReduceOp

KERNELS = ("auto", "compiled", "numpy")


def engine_kernels() -> str:
    """What reduces what in the daemon (the engine's kernels), as `smddp status` shows it."""
    f16 = "compiled (F16C)" if _engine.has_f16c() else "compiled (no F16C: one element at a time)"
    return f"float16: {f16}, bfloat16: compiled, other types: compiled"


def bf16_to_f32(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bits (uint16) to float32 exactly."""
    u = out.view(np.uint32)
    np.copyto(u, bits, casting="safe")
    np.left_shift(u, 16, out=u)
    return out


def f32_to_bf16(x: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bits, to nearest with ties to even; NaN stays a quiet NaN."""
    u = x.view(np.uint32)
    t = tmp.view(np.uint32)
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, u, out=t)  # may wrap only for NaN payloads, fixed below
    np.right_shift(t, 16, out=t)
    np.copyto(out, t, casting="unsafe")
    nan = np.isnan(x)
    if nan.any():
        out[nan] = (np.right_shift(u[nan], 16) | 0x0040).astype(np.uint16)
    return out


def _int_avg(acc: np.ndarray, divisor: int, out: np.ndarray) -> None:
    """Integer average truncated toward zero, as C division does (NCCL's ncclAvg does the same)."""
    d = np.int64(divisor)  # a Python int above the dtype's range would be refused by numpy
    q = np.floor_divide(acc, d)
    if np.issubdtype(acc.dtype, np.signedinteger):
        q += ((acc % d) != 0) & (acc < 0)
    np.copyto(out, q, casting="unsafe")


_COMPILED_OP = {ReduceOp.SUM: 0, ReduceOp.AVG: 0, ReduceOp.MIN: 1, ReduceOp.MAX: 2}


class Reducer:
    """Reduces equally long inputs into `out` in list order; owns scratch, so one per thread.

    `kernel` picks the implementation: "compiled" or "auto" (the engine's kernels; float16 needs F16C,
    else numpy), or "numpy". Both give the same bits, except which payload a result keeps where two
    NaNs meet (numpy's depends on the array's length; the engine keeps the first, docs/engine.md).
    """

    def __init__(self, kernel: str = "auto") -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, not {kernel!r}")
        self._acc = np.empty(0, np.float32)
        self._tmp = np.empty(0, np.float32)
        self._c = None if kernel == "numpy" else _engine
        # float16 needs the CPU's F16C conversions; bfloat16 is plain C everywhere.
        self._c_f16 = self._c is not None and bool(self._c.has_f16c())

    @property
    def kernel(self) -> str:
        """Which kernel reduces what here: "compiled" or "numpy" (float16 per CPU)."""
        f16 = "compiled" if self._c_f16 else "numpy"
        rest = "compiled" if self._c is not None else "numpy"
        return f"float16: {f16}, bfloat16: {rest}, other types: {rest}"

    def _scratch(self, n: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        need = n * dtype.itemsize
        if self._acc.nbytes < need:
            self._acc = np.empty(need, np.uint8)
            self._tmp = np.empty(max(need, n * 4), np.uint8)
        return self._acc[:need].view(dtype), self._tmp[: max(need, n * 4)]

    def reduce(
        self,
        inputs: Sequence[np.ndarray],
        out: np.ndarray,
        dtype: DType,
        op: ReduceOp,
        divisor: int | None = None,
    ) -> None:
        """out = op(inputs[0], inputs[1], ...) folded left to right; AVG divides by `divisor` at the end.

        With `divisor=None` an AVG is a plain sum (the node partial of an average).
        Inputs and `out` hold dtype.storage elements; `out` may alias any input element-wise.
        """
        n = out.shape[0]
        if n == 0:
            return
        # Overflow to inf and NaN arithmetic are the defined IEEE results here, not warnings.
        with np.errstate(all="ignore"):
            self._reduce(inputs, out, dtype, op, divisor, n)

    def _reduce(
        self,
        inputs: Sequence[np.ndarray],
        out: np.ndarray,
        dtype: DType,
        op: ReduceOp,
        divisor: int | None,
        n: int,
    ) -> None:
        if not inputs:
            raise ValueError("nothing to reduce")
        acc_dt = dtype.accumulator
        widen = acc_dt != dtype.storage
        fold: np.ufunc
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            fold = np.add
        elif op == ReduceOp.MIN:
            fold = np.minimum
        else:
            fold = np.maximum

        if (
            not widen
            and self._c is not None
            and out.flags.c_contiguous
            and all(x.flags.c_contiguous for x in inputs)
        ):
            n_div = divisor if op == ReduceOp.AVG and divisor is not None else 0
            self._c.reduce(int(dtype), int(op), inputs, out, n_div)
            return
        if not widen:
            last = op != ReduceOp.AVG or divisor is None
            if len(inputs) == 1:
                if not np.shares_memory(out, inputs[0]):
                    np.copyto(out, inputs[0])
            elif len(inputs) == 2:
                fold(inputs[0], inputs[1], out=out)
            else:
                acc, _ = self._scratch(n, acc_dt)
                fold(inputs[0], inputs[1], out=acc)
                for x in inputs[2:-1]:
                    fold(acc, x, out=acc)
                fold(acc, inputs[-1], out=out)
            if not last:
                assert divisor is not None
                if dtype.is_float:
                    np.divide(out, out.dtype.type(divisor), out=out)
                else:
                    _int_avg(out, divisor, out)
            return

        # 16-bit floats: widen each input to float32, fold, divide, round once at the end.
        c = self._c if dtype == DType.BFLOAT16 or self._c_f16 else None
        if c is not None and out.flags.c_contiguous and all(x.flags.c_contiguous for x in inputs):
            div = float(divisor) if op == ReduceOp.AVG and divisor is not None else 0.0
            kind = 0 if dtype == DType.FLOAT16 else 1
            # Blocks whose result holds a NaN were left unwritten (their inputs intact, even when
            # `out` aliases one): numpy reduces them, so NaN payloads keep numpy's exact bits.
            for b in c.reduce16(kind, _COMPILED_OP[op], inputs, out, div):
                lo, hi = b * c.BLOCK, min(n, (b + 1) * c.BLOCK)
                self._reduce_wide([x[lo:hi] for x in inputs], out[lo:hi], dtype, op, divisor, hi - lo, fold)
            return
        self._reduce_wide(inputs, out, dtype, op, divisor, n, fold)

    def _reduce_wide(
        self,
        inputs: Sequence[np.ndarray],
        out: np.ndarray,
        dtype: DType,
        op: ReduceOp,
        divisor: int | None,
        n: int,
        fold: np.ufunc,
    ) -> None:
        """The numpy path for float16/bfloat16: widen to float32, fold, divide, round once."""
        acc, tmp = self._scratch(n, dtype.accumulator)
        if dtype == DType.FLOAT16:
            np.copyto(acc, inputs[0])
            for x in inputs[1:]:
                fold(acc, x, out=acc)  # numpy widens x to float32 exactly before the op
        else:
            wide = tmp[: n * 4].view(np.float32)
            bf16_to_f32(inputs[0], acc)
            for x in inputs[1:]:
                fold(acc, bf16_to_f32(x, wide), out=acc)
        if op == ReduceOp.AVG and divisor is not None:
            np.divide(acc, np.float32(divisor), out=acc)
        if dtype == DType.FLOAT16:
            np.copyto(out, acc, casting="unsafe")  # IEEE round to nearest even
        else:
            f32_to_bf16(acc, out, tmp[: n * 4])
