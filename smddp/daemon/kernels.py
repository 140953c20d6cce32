"""Reduction kernels: ordered sums (fp32 accumulation for 16-bit floats), min, max and the average."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from smddp.proto.dtypes import DType, ReduceOp


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


class Reducer:
    """Reduces equally long inputs into `out` in list order; owns scratch, so one per thread."""

    def __init__(self) -> None:
        self._acc = np.empty(0, np.float32)
        self._tmp = np.empty(0, np.float32)

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
        acc, tmp = self._scratch(n, acc_dt)
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
