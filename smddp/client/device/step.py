"""The GPU step in the client: a node's ranks run device collectives on their GPUs (docs/gpu.md)."""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from smddp import _engine
from smddp.client.device.buffers import DeviceBuffer, library_stream, stream_handle
from smddp.errors import CollectiveTimeoutError, DeviceError, NotInitializedError, SmddpError, fresh
from smddp.proto.dtypes import DType, Kind, ReduceOp

if TYPE_CHECKING:
    from smddp.client.session import Client

log = logging.getLogger("smddp.client")

#: Why a job's node step is not used, where nothing was tried yet.
UNDECIDED = "no device collective yet"

#: What a handle's messages call each collective the step runs.
WHAT = {
    Kind.ALLREDUCE: "all-reduce",
    Kind.REDUCE_SCATTER: "reduce-scatter",
    Kind.ALLGATHER: "all-gather",
    Kind.BROADCAST: "broadcast",
}


class NodeStep:
    """This rank's GPU step (smddp._engine.DeviceStep), joined with its node's other ranks; what keeps
    each all-reduce's buffer alive until the GPUs are done with it; and the thread that completes its
    handles for callbacks (started on the first). Its collective calls come from any thread, one at a
    time, and in the same order on every rank of the node, as every collective's do. `fail` fails the
    client (a device error, or a caller told its call timed out while the GPUs may still write)."""

    def __init__(
        self,
        step: _engine.DeviceStep,
        device: int,
        default_timeout_s: float,
        fail: Callable[[SmddpError], None],
        client_rank: int = 0,
        world: int = 1,
    ) -> None:
        self.step = step
        self.device = device
        self.client_rank = client_rank  # (the job's rank and size: a broadcast's root, an all-gather's rows)
        self.world = world
        self.default_timeout_s = default_timeout_s
        self.fail = fail
        self.count = 0  # node collectives started
        self._lock = threading.Lock()  # one start at a time: the pieces are numbered in call order
        self._alive: collections.deque[tuple[_engine.StepDone, Any]] = collections.deque()
        self._pending: queue.SimpleQueue[StepHandle | None] = queue.SimpleQueue()
        self._completer: threading.Thread | None = None

    def call(
        self, kind: Kind, dev: DeviceBuffer, enqueue: Callable[[], _engine.StepDone], keepalive: Any,
        consumer: int | None, consumer_of: Callable[[], int], result: Any,
    ) -> StepHandle:  # fmt: skip
        """A node collective on the step: `enqueue` (one of the step's calls) under the lock, the
        buffers it reads and writes (`keepalive`) kept until the GPUs are done with them."""
        with self._lock:
            self._prune_locked()
            done = enqueue()
            self._alive.append((done, keepalive))
        return self.handle(done, dev, consumer, consumer_of, result, kind)

    def start_across(
        self, kind: Kind, engine: _engine.DeviceEngine, arena: Any, slots: list[tuple[int, int]],
        dev: DeviceBuffer, op: ReduceOp | None, producer: int | None, out: DeviceBuffer | None, root: int,
    ) -> tuple[_engine.StepDone, list[_engine.CopyIn], list[tuple[int, int, int, int, int, int]]]:  # fmt: skip
        """Across nodes (Client.submit_step_pieces): collective `kind`'s pieces of `dev` enqueued, what
        each sends copied into its slot (`slots`; (-1, 0): none) by `engine`'s device path; an
        all-gather's into `out`, a broadcast's from rank `root`."""
        s, dt, c = self.step, int(dev.dtype), self.client_rank
        with self._lock:
            self._prune_locked()
            if kind is Kind.ALLREDUCE:
                assert op is not None
                done, copies, pieces = s.allreduce_across(
                    engine, arena, slots, dev.ptr, dev.count, dt, int(op), producer
                )
            elif kind is Kind.REDUCE_SCATTER:
                assert op is not None and out is not None
                done, copies, pieces = s.reduce_scatter_across(
                    engine, arena, slots, dev.ptr, out.ptr, out.count, dt, int(op), self.world, c, producer
                )
            elif kind is Kind.ALLGATHER:
                assert out is not None
                done, copies, pieces = s.allgather_across(
                    engine, arena, slots, dev.ptr, out.ptr, dev.count, dt, self.world, producer
                )
            else:
                done, copies, pieces = s.broadcast_across(
                    engine, arena, slots, dev.ptr, dev.count, dt, c == root, producer
                )
            self._alive.append((done, dev.keepalive if out is None else (dev.keepalive, out.keepalive)))
            return done, copies, pieces

    def _prune_locked(self) -> None:
        """(lock held) Lets go of the buffers the GPUs are done with (the oldest first: they end in order)."""
        while self._alive and _ended(self._alive[0][0]):
            self._alive.popleft()

    def handle(
        self, done: _engine.StepDone, dev: DeviceBuffer, consumer: int | None, consumer_of: Callable[[], int],
        result: Any, kind: Kind = Kind.ALLREDUCE,
    ) -> StepHandle:  # fmt: skip
        with self._lock:
            self.count += 1
            number = self.count
        return StepHandle(self, done, number, dev.dtype, dev.count, result, consumer, consumer_of, kind)

    def watch(self, h: StepHandle) -> None:
        """`h` completed by the completer thread (its callbacks run there), in start order."""
        with self._lock:
            if self._completer is None:
                self._completer = threading.Thread(target=self._complete_all, name="smddp-step", daemon=True)
                self._completer.start()
        self._pending.put(h)

    def _complete_all(self) -> None:
        while (h := self._pending.get()) is not None:
            if not h._settle(h.default_timeout_s):
                h._finish(CollectiveTimeoutError.waiting(h.default_timeout_s, h._what()))

    def close(self, timeout_s: float) -> bool:
        """The step's last work waited for (bounded), then its memory and lanes let go of: whether it
        could (else they stay, with the buffers they write, until the process ends)."""
        self._pending.put(None)
        closed = bool(self.step.close(timeout_s))
        if closed:
            self._alive.clear()
        return closed


def _ended(done: _engine.StepDone) -> bool:
    try:
        return bool(done.done())
    except DeviceError:
        return True  # (failed: the GPUs no longer run it; its handle says why)


class StepHandle:
    """A node collective on the GPUs (NodeStep.call). wait() blocks the host until the node's ranks
    have done it on their devices (polled, with its timeout: a peer that never comes is a timeout,
    not a hang), then orders the caller's stream after it."""

    def __init__(
        self, owner: NodeStep, done: _engine.StepDone, number: int, dtype: DType, count: int, result: Any,
        consumer: int | None, consumer_of: Callable[[], int], kind: Kind = Kind.ALLREDUCE,
    ) -> None:  # fmt: skip
        self.kind = kind
        self._owner = owner
        self._done = done
        self.seq = number
        self.dtype = dtype
        self.count = count
        self._result = result
        self._consumer = consumer
        self._consumer_of = consumer_of
        self.default_timeout_s = owner.default_timeout_s
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._error: SmddpError | None = None
        self._callbacks: list[Callable[[Any], None]] | None = None
        self._dropped = False

    def _what(self) -> str:
        return f"the node's GPU {WHAT[self.kind]} #{self.seq} ({self.dtype.label}, count={self.count})"

    def _settle(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the device; whether it ended (or failed, kept as its error)."""
        if self._finished.is_set():
            return True
        try:
            if not self._done.wait(timeout_s):
                return False
        except DeviceError as e:
            err = DeviceError(f"{self._what()}: {e}")
            self._owner.fail(err)  # (the node's flags are past repair: the job fails)
            self._finish(err)
            return True
        self._finish(None)
        return True

    def _finish(self, error: SmddpError | None) -> None:
        with self._lock:
            if self._finished.is_set():
                return
            self._error = error
            self._finished.set()
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:
                log.exception("smddp: a done-callback of %s raised", self._what())

    def done(self) -> bool:
        if self._finished.is_set():
            return True
        return self._settle(0.0)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        with self._lock:
            if not self._finished.is_set():
                if self._callbacks is None:
                    self._callbacks = []
                    self._owner.watch(self)
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: float | None = None, stream: Any = None) -> Any:
        t = self.default_timeout_s if timeout is None else timeout
        if not self._settle(t):
            raise CollectiveTimeoutError.waiting(t, self._what())
        if self._error is not None:
            raise fresh(self._error)
        if not self._dropped:
            if stream is not None:
                consumer = stream_handle(stream)
            else:
                consumer = self._consumer if self._consumer is not None else self._consumer_of()
            self._done.order(consumer)
        return self._result

    def synchronize(self, timeout: float | None = None) -> Any:
        """wait(): the result is in device memory once it returns (any stream may read it)."""
        return self.wait(timeout)

    def _wait(self, timeout_s: float) -> Any:
        return self.wait(timeout_s)

    def _drop(self) -> None:
        """Its caller was told it timed out: no stream is ordered after it from now on, and the client
        fails (so the job ends): the GPUs would still write the caller's buffer once the node's other
        ranks come, and nothing may write it after an error."""
        self._dropped = True
        self._owner.fail(
            CollectiveTimeoutError(
                f"{self._what()} timed out; the GPUs may still write its buffer, so the job fails"
            )
        )


def decide(c: Client, dev: DeviceBuffer) -> tuple[NodeStep | None, str]:
    """Whether this job's device collectives take the GPU step, decided by every rank together at the
    first one (a collective: every rank calls it at the same point, as that collective): the step
    made and joined where this rank can, then the job's agreement (every rank could). (step, "") or
    (None, why not). With `node_reduce` gpu, a step that cannot be had raises DeviceError instead."""
    mode = c.config.node_reduce
    why = ""
    if c.local_size > _engine.DeviceStep.max_ranks:
        why = f"the GPU step takes up to {_engine.DeviceStep.max_ranks} ranks a node (this node has {c.local_size})"
    step: _engine.DeviceStep | None = None
    if not why:  # (what every rank knows alike needs no exchange)
        try:
            step = _engine.DeviceStep(
                c.device_runtime().driver_library(),
                dev.device,
                c.local_rank,
                c.local_size,
                c.config.step_slot_bytes,
            )
        except DeviceError as e:
            why = f"rank {c.rank}: {e}"
        # Every rank's card: its row of a zeroed table, summed (uint8: only its owner writes a row).
        cards = np.zeros((c.size, _engine.DeviceStep.card_bytes), np.uint8)
        if step is not None:
            cards[c.rank] = np.frombuffer(step.card(), np.uint8)
        _exchange(c, cards, ReduceOp.SUM)
        if step is not None:
            first = c.rank - c.local_rank
            try:
                step.join([cards[first + j].tobytes() for j in range(c.local_size)])
            except DeviceError as e:
                why = f"rank {c.rank}: {e}"
                step.close(0)
                step = None
        ok = np.array([0 if step is None else 1], np.int32)
        _exchange(c, ok, ReduceOp.MIN)
        if ok[0] == 0 and not why:
            why = "another rank could not join its node's GPU step (its log says why)"
            if step is not None:
                step.close(0)  # (no piece was started: nothing to wait for)
                step = None
    if step is None:
        if mode == "gpu":
            raise DeviceError(f"node_reduce gpu: the node's ranks cannot sum on their GPUs: {why}")
        log.warning("rank %d: device all-reduces go through the host (node_reduce auto): %s", c.rank, why)
        return None, why
    log.info("rank %d: device all-reduces sum on the node's GPUs (cuda:%d)", c.rank, dev.device)
    return NodeStep(step, dev.device, c.config.timeout_s, c._device_failed, c.rank, c.size), ""


def _exchange(c: Client, buf: np.ndarray, op: ReduceOp) -> None:
    """A blocking all-reduce of the host array `buf` in place (the engine's one pass), for decide."""
    dtype = DType.UINT8 if buf.dtype == np.uint8 else DType.INT32
    if not c.allreduce_now(buf, dtype, buf.size, op, None):
        raise NotInitializedError("smddp is shutting down")  # (allreduce_now does nothing then)


def start(
    c: Client, step: NodeStep, dev: DeviceBuffer, op: ReduceOp | None, stream: Any, result: Any,
    kind: Kind = Kind.ALLREDUCE, out: DeviceBuffer | None = None, root: int = 0,
) -> StepHandle:  # fmt: skip
    """The node collective `kind` of device buffer `dev` on `step` (an all-reduce and a broadcast in
    place, a reduce-scatter and an all-gather into `out`; a broadcast from rank `root`), after the
    work its producer queued (the stream passed, the buffer's, or its library's current one),
    ordered at wait() before the consumer's (the stream passed, the buffer's, or the current one
    then)."""
    explicit = None if stream is None else stream_handle(stream)
    io = c._device_io()
    producer = io.producer_stream(dev, explicit)
    consumer = explicit if explicit is not None else (dev.stream if dev.stream_given else None)
    c.refuse_capture(dev.device, producer, consumer)

    def consumer_of() -> int:
        return library_stream(io.rt, dev.library, dev.device)

    s, dt, world = step.step, int(dev.dtype), c.size
    keep = dev.keepalive if out is None else (dev.keepalive, out.keepalive)
    enqueue: Callable[[], _engine.StepDone]
    if c.job.nnodes > 1:
        # Across nodes: what each rank sends goes to the daemons, and its slice of the result comes
        # back, which the node then gathers (a reduce-scatter's: its own block, in place).
        done = c.submit_step_pieces(step, kind, dev, op, producer, out, root)
        return step.handle(done, dev, consumer, consumer_of, result, kind)
    if kind is Kind.ALLREDUCE:
        assert op is not None
        enqueue = partial(s.allreduce, dev.ptr, dev.count, dt, int(op), world, producer)
    elif kind is Kind.REDUCE_SCATTER:
        assert op is not None and out is not None
        enqueue = partial(s.reduce_scatter, dev.ptr, out.ptr, out.count, dt, int(op), world, producer)
    elif kind is Kind.ALLGATHER:
        assert out is not None
        enqueue = partial(s.allgather, dev.ptr, out.ptr, dev.count, dt, producer)
    else:
        enqueue = partial(s.broadcast, dev.ptr, dev.count, dt, root - (c.rank - c.local_rank), producer)
    return step.call(kind, dev, enqueue, keep, consumer, consumer_of, result)
