"""The collectives a worker calls: argument checks up front, then one SUBMIT each (host or device buffers)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from smddp.client.buffers import BufferView, PartsView, as_buffer, as_parts
from smddp.client.device.buffers import DeviceBuffer, stream_handle
from smddp.client.device.step import NodeStep
from smddp.client.device.step import start as start_step
from smddp.client.session import NO_DATA, Client, Handle, PipelinedHandle, check_op
from smddp.errors import CollectiveTimeoutError, InvalidArgumentError, UnsupportedBufferError
from smddp.proto.dtypes import DType, Kind, ReduceOp, dtype_from_numpy
from smddp.proto.layout import shard_bounds


def _new_array(shape: tuple[int, ...], like: BufferView) -> np.ndarray:
    """A fresh numpy result: the input's dtype, or raw uint16 bits for a DLPack bfloat16 tensor."""
    return np.empty(shape, like.result_dtype if like.result_dtype is not None else like.dtype.storage)


def _out_view(c: Client, out: Any, dtype: DType, count: int, what: str) -> tuple[Any, BufferView]:
    if c.device_buffer(out, what, writable=True) is not None:
        raise UnsupportedBufferError(
            f"{what}: is device memory but the input is host memory (pass both on the device or both on the host)"
        )
    view = as_buffer(out, writable=True, what=what)
    if view.dtype != dtype:
        raise UnsupportedBufferError(
            f"{what}: dtype {view.dtype.label} differs from the input's {dtype.label}"
        )
    if view.count != count:
        raise InvalidArgumentError(f"{what}: has {view.count} elements, the result has {count}")
    return out, view


def _device_out(
    c: Client, out: Any, like: DeviceBuffer, shape: tuple[int, ...], count: int, what: str
) -> tuple[Any, DeviceBuffer]:
    """The device array a gathering collective writes: `out`, or a new one of the device runtime.

    A new one has the input's numpy dtype, or raw uint16 bits for a DLPack bfloat16 input (CuPy
    has no bfloat16), as a new host result has; smddp knows what it holds without asking it.
    """
    if out is None:
        out, ptr = c.device_runtime().new_array(shape, like.result_dtype, like.device)
        return out, dataclasses.replace(
            like, ptr=ptr, shape=shape, count=count, readonly=False, keepalive=out
        )
    view = c.device_buffer(out, what, writable=True)
    if view is None:
        raise UnsupportedBufferError(
            f"{what}: is host memory but the input is device memory (pass both on the device or both on the host)"
        )
    if view.dtype != like.dtype:
        raise UnsupportedBufferError(
            f"{what}: dtype {view.dtype.label} differs from the input's {like.dtype.label}"
        )
    if view.count != count:
        raise InvalidArgumentError(f"{what}: has {view.count} elements, the result has {count}")
    return out, view


def _no_stream(stream: Any) -> None:
    if stream is not None:
        raise InvalidArgumentError("stream= applies to device (CUDA) buffers; this buffer is host memory")


def pieces(count: int, itemsize: int, piece_bytes: int) -> list[tuple[int, int]]:
    """The element ranges a host all-reduce of `count` elements goes as: one, or near-equal pieces of
    at most `piece_bytes` each. A function of the count alone, so every rank cuts alike."""
    if _one_piece(count * itemsize, piece_bytes):
        return [(0, count)]
    # The same near-equal cut as the server shards: the first `count % k` pieces one element longer.
    # (Never more pieces than elements: a piece smaller than one element would be empty.)
    return shard_bounds(count, min(count, -(-count * itemsize // piece_bytes)))


def _allreduce_pieces(
    c: Client, view: BufferView | PartsView, rop: ReduceOp, out: np.ndarray, result: Any
) -> Handle:
    """All-reduce `view` piece by piece, each piece's result copied into `out` (1-D, storage dtype)
    as soon as it is back; the handle returns `result`."""

    def submit(a: int, b: int, aux: int) -> Handle:
        part = view if aux == 0 else view.piece(a, b)
        # The engine's, from its copy-in (a fused buffer's parts one after another, never packed
        # first) to its copy-out.
        dst = out[a:b]
        return c.start_async(
            Kind.ALLREDUCE, _sources(part), view.dtype, b - a, rop, aux, dst, 0, dst.nbytes, None, result,
            part.keepalive,
        )  # fmt: skip

    return _in_pieces(c, view.count, view.dtype.itemsize, result, submit)


def _sources(view: BufferView | PartsView) -> np.ndarray | tuple[np.ndarray, ...]:
    """What the engine copies in for `view`: its array, or its parts' arrays in order."""
    return view.array if isinstance(view, BufferView) else tuple(p.array for p in view.parts)


def _in_pieces(
    c: Client, count: int, itemsize: int, result: Any, submit: Callable[[int, int, int], Handle]
) -> Handle:
    """An all-reduce of `count` elements, whole or cut into pieces (Client.piece_bytes): `submit(a, b, aux)`
    sends elements [a, b) with SUBMIT's aux, 0 for a whole buffer, else the number of pieces, which
    every piece names: ranks whose buffers differ but whose pieces happen to be the same size fail
    with a mismatch instead of reducing unrelated data."""
    ranges = pieces(count, itemsize, c.piece_bytes)
    if len(ranges) == 1:
        return submit(0, count, 0)
    return PipelinedHandle([submit(a, b, len(ranges)) for a, b in ranges], count, result)


def _allreduce_device(c: Client, dev: DeviceBuffer, rop: ReduceOp, stream: Any, result: Any) -> Handle:
    """All-reduce device buffer `dev` in place: on the node's GPUs where the job's device all-reduces
    take the GPU step (Client.node_step); else in one piece, or in pieces (Client.piece_bytes) that all wait
    for the same point of the caller's stream, so that the copy of one to the host, the network steps
    of another and the copy of a third back to the device overlap."""
    step = c.node_step(dev)
    if step is not None:
        return start_step(c, step, dev, rop, stream, result)  # type: ignore[return-value]  # (a Handle by registration)
    # In pieces, copies in and out overlap on the lanes' two streams: in line only when whole.
    one = whole(c, dev.nbytes)
    plan = c.device_plan(dev, [(dev, 0, dev.nbytes)], stream, dev, dev.keepalive, inline=one)

    def submit(a: int, b: int, aux: int) -> Handle:
        piece = plan
        if aux:
            part = dataclasses.replace(dev, ptr=dev.ptr + a * dev.dtype.itemsize, shape=(b - a,), count=b - a)
            piece = dataclasses.replace(plan, src=part, outputs=[(part, 0, part.nbytes)])
        return c.submit(Kind.ALLREDUCE, dev.dtype, b - a, rop, aux, result, piece)

    return _in_pieces(c, dev.count, dev.dtype.itemsize, result, submit)


def allreduce_async(c: Client, buf: Any, op: Any = ReduceOp.SUM, stream: Any = None) -> Handle:
    rop = check_op(op)
    if stream is None and type(buf) is np.ndarray:
        h = _allreduce_array_async(c, buf, rop)
        if h is not None:
            return h
    dev = c.device_buffer(buf, "buffer", writable=True)
    if dev is not None:
        return _allreduce_device(c, dev, rop, stream, buf)
    return _allreduce_host(c, buf, rop, stream)


def _allreduce_host(c: Client, buf: Any, rop: ReduceOp, stream: Any) -> Handle:
    """The general way for host memory (allreduce_async's, once `buf` is known not to be device memory)."""
    _no_stream(stream)
    view = as_buffer(buf, writable=True)
    return _allreduce_pieces(c, view, rop, view.array, buf)


def allreduce(c: Client, buf: Any, op: Any, timeout: float | None, stream: Any = None) -> Any:
    """The blocking all-reduce: a numpy array in one pass through the engine where it can
    (Client.allreduce_now), a device buffer with its copies in line (_allreduce_device_now), anything
    else as allreduce_async(...).wait() would take it."""
    rop = check_op(op)
    if stream is None and type(buf) is np.ndarray:
        dt = _usable_array(c, buf)
        if dt is not None and c.allreduce_now(buf, dt, buf.size, rop, timeout):
            return buf
    dev = c.device_buffer(buf, "buffer", writable=True)  # (asked once: the ways below take its answer)
    if dev is None:
        waited(c, lambda: _allreduce_host(c, buf, rop, stream), timeout)
    elif not _allreduce_device_now(c, dev, rop, stream, timeout):
        waited(c, lambda: _allreduce_device(c, dev, rop, stream, buf), timeout)
    return buf


def _allreduce_device_now(
    c: Client, dev: DeviceBuffer, rop: ReduceOp, stream: Any, timeout: float | None
) -> bool:
    """A blocking all-reduce of device buffer `dev` in one piece with its copies in line on the
    caller's stream (Client.device_allreduce_now), where it can go so; False, with nothing done,
    where it cannot (in pieces, or no stream to run them in line on)."""
    explicit = None if stream is None else stream_handle(stream)
    here = c.in_line(dev, explicit) if dev.count and whole(c, dev.nbytes) else None
    if here is None:
        return False
    c.device_allreduce_now(dev, rop, here, timeout)
    return True


def waited(c: Client, start: Callable[[], Handle], timeout: float | None) -> Any:
    """A blocking call: `start()` the collective inside Client.waiting (a device buffer's SUBMIT
    then goes from the wait, on this thread) and wait for it."""
    with c.waiting():
        h = start()
    try:
        return h.wait(timeout)
    except CollectiveTimeoutError:
        # Nobody waits for it again, and its caller is told it failed: whichever thread takes its DONE
        # completes it (its memory goes back), but its result is dropped, as a fast call's is: nothing
        # writes the caller's buffer after the error.
        h._drop()
        raise


def _one_piece(nbytes: int, piece_bytes: int) -> bool:
    return piece_bytes <= 0 or nbytes <= piece_bytes


def whole(c: Client, nbytes: int) -> bool:
    """Whether an all-reduce of `nbytes` goes in one piece in this job (pieces, Client.piece_bytes)."""
    return _one_piece(nbytes, c.piece_bytes)


def _usable_array(c: Client, buf: np.ndarray) -> DType | None:
    """`buf`'s dtype where it is a host array the engine's one-piece path takes as it is: the checks
    as_buffer makes, in their cheapest form (this runs on every call). None: anything else, which
    goes the general way, where it is refused with the full message or cut into pieces."""
    dt = dtype_from_numpy(buf.dtype)
    flags = buf.flags
    if dt is not None and flags.c_contiguous and flags.writeable and whole(c, buf.nbytes):
        return dt
    return None


def _allreduce_array_async(c: Client, buf: np.ndarray, rop: ReduceOp) -> Handle | None:
    """allreduce_async of a numpy array in one piece, straight to the engine (as _allreduce_pieces
    would send it, without a BufferView and the piece machinery around it). None: the general way."""
    dt = _usable_array(c, buf)
    if dt is None:
        return None
    flat = buf if buf.ndim == 1 else buf.reshape(-1)
    return c.start_allreduce(flat, dt, buf.size, rop, buf, flat)


def allreduce_async_at(
    c: Client, addr: int, dtype: DType, count: int, rop: ReduceOp, owner: Any, result: Any
) -> Handle:
    """allreduce_async of `count` elements of `dtype` at address `addr`, in place and in one piece:
    host memory that `owner` owns (a torch tensor and its data_ptr(): its numpy view costs more than
    the rest of the call, so none is made). The engine copies in from the address and, whoever
    completes the collective, back to it (the engine keeps `owner` alive until then). The caller
    checked `count` (non-zero), `dtype` and that it goes whole (`whole`), as allreduce_now's callers
    do."""
    return c.start_allreduce(addr, dtype, count, rop, result, owner)


def _parts_result(pv: PartsView) -> tuple[np.ndarray, np.ndarray]:
    """Where a fused collective's result goes: one new 1-D array (storage dtype), and the same memory
    as the parts' own dtype (ml_dtypes' bfloat16 stays itself) for wait() to return."""
    out = np.empty(pv.count, pv.dtype.storage)
    dtype = pv.parts[0].result_dtype
    return out, out.view(dtype) if dtype is not None else out


def allreduce_parts_async(c: Client, parts: Sequence[Any], op: Any = ReduceOp.SUM) -> Handle:
    """All-reduce the concatenation of `parts` (host arrays of one dtype) without packing them first:
    each is copied straight into the shared slot. wait() returns a new 1-D array, the parts' result
    one after another (the parts themselves are not written)."""
    rop = check_op(op)
    pv = as_parts(parts)
    return _allreduce_pieces(c, pv, rop, *_parts_result(pv))


def broadcast_parts_async(c: Client, parts: Sequence[Any], root: int = 0) -> Handle:
    """Root's `parts`, concatenated, on every rank, without packing them first (see allreduce_parts_async).
    Every rank passes parts of the same sizes; only root's are read."""
    root = _check_root(c, root)
    pv = as_parts(parts)
    out, result = _parts_result(pv)
    mine = c.rank == root
    return c.start_async(
        Kind.BROADCAST, _sources(pv) if mine else NO_DATA, pv.dtype, pv.count, None, root, out, 0,
        out.nbytes, None, result, pv.keepalive,
    )  # fmt: skip


def _other_step(c: Client, dev: DeviceBuffer, out: DeviceBuffer | None = None) -> NodeStep | None:
    """The GPU step a device reduce-scatter, all-gather or broadcast takes (Client.node_step): on one
    node nothing then crosses PCIe; across nodes each rank sends its slice of the node's sum (a
    reduce-scatter) and takes back only its slice of the result."""
    step = c.node_step(dev)
    if step is not None and out is not None and out.device != dev.device:
        raise UnsupportedBufferError(
            f"the output is on cuda:{out.device}, the input on cuda:{dev.device} (the node's GPU step "
            "writes the input's device)"
        )
    return step


def broadcast_async(c: Client, buf: Any, root: int = 0, stream: Any = None) -> Handle:
    root = _check_root(c, root)
    dev = c.device_buffer(buf, "buffer", writable=True)
    if dev is not None:
        step = _other_step(c, dev)
        if step is not None:
            return start_step(c, step, dev, None, stream, buf, Kind.BROADCAST, root=root)  # type: ignore[return-value]
        mine = c.rank == root
        src, outs = (dev, []) if mine else (None, [(dev, 0, dev.nbytes)])
        plan = c.device_plan(src, outs, stream, dev, dev.keepalive)
        return c.submit(Kind.BROADCAST, dev.dtype, dev.count, None, root, buf, plan)
    _no_stream(stream)
    view = as_buffer(buf, writable=True)
    mine = c.rank == root
    # The root sends its buffer and takes nothing back; the others send nothing and take it all.
    arr = view.array
    sent, back = (arr, NO_DATA) if mine else (NO_DATA, arr)
    return c.start_async(
        Kind.BROADCAST, sent, view.dtype, view.count, None, root, back, 0, arr.nbytes, None, buf,
        view.keepalive,
    )  # fmt: skip


def allgather_async(c: Client, buf: Any, out: Any = None, stream: Any = None) -> Handle:
    dev = c.device_buffer(buf, "buffer", writable=False)
    if dev is not None:
        n = dev.count * c.size
        out, odev = _device_out(c, out, dev, (c.size, *dev.shape), n, "allgather out")
        step = _other_step(c, dev, odev)
        if step is not None:
            return start_step(c, step, dev, None, stream, out, Kind.ALLGATHER, out=odev)  # type: ignore[return-value]
        plan = c.device_plan(dev, [(odev, 0, odev.nbytes)], stream, dev, (dev.keepalive, odev.keepalive))
        return c.submit(Kind.ALLGATHER, dev.dtype, dev.count, None, 0, out, plan)
    _no_stream(stream)
    view = as_buffer(buf, writable=False)
    if out is None:
        out = _new_array((c.size, *view.shape), view)
        out_view = as_buffer(out, writable=True)
    else:
        out, out_view = _out_view(c, out, view.dtype, view.count * c.size, "allgather out")
    dst = out_view.array
    return c.start_async(
        Kind.ALLGATHER, view.array, view.dtype, view.count, None, 0, dst, 0, dst.nbytes, None, out,
        (view.keepalive, out_view.keepalive),
    )  # fmt: skip


def _part_shape(shape: tuple[int, ...], part: int, size: int) -> tuple[int, ...]:
    if shape and shape[0] % size == 0:
        return (shape[0] // size, *shape[1:])
    return (part,)


def reduce_scatter_async(
    c: Client, buf: Any, op: Any = ReduceOp.SUM, out: Any = None, stream: Any = None
) -> Handle:
    rop = check_op(op)
    dev = c.device_buffer(buf, "buffer", writable=False)
    count = dev.count if dev is not None else None
    view = None
    if dev is None:
        _no_stream(stream)
        view = as_buffer(buf, writable=False)
        count = view.count
    assert count is not None
    if count % c.size:
        raise InvalidArgumentError(
            f"reduce_scatter: {count} elements cannot be split evenly among {c.size} ranks"
        )
    part = count // c.size
    lo = c.rank * part
    if dev is not None:
        shape = _part_shape(dev.shape, part, c.size)
        out, odev = _device_out(c, out, dev, shape, part, "reduce_scatter out")
        step = _other_step(c, dev, odev)
        if step is not None:
            return start_step(c, step, dev, rop, stream, out, Kind.REDUCE_SCATTER, out=odev)  # type: ignore[return-value]
        isz = dev.dtype.itemsize
        plan = c.device_plan(
            dev, [(odev, lo * isz, part * isz)], stream, dev, (dev.keepalive, odev.keepalive)
        )
        return c.submit(Kind.REDUCE_SCATTER, dev.dtype, dev.count, rop, 0, out, plan)
    assert view is not None
    if out is None:
        out = _new_array(_part_shape(view.shape, part, c.size), view)
        out_view = as_buffer(out, writable=True)
    else:
        out, out_view = _out_view(c, out, view.dtype, part, "reduce_scatter out")
    isz = view.dtype.itemsize
    return c.start_async(
        Kind.REDUCE_SCATTER, view.array, view.dtype, view.count, rop, 0, out_view.array, lo * isz,
        view.nbytes, None, out, (view.keepalive, out_view.keepalive),
    )  # fmt: skip


def barrier_async(c: Client) -> Handle:
    return c.start_async(Kind.BARRIER, NO_DATA, DType.UINT8, 0, None, 0, NO_DATA, 0, 0, None, None, None)


def barrier(c: Client, timeout: float | None) -> None:
    """The blocking barrier: through the engine in one call where it can (Client.barrier_now: no
    Handle, no DONE thread woken), else barrier_async(...).wait(). The same SUBMIT either way."""
    if not c.barrier_now(timeout):
        barrier_async(c).wait(timeout)


def _check_root(c: Client, root: Any) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise InvalidArgumentError(f"root must be an int rank, got {root!r}")
    if not 0 <= int(root) < c.size:
        raise InvalidArgumentError(f"root {root} is out of range for {c.size} ranks")
    return int(root)
