"""An independent numpy model of smddp's collectives, bit for bit.

It imports nothing from `smddp`: the point is to check the implementation against a second,
separately written one. bfloat16 rounding comes from ml_dtypes (its own round-to-nearest-even),
float16 from numpy. bfloat16 arrays are raw np.uint16 bits, as on the wire.

The summation order modelled here is the documented one:

* ranks are grouped by node: node n holds ranks [n*G, (n+1)*G), G = W // nnodes;
* the accumulator is float32 for float16/bfloat16, the element type itself otherwise
  (integers wrap around on overflow);
* a node partial folds its ranks left to right in the accumulator (an average is a plain sum);
* with one node the partial is finalized directly; with several, each partial is rounded to the
  element type, widened again, and the server folds the partials left to right in node order;
* finalize: an average divides once by W (IEEE division for floats, truncation toward zero for
  integers), then 16-bit floats are rounded from float32 with round-to-nearest-even.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES = ("uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
OPS = ("sum", "avg", "min", "max")

_STORAGE = {
    "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


def storage(dtype: str) -> np.dtype:
    """The numpy dtype holding the raw elements of `dtype` (uint16 for bfloat16)."""
    return _STORAGE[dtype]


def accumulator(dtype: str) -> np.dtype:
    if dtype in ("float16", "bfloat16"):
        return np.dtype(np.float32)
    return _STORAGE[dtype]


def widen(x: np.ndarray, dtype: str) -> np.ndarray:
    """Element values (raw storage) to the accumulator dtype, exactly; always a fresh array."""
    x = np.asarray(x)
    if dtype == "bfloat16" and x.dtype == ml_dtypes.bfloat16:
        x = x.view(np.uint16)
    if x.dtype != _STORAGE[dtype]:
        # never convert values silently: the caller passes raw elements of the stated dtype
        raise TypeError(f"{dtype} elements must be held as {_STORAGE[dtype]}, got {x.dtype}")
    if dtype == "bfloat16":
        return x.view(ml_dtypes.bfloat16).astype(np.float32)
    if dtype == "float16":
        return x.astype(np.float32)
    return x.copy()


def narrow(acc: np.ndarray, dtype: str) -> np.ndarray:
    """Accumulator values back to raw storage: 16-bit floats are rounded to nearest even."""
    if dtype == "bfloat16":
        assert acc.dtype == np.float32
        with np.errstate(all="ignore"):
            return acc.astype(ml_dtypes.bfloat16).view(np.uint16)
    if dtype == "float16":
        assert acc.dtype == np.float32
        with np.errstate(all="ignore"):
            return acc.astype(np.float16)
    assert acc.dtype == _STORAGE[dtype]
    return acc.copy()


def _fold(op: str):
    if op in ("sum", "avg"):
        return np.add
    if op == "min":
        return np.minimum
    if op == "max":
        return np.maximum
    raise ValueError(f"unknown op {op!r}")


def _fold_left(values: list[np.ndarray], op: str) -> np.ndarray:
    fn = _fold(op)
    acc = values[0].copy()
    with np.errstate(all="ignore"):
        for v in values[1:]:
            assert v.dtype == acc.dtype
            acc = fn(acc, v)
            assert acc.dtype == values[0].dtype  # no silent promotion
    return acc


def _truncating_div(acc: np.ndarray, world: int) -> np.ndarray:
    """Integer division truncated toward zero (as C's `/`), done on Python ints so it is exact."""
    q = []
    for v in acc.tolist():
        mag = abs(v) // world
        q.append(mag if v >= 0 else -mag)
    return np.array(q, dtype=acc.dtype).reshape(acc.shape)


def _finalize(acc: np.ndarray, dtype: str, op: str, world: int) -> np.ndarray:
    if op == "avg":
        if dtype in ("float16", "bfloat16", "float32", "float64"):
            with np.errstate(all="ignore"):
                acc = np.true_divide(acc, acc.dtype.type(world))
            assert acc.dtype == accumulator(dtype)
        else:
            acc = _truncating_div(acc, world)
    return narrow(acc, dtype)


def allreduce(inputs: list[np.ndarray], dtype: str, op: str, nnodes: int) -> np.ndarray:
    """The result every rank gets (raw storage elements) when rank r contributes inputs[r]."""
    world = len(inputs)
    if world == 0 or nnodes <= 0 or world % nnodes:
        raise ValueError(f"{world} ranks cannot be spread evenly over {nnodes} nodes")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    g = world // nnodes
    count = len(inputs[0])
    wide = [widen(x, dtype) for x in inputs]
    assert all(w.shape == (count,) for w in wide)
    partial_op = "sum" if op == "avg" else op
    partials = [_fold_left(wide[n * g : (n + 1) * g], partial_op) for n in range(nnodes)]
    if nnodes == 1:
        return _finalize(partials[0], dtype, op, world)
    # Partials travel in the element type: round, then widen again on the server.
    sent = [widen(narrow(p, dtype), dtype) for p in partials]
    return _finalize(_fold_left(sent, partial_op), dtype, op, world)


def reduce_scatter(inputs: list[np.ndarray], dtype: str, op: str, nnodes: int) -> list[np.ndarray]:
    """Rank r's part: elements [r*k, (r+1)*k) of the all-reduce result, k = count / W."""
    world = len(inputs)
    full = allreduce(inputs, dtype, op, nnodes)
    if len(full) % world:
        raise ValueError(f"{len(full)} elements cannot be split among {world} ranks")
    k = len(full) // world
    return [full[r * k : (r + 1) * k].copy() for r in range(world)]


def allgather(inputs: list[np.ndarray]) -> np.ndarray:
    """Shape (W, count): row r is rank r's input."""
    return np.stack([np.asarray(x) for x in inputs])


def broadcast(inputs: list[np.ndarray], root: int) -> np.ndarray:
    """What every rank holds afterwards: the root's input."""
    return np.asarray(inputs[root]).copy()
