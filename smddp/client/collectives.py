"""The collectives a worker calls: argument checks up front, then one SUBMIT each."""

from __future__ import annotations

from typing import Any

import numpy as np

from smddp.client.buffers import BufferView, as_buffer
from smddp.client.session import Client, Handle, check_op
from smddp.errors import InvalidArgumentError, UnsupportedBufferError
from smddp.proto.dtypes import DType, Kind, ReduceOp


def _new_array(shape: tuple[int, ...], like: BufferView) -> np.ndarray:
    """A fresh numpy result: the input's dtype, or raw uint16 bits for a DLPack bfloat16 tensor."""
    return np.empty(shape, like.result_dtype if like.result_dtype is not None else like.dtype.storage)


def _out_view(out: Any, dtype: DType, count: int, what: str) -> tuple[Any, BufferView]:
    view = as_buffer(out, writable=True, what=what)
    if view.dtype != dtype:
        raise UnsupportedBufferError(
            f"{what}: dtype {view.dtype.label} differs from the input's {dtype.label}"
        )
    if view.count != count:
        raise InvalidArgumentError(f"{what}: has {view.count} elements, the result has {count}")
    return out, view


def allreduce_async(c: Client, buf: Any, op: Any = ReduceOp.SUM) -> Handle:
    rop = check_op(op)
    view = as_buffer(buf, writable=True)

    def deliver(result: np.ndarray) -> Any:
        view.array[:] = result.view(view.dtype.storage)
        return buf

    return c.submit(Kind.ALLREDUCE, view, view.dtype, view.count, rop, 0, deliver)


def broadcast_async(c: Client, buf: Any, root: int = 0) -> Handle:
    root = _check_root(c, root)
    view = as_buffer(buf, writable=True)

    def deliver(result: np.ndarray) -> Any:
        if c.rank != root:
            view.array[:] = result.view(view.dtype.storage)
        return buf

    return c.submit(
        Kind.BROADCAST, view, view.dtype, view.count, None, root, deliver, send_data=c.rank == root
    )


def allgather_async(c: Client, buf: Any, out: Any = None) -> Handle:
    view = as_buffer(buf, writable=False)
    if out is None:
        out = _new_array((c.size, *view.shape), view)
        out_view = as_buffer(out, writable=True)
    else:
        out, out_view = _out_view(out, view.dtype, view.count * c.size, "allgather out")

    def deliver(result: np.ndarray) -> Any:
        out_view.array[:] = result.view(view.dtype.storage)
        return out

    return c.submit(Kind.ALLGATHER, view, view.dtype, view.count, None, 0, deliver)


def reduce_scatter_async(c: Client, buf: Any, op: Any = ReduceOp.SUM, out: Any = None) -> Handle:
    rop = check_op(op)
    view = as_buffer(buf, writable=False)
    if view.count % c.size:
        raise InvalidArgumentError(
            f"reduce_scatter: {view.count} elements cannot be split evenly among {c.size} ranks"
        )
    part = view.count // c.size
    if out is None:
        shape = view.shape
        if shape and shape[0] % c.size == 0:
            shape = (shape[0] // c.size, *shape[1:])
        else:
            shape = (part,)
        out = _new_array(shape, view)
        out_view = as_buffer(out, writable=True)
    else:
        out, out_view = _out_view(out, view.dtype, part, "reduce_scatter out")
    lo = c.rank * part

    def deliver(result: np.ndarray) -> Any:
        out_view.array[:] = result.view(view.dtype.storage)[lo : lo + part]
        return out

    return c.submit(Kind.REDUCE_SCATTER, view, view.dtype, view.count, rop, 0, deliver)


def barrier_async(c: Client) -> Handle:
    return c.submit(Kind.BARRIER, None, DType.UINT8, 0, None, 0, lambda _r: None)


def _check_root(c: Client, root: Any) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise InvalidArgumentError(f"root must be an int rank, got {root!r}")
    if not 0 <= int(root) < c.size:
        raise InvalidArgumentError(f"root {root} is out of range for {c.size} ranks")
    return int(root)
