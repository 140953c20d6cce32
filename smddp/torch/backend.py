"""The `smddp` torch.distributed backend: a Python ProcessGroup whose collectives run on smddp's daemons."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName
from torch.futures import Future

import smddp
from smddp import settings
from smddp.client.collectives import allreduce_async_at, whole
from smddp.client.device.buffers import described
from smddp.client.device.runtime import BUILTIN as BUILTIN_RUNTIMES
from smddp.client.session import Latch, when_all
from smddp.errors import CollectiveError, CollectiveTimeoutError, ConfigError, SmddpError, fresh
from smddp.launcher.elastic import join_through_store, under_smddp_launch
from smddp.proto.dtypes import DType, dtype_from_numpy
from smddp.torch import native

BACKEND_NAME = "smddp"
log = logging.getLogger("smddp.torch")

# torch dtypes smddp carries (see smddp.proto.dtypes); anything else is refused with its name.
SUPPORTED_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
)

_OPS = {
    dist.ReduceOp.SUM: smddp.SUM,
    dist.ReduceOp.AVG: smddp.AVG,
    dist.ReduceOp.MIN: smddp.MIN,
    dist.ReduceOp.MAX: smddp.MAX,
}
_NO_TIME = timedelta(0)  # an options' timeout at or below this is unset
_OP_NAMES = ("SUM", "AVG", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM")


class UnsupportedCollectiveError(SmddpError, NotImplementedError):
    """The smddp backend does not implement this collective, op, dtype or group; nothing was sent."""


class TraceEvent:
    """One collective as the backend saw it: what, how many bytes, when submitted and when complete."""

    __slots__ = ("done", "name", "nbytes", "submitted")

    def __init__(self, name: str, nbytes: int, submitted: float) -> None:
        self.name = name
        self.nbytes = nbytes
        self.submitted = submitted
        self.done: float | None = None

    def __repr__(self) -> str:
        return f"TraceEvent({self.name}, {self.nbytes} B, submitted={self.submitted:.6f}, done={self.done})"


# -- Work ----------------------------------------------------------------------------------------


def _nothing() -> None:
    pass


# A device Work's completion, until someone takes it: its handles, its copy-back, the tensors it touches.
_DeviceJob = tuple[list[smddp.Handle], Callable[[], None] | None, list[torch.Tensor]]


def _deadline(work: SmddpWork, timeout_s: float | None) -> float:
    """When a completion of `work` gives up: `timeout_s` from now (a wait's), else the Work's timeout."""
    return time.monotonic() + (work._timeout.total_seconds() if timeout_s is None else timeout_s)


def _untraced(base: type) -> Callable[[type], type]:
    """A class decorator: every method of the class that overrides one of torch's `base` runs with
    TorchDynamo's frame hook off, so never traced.

    torch calls these from C++ (the trampoline of a Python ProcessGroup or Work), also while a compiled
    function runs: a DDP model under torch.compile syncs its buffers in forward through
    dist._broadcast_coalesced, and a compiled graph's functional collectives call the group. Dynamo
    would take the call's Python frame for one to compile, and cannot trace a Python process group
    (the step fails: "Attempted to access unregistered member on an OpaqueObject").
    """

    def decorate(cls: type) -> type:
        for name, fn in list(vars(cls).items()):
            if not name.startswith("__") and callable(fn) and hasattr(base, name):
                setattr(cls, name, _hook_off(fn))
        return cls

    return decorate


try:  # Dynamo's C hook, without importing Dynamo (a second)
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # (an older torch: torch.compiler.disable, below)
    _set_eval_frame = None  # type: ignore[assignment]


def _hook_off(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with Dynamo's frame hook off while it runs, the hook put back after (see _untraced)."""
    if _set_eval_frame is None:
        # (its own way, which imports Dynamo, about a second, and costs ~0.6 us a call)
        return torch.compiler.disable(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        prior = _set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            _set_eval_frame(prior)

    return run


if _set_eval_frame is not None:
    # The hook runs `run`'s frames itself, never traces them (what Dynamo's skip_code does): one code
    # object for every wrapper.
    set_code_exec_strategy(
        _hook_off(lambda: None).__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT)
    )


@_untraced(dist.Work)
class SmddpWork(dist.Work):
    """An in-flight smddp collective as a torch Work.

    `wait()` raises the smddp error (a CollectiveError subclass) when the collective failed.
    `get_future()` returns a future that C++ consumers (DDP's reducer) see fail as well: it is
    chained with `then`, so a failure is raised inside the callback and torch records it as the
    future's error, a real C++ exception rather than a value.

    Works complete where they are consumed. A Work that is waited for is completed by the waiting
    thread itself (its handles' waits take their DONEs off the ring, the engine's all-reduce copies
    its result out there; a device Work's results are ordered before that thread's current stream,
    as its blocking calls' are): no other thread is woken for it. Only once something needs it to
    complete on its own (`get_future()`, `is_completed()` and the other polls, or the Work being
    dropped unwaited) is it armed: a host Work's handles' callbacks, and the client's DONE thread
    completes it (and the watchdog fails it at its timeout); a device Work goes to the completer
    thread, which finishes it on its route's side stream.
    """

    # Class defaults, each set on a Work only when it applies (a host Work is made on every
    # asynchronous call, and each attribute set costs there).
    _trace: TraceEvent | None = None
    _event: Any = None  # device Works: reached once the result is in the tensors
    _error: BaseException | None = None
    _completing = False
    _unwatch: Callable[[], None] = staticmethod(_nothing)  # the watchdog's, once it watches this Work
    _handles: Sequence[smddp.Handle] = ()  # host Works: what wait() drives (_drive)
    _collectives: Sequence[smddp.Handle] = ()  # every Work's: what a timeout drops (_time_out)
    # Host Works: the copy back into non-contiguous tensors, run by whoever completes the Work.
    _finish: Callable[[], None] | None = None
    _armed = False  # host Works: the handles' callbacks complete it (_arm)
    # Device Works not yet handed to anyone: (handles, finish, touched), taken once, by a waiter
    # (_drive_device, in its own thread) or by whatever needs the Work to complete on its own (the
    # completer thread: _arm).
    _job: _DeviceJob | None = None
    _value: Any = None  # what the base future holds once complete
    # Made only when asked for (get_future): a device-aware future's set_result alone took 34 us on an
    # H200's host (its then() chain besides), and a Work only waited for (torch's blocking calls)
    # never needs one.
    # Asked for before completion (DDP's reducer asks at once), it is completed with the Work's
    # tensors where the completion runs, and records its event there; asked for later, it is
    # completed then, ordered after the Work's event (_Device.settle).
    _base: Future[Any] | None = None
    _future: Future[Any] | None = None
    # Device Works completed in the caller's thread (_Device.complete_here): the raw handle of the
    # stream that already waits for the result, so that wait() on that stream has nothing to add.
    _ordered: int | None = None

    def __init__(
        self,
        name: str,
        result: Any,
        timeout: timedelta,
        trace: TraceEvent | None = None,
        device: _Device | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self._result = result
        self._timeout = timeout
        self._done = Latch()
        self._lock = threading.Lock()
        if trace is not None:
            self._trace = trace
        self._device: _Device = _HOST if device is None else device

    def _unwrap(self, _fut: Future[Any]) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def _complete(
        self,
        error: BaseException | None,
        value: Any = None,
        finish: Callable[[], None] | None = None,
        won: Callable[[], None] | None = None,
    ) -> None:
        """Complete once: the first of the waiter, the handles' callback and the watchdog's timeout wins.

        `value` is what the base future holds: a device Work's tensors, so that the device-aware
        future records its event on the current stream (none is recorded for a value without them).
        `finish` (the copy back) runs only for the one that wins, before anyone sees the Work done;
        so does `won`, whatever the outcome.
        """
        with self._lock:
            if self._completing:
                return
            self._completing = True
        if won is not None:
            won()
        if finish is not None and error is None:
            try:
                finish()
            except BaseException as e:  # a bug in a copy back: the Work fails with it, never hangs
                error = e
        if self._trace is not None:
            self._trace.done = time.perf_counter()
        self._error = error
        self._value = value
        self._unwatch()
        with self._lock:  # a future made from now on is made complete (get_future)
            # Completed before the future says so: whoever the future wakes sees is_completed() true.
            self._done.set()
            base = self._base
        if base is not None:
            base.set_result(value)  # runs _unwrap: the chained future gets the result or the error

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done; raises the collective's error. A zero/None timeout means the group's.

        CUDA tensors: the host blocks until the result has arrived and its copy to the device is
        enqueued; the caller's current stream then waits for that copy (as with NCCL's Work).
        """
        t = self._timeout if timeout is None or timeout <= _NO_TIME else timeout
        deadline = time.monotonic() + t.total_seconds()
        if self._handles and not self._done.is_set():
            self._drive(deadline)
        elif self._job is not None:
            self._drive_device(deadline)
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            timed_out = CollectiveTimeoutError.waiting(t.total_seconds(), self.name)
            self._time_out(timed_out)
            if not self._done.is_set():  # another thread won its completion, and is not through it yet
                raise timed_out
        if self._error is not None:
            err = self._error
            if isinstance(err, SmddpError):
                raise fresh(err)
            raise CollectiveError(f"smddp {self.name} failed: {err!r}")
        self._device.order(self)
        return True

    def _time_out(self, error: CollectiveTimeoutError) -> None:
        """Not complete in time (its waiter's timeout, or the watchdog's): it fails with `error` and, as
        torch's contract says of a collective that timed out, writes nothing more into its tensors:
        its collectives go on (every rank needs them) but their late results are dropped. A Work that
        completed meanwhile keeps its result."""
        self._complete(error, won=self._drop_all)

    def _drop_all(self) -> None:
        for h in self._collectives:
            h._drop()

    def _drive(self, deadline: float) -> None:
        """Host Works: wait for the handles on this thread (their waits take the DONEs off the client's
        ring here), then complete the Work here: nothing else is woken for a Work that is waited for."""
        for h in self._handles:
            try:
                h._wait(max(0.0, deadline - time.monotonic()))
            except CollectiveTimeoutError:
                return  # not in time: still in flight, and the wait below says so
            except SmddpError as e:
                self._complete(e)
                return
        self._complete(None, finish=self._finish)

    def _take_job(self) -> _DeviceJob | None:
        """A device Work's job, for the one caller that takes it (a waiter, or _arm); None once taken."""
        with self._lock:
            job, self._job = self._job, None
        return job

    def _drive_device(self, deadline: float) -> None:
        """Device Works: completed in the waiting thread, its current stream ordered after the results'
        copies (the route's complete_here, as for a blocking call): no completer thread is woken, no
        side stream switched to. A collective not in time within the wait's own timeout fails the
        Work as the watchdog would (its results dropped: _time_out)."""
        job = self._take_job()
        if job is None:
            return  # the completer has it (armed meanwhile), or another waiter: the wait below waits
        handles, finish, touched = job
        try:
            self._device.complete_here(self, handles, finish, touched, max(0.0, deadline - time.monotonic()))
        except CollectiveTimeoutError as e:
            self._time_out(e)
        except BaseException as e:
            self._complete(e)

    def _arm(self) -> None:
        """From now on the Work completes on its own, for consumers that do not wait: a future's
        callbacks, DDP's reducer, a poll of is_completed(). Host Works: the handles' callbacks, in
        the thread that finishes the last; the watchdog at the timeout. Device Works: the completer."""
        if self._job is not None:
            job = self._take_job()
            if job is not None:
                _get_completer().put(self, *job)
            return
        with self._lock:
            if self._armed or self._completing or not self._handles:
                return
            self._armed = True
        _completer.watchdog.watch(self)
        if self._completing:  # a waiter completed it meanwhile, maybe before the watch: nothing to watch
            self._unwatch()
        _complete_on_done(self, self._handles, self._finish)

    def __del__(self) -> None:
        # Dropped unwaited and unarmed: the collective still runs on the other ranks, so its DONE must
        # still be taken, its result copied back and its memory given back (the handles' callbacks do
        # it without this Work).
        if self._handles and not self._armed and not self._completing:
            try:
                _complete_on_done(None, self._handles, self._finish)
            except Exception:  # the interpreter is ending, or the client is gone: nothing is left to take
                pass
        elif self._job is not None:
            # A device Work nobody waited for: the engine copies its results back and RELEASEs them
            # whatever happens here; the completer still orders the caching allocator's reuse of its
            # tensors after those copies (record_stream), as for a Work that was waited for.
            try:
                self._arm()
            except Exception:
                pass

    def get_future(self) -> Future[Any]:
        self._arm()
        with self._lock:
            if self._future is not None:
                return self._future
            base = self._base = self._device.future()
            future = self._future = base.then(self._unwrap)
            late = self._done.is_set()  # _complete found no future to complete: this one is made complete
        if late:
            self._device.settle(self, base)
        return future

    def is_completed(self) -> bool:
        """True once the result is in the tensors: for device Works, once the device has reached the
        copies' event (as NCCL's Work answers), not when they were enqueued; never blocks."""
        if not self._done.is_set():
            self._arm()
            if not self._done.is_set():
                return False
        return self._device.reached(self)

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        self.is_completed()
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        """CUDA tensors: the current stream waits for the result (if it has arrived); else nothing."""
        if self._done.is_set() and self._error is None:
            self._device.order(self)


@_untraced(dist.Work)
class _DoneWork(dist.Work):
    """A Work complete before it is returned: a blocking call (torch's `async_op=False`, which waits
    on the Work at once, in the same thread) that ran whole in the caller's thread. Nothing is left to
    wait for, so nothing is made for it: no event, no future until one is asked for, no watchdog."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._result = result
        self._future: Future[Any] | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> Future[Any]:
        if self._future is None:
            fut: Future[Any] = Future()
            fut.set_result(self._result)
            self._future = fut
        return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        pass


# torch dtypes a host tensor's `numpy()` view keeps (numpy has no bfloat16): what the blocking
# all-reduce hands smddp as an array, which takes the engine's one-pass path (smddp.allreduce).
_NUMPY_DTYPES = frozenset(SUPPORTED_DTYPES) - {torch.bfloat16}
# Their wire dtypes, for the blocking all-reduce's shortest path (_allreduce_one_now).
_WIRE = {t: dtype_from_numpy(torch.empty(0, dtype=t).numpy().dtype) for t in _NUMPY_DTYPES}
# Every supported dtype's wire dtype: what a device tensor is described to smddp as (CudaStreams.buf).
_DEVICE_WIRE: dict[torch.dtype, DType] = {
    t: w for t, w in {**_WIRE, torch.bfloat16: DType.BFLOAT16}.items() if w is not None
}


# -- the completion thread ------------------------------------------------------------------------


_Job = tuple[SmddpWork, list[smddp.Handle], Callable[[], None] | None, list[torch.Tensor]]


def _complete_on_done(
    work: SmddpWork | None, handles: Sequence[smddp.Handle], finish: Callable[[], None] | None
) -> None:
    """Host tensors: complete `work` from the handles' done-callbacks, in the thread that finished the last.

    No thread hop: the client's DONE thread (or a waiter) delivers the result, runs `finish` (copies
    back into non-contiguous tensors) and completes the torch future in one go. `work` None: a Work
    dropped unwaited, whose result still lands in its tensors.
    """

    def complete() -> None:
        try:
            for h in handles:
                h.wait(0.0)  # all finished: raises the first one's error, if any
        except BaseException as e:
            if work is not None:
                work._complete(e)
            return
        if work is not None:
            work._complete(None, finish=finish)
        elif finish is not None:
            try:
                finish()
            except Exception:
                log.exception("smddp: the copy back of a dropped Work failed")

    when_all(handles, complete)


class _Watchdog:
    """Fails host Works still running at their timeout, so that a torch future (which DDP waits on in
    C++, with no timeout) ends with CollectiveTimeoutError instead of hanging on a stopped rank.

    One thread per process, started on first use. It sleeps until the earliest deadline: it wakes
    for no collective that completes in time. Works are kept per timeout value in submission
    order (so, in deadline order), and leave as they complete.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._by_timeout: dict[timedelta, dict[int, tuple[float, SmddpWork]]] = {}
        self._thread: threading.Thread | None = None

    def watch(self, work: SmddpWork) -> None:
        deadline = time.monotonic() + work._timeout.total_seconds()
        key = id(work)
        with self._cv:
            queue_ = self._by_timeout.setdefault(work._timeout, {})
            first = not queue_
            queue_[key] = (deadline, work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="smddp-torch-watchdog", daemon=True)
                self._thread.start()
            elif first:
                self._cv.notify()
        work._unwatch = lambda: self._forget(work._timeout, key)

    def _forget(self, timeout: timedelta, key: int) -> None:
        with self._cv:
            q = self._by_timeout.get(timeout)
            if q is not None:
                q.pop(key, None)

    def _run(self) -> None:
        while True:
            expired: list[SmddpWork] = []
            with self._cv:
                now = time.monotonic()
                earliest = None
                for q in self._by_timeout.values():
                    while q:
                        key, (deadline, work) = next(iter(q.items()))
                        if deadline > now:
                            earliest = deadline if earliest is None else min(earliest, deadline)
                            break
                        del q[key]
                        expired.append(work)
                if not expired:
                    self._cv.wait(None if earliest is None else earliest - now)
            for work in expired:
                work._time_out(CollectiveTimeoutError.waiting(work._timeout.total_seconds(), work.name))


class _Completer:
    """One thread per process that completes device Works: waits for their handles in submission
    order and finishes each on its route's side stream, never on the caller's.

    Host Works need no thread (`_complete_on_done`); device ones do, because their copy-backs and
    event records run on a stream the caller does not own.
    """

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="smddp-torch-completer", daemon=True)
        self._thread.start()

    def put(
        self,
        work: SmddpWork,
        handles: list[smddp.Handle],
        finish: Callable[[], None] | None,
        touched: list[torch.Tensor] | None = None,
    ) -> None:
        self._q.put((work, handles, finish, touched or []))

    def _run(self) -> None:
        while True:
            work, handles, finish, touched = self._q.get()
            try:
                work._device.complete(work, handles, finish, touched)
            except BaseException as e:  # smddp's errors, a timeout, or a bug in a copy-out
                try:
                    work._complete(e)
                except Exception:  # never let one bad Work stop every later one from completing
                    pass


class _CompleterHolder:
    """The process's completion thread, watchdog and device routes, made on first use (groups and hook share them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.completer: _Completer | None = None
        self.watchdog = _Watchdog()
        self.routes: dict[Any, _DeviceRoute] = {}

    def get(self) -> _Completer:
        with self.lock:
            if self.completer is None:
                self.completer = _Completer()
            return self.completer

    def route(self, key: Any, make: Callable[[], DeviceStreams]) -> _DeviceRoute:
        """The route of device `key` (a CUDA device, or a registered runtime), made once: its side stream lives on it."""
        with self.lock:
            r = self.routes.get(key)
        if r is not None:
            return r
        new = _DeviceRoute(make())
        with self.lock:
            return self.routes.setdefault(key, new)


_completer = _CompleterHolder()


def _get_completer() -> _Completer:
    return _completer.get()


def _queue_work(
    work: SmddpWork,
    handles: list[smddp.Handle],
    finish: Callable[[], None] | None,
    touched: list[torch.Tensor] | None,
) -> None:
    """Arrange for `work` to complete: where it is consumed (host: SmddpWork._drive, or its handles'
    callbacks once armed), or on the completer (device)."""
    work._collectives = handles
    if work._device is _HOST:
        work._handles = handles
        work._finish = finish
        if not handles:
            work._complete(None, finish=finish)
    else:
        # Completed where it is consumed: by its waiter, or by the completer once armed (SmddpWork).
        work._job = (handles, finish, touched or [])


def _complete_here(
    work: SmddpWork,
    handles: list[smddp.Handle],
    finish: Callable[[], None] | None,
    touched: list[torch.Tensor],
) -> None:
    """A device Work that is waited for at once, completed in the calling thread (its route's
    `complete_here`): a failure, or a timeout, is the Work's error."""
    work._collectives = handles
    try:
        work._device.complete_here(work, handles, finish, touched)
    except CollectiveTimeoutError as e:
        work._time_out(e)
    except BaseException as e:
        work._complete(e)


# -- where a collective's tensors live ------------------------------------------------------------


class _Device:
    """Host tensors: smddp takes them as they are, and a Work is complete once the handles are."""

    def buf(self, t: torch.Tensor) -> Any:
        """What to hand smddp for tensor `t`: its numpy view where numpy holds its dtype (the same
        memory, read without the DLPack exchange), else the tensor."""
        if t.dtype not in _NUMPY_DTYPES:
            return t
        # detach() only where autograd needs it: each torch call is a dispatch, and costs several
        # times its own time in a step whose ranks come to the call from a barrier (cold caches).
        return t.detach().numpy() if t.requires_grad else t.numpy()

    def kw(self) -> dict[str, Any]:
        """Extra arguments of the smddp call (evaluated in the caller's thread, at the call)."""
        return {}

    def future(self) -> Future[Any]:
        return Future()

    def complete(
        self,
        work: SmddpWork,
        handles: list[smddp.Handle],
        finish: Callable[[], None] | None,
        touched: list[torch.Tensor],
        timeout_s: float | None = None,
    ) -> None:
        """In the completer thread: wait for the handles, run `finish`, complete the Work."""
        deadline = _deadline(work, timeout_s)
        for h in handles:
            h._wait(max(0.0, deadline - time.monotonic()))
        if finish is not None:
            finish()
        work._complete(None)

    # In the caller's thread, which waits for the Work at once: the same (a device route orders the
    # caller's stream itself there).
    complete_here = complete

    def settle(self, work: SmddpWork, base: Future[Any]) -> None:
        """Complete a future made after its Work completed (get_future)."""
        base.set_result(work._value)

    def order(self, work: SmddpWork) -> None:
        """After a host wait on a completed Work: make the caller's stream see the result."""

    def reached(self, work: SmddpWork) -> bool:
        """Of a completed Work: its result is in its tensors (any reader may read them now)."""
        return True


_HOST = _Device()


class DeviceStreams(Protocol):
    """The torch side of one device: its streams, events, kernels and futures, as a device Work's
    completion uses them. `CudaStreams` drives torch.cuda; smddp's test rigs double the same calls
    over the stand-in runtime (smddp_rigs.standin_torch), so that one completion code
    (`_DeviceRoute`) runs on both and an ordering bug in it shows without a GPU.
    """

    def buf(self, t: torch.Tensor) -> Any:
        """What to hand smddp for tensor `t` (a device buffer)."""
        ...

    def current(self) -> Any:
        """The calling thread's current stream (where the caller's kernels run)."""
        ...

    def handle(self, stream: Any) -> int:
        """`stream` as a raw handle (cudaStream_t) for smddp's `stream=`."""
        ...

    def current_handle(self) -> int:
        """`handle(current())`, in the least time (it is asked on every call)."""
        ...

    def new_stream(self) -> Any: ...

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Make `stream` the calling thread's current stream inside the block."""
        ...

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        """Run `fn`'s tensor operations as work of `stream` (the current stream, inside `on`)."""
        ...

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """The allocator must not reuse `t`'s memory before `stream` is past its work so far."""
        ...

    def new_event(self) -> Any: ...

    def record(self, event: Any, stream: Any) -> None: ...

    def wait(self, stream: Any, event: Any) -> None:
        """Later work on `stream` waits for `event`."""
        ...

    def follow(self, event: Any) -> None:
        """The calling thread's current stream waits for `event` already (it was recorded there after
        the wait): what the caller does next must see its work. Nothing on a GPU, where that is the
        caller's kernels, queued on that stream."""
        ...

    def follow_copy(self, record: Any) -> None:
        """follow() for a device record of smddp's whose copy back ran in line on the calling thread's
        current stream (Client.device_allreduce_now): nothing on a GPU either."""
        ...

    def query(self, event: Any) -> bool:
        """The device has reached `event` (never blocks)."""
        ...

    def future(self) -> Future[Any]:
        """A future whose value's readers are ordered after the streams current when it completes."""
        ...


class CudaStreams:
    """`DeviceStreams` of one CUDA device, through torch.cuda."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The current stream's raw handle without a Stream object (torch.cuda.current_stream costs
        # 8-11 us on an H200's host, most of it finding the device index): torch's own compiled code
        # asks it this way. Builds of torch without it take the public way.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        index = self.index = device.index if device.index is not None else 0
        self.current_handle = (lambda: int(raw(index))) if raw is not None else self._current_handle

    def buf(self, t: torch.Tensor) -> Any:
        """`t` described by its address, dtype and shape (no DLPack export: the call passes its stream)."""
        if not t.is_contiguous():  # the backend hands contiguous buffers only; never describe one wrongly
            raise UnsupportedCollectiveError(
                f"smddp: a non-contiguous {tuple(t.shape)} tensor reached the device path"
            )
        return described(t.data_ptr(), _DEVICE_WIRE[t.dtype], tuple(t.shape), self.index, "torch", t)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def _current_handle(self) -> int:
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[Any]:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield stream

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        fn()  # inside on(stream): torch enqueues its kernels on the current stream

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def follow(self, event: Any) -> None:
        pass

    def follow_copy(self, record: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def future(self) -> Future[Any]:
        return Future(devices=[self.device])


class _DeviceRoute(_Device):
    """Device tensors: handed to smddp on the caller's current stream; each Work finished on a side stream.

    A Work that something needs to complete on its own (a future, a poll: SmddpWork._arm) goes to
    the completer, which makes the side stream wait for each result's copy to the device, runs the copy-
    backs (`finish`) on it, records an event, and completes the Work's device-aware future (if one
    was asked for) with the Work's tensors while the side stream is current: the future records its
    own event there, and DDP's reducer, `future.wait()` and `then` callbacks order their streams
    after it. A future completed with a value that holds no device tensor records no event at all
    (torch's rule), and its readers would race the copies. `Work.wait()` orders the caller's stream
    after the Work's event. Nothing waits on the caller's stream but smddp's own copy-in stream,
    except for a Work the caller waits for (`complete_here`, at once or by Work.wait() before anything
    armed it): that thread's current stream waits for the result's copies itself, as the wait would
    make it, and the copy-backs run there.
    """

    def __init__(self, streams: DeviceStreams) -> None:
        self.streams = streams
        self.side = streams.new_stream()

    def buf(self, t: torch.Tensor) -> Any:
        return self.streams.buf(t)

    def kw(self) -> dict[str, Any]:
        return {"stream": self.streams.current_handle()}

    def future(self) -> Future[Any]:
        return self.streams.future()

    def complete(
        self,
        work: SmddpWork,
        handles: list[smddp.Handle],
        finish: Callable[[], None] | None,
        touched: list[torch.Tensor],
        timeout_s: float | None = None,
    ) -> None:
        s, side = self.streams, self.side
        deadline = _deadline(work, timeout_s)
        with s.on(side):
            for h in handles:
                h.wait(max(0.0, deadline - time.monotonic()), stream=s.handle(side))
            if finish is not None:
                s.launch(side, finish)
            for t in touched:
                # The caching allocator must not hand this memory out again before the side stream is past it.
                s.record_stream(t, side)
            ev = s.new_event()
            s.record(ev, side)
            work._event = ev
            # A future asked for already records its event on `side` (current here) for the devices
            # of the tensors it holds.
            work._complete(None, touched)

    def complete_here(
        self,
        work: SmddpWork,
        handles: list[smddp.Handle],
        finish: Callable[[], None] | None,
        touched: list[torch.Tensor],
        timeout_s: float | None = None,
    ) -> None:
        """In the caller's thread, which waits for the Work (at once: torch's blocking calls; or later:
        Work.wait()): the caller's stream waits for the results' copies itself, and the copy-backs run
        on it, so that no side stream is switched to (about 19 us each way on an H200's host).
        `timeout_s`: the wait's (None: the Work's)."""
        s = self.streams
        cur = s.current()
        handle = s.handle(cur)
        deadline = _deadline(work, timeout_s)
        for h in handles:
            h.wait(max(0.0, deadline - time.monotonic()), stream=handle)
        if finish is not None:
            s.launch(cur, finish)
        for t in touched:
            s.record_stream(t, cur)
        ev = s.new_event()
        s.record(ev, cur)
        work._event = ev
        work._ordered = handle
        work._complete(None, touched)

    def settle(self, work: SmddpWork, base: Future[Any]) -> None:
        """A future asked for after completion: completed on the side stream once that waits for the
        Work's event, so its readers are ordered after the result's copies."""
        s, side = self.streams, self.side
        with s.on(side):
            if work._event is not None:
                s.wait(side, work._event)
            base.set_result(work._value)

    def order(self, work: SmddpWork) -> None:
        if work._event is not None:
            s = self.streams
            if work._ordered is not None and s.current_handle() == work._ordered:
                s.follow(work._event)  # completed in this thread, whose stream waits for the result already
                return
            s.wait(s.current(), work._event)

    def reached(self, work: SmddpWork) -> bool:
        return work._event is None or self.streams.query(work._event)


def _device_of(tensors: Sequence[torch.Tensor], what: str) -> _Device:
    """Where one call's tensors live: all on the host, or all on one CUDA device."""
    # Host tensors (the hot path) build no set and make no device object; t.device only for CUDA ones.
    cuda = {t.device for t in tensors if t.is_cuda} if any(t.is_cuda for t in tensors) else None
    if cuda:
        if len(cuda) > 1 or len(cuda) != len({t.device for t in tensors}):
            names = ", ".join(sorted(str(d) for d in {t.device for t in tensors}))
            raise UnsupportedCollectiveError(
                f"smddp {what}: the tensors are on {names}; one call takes one device"
            )
        (device,) = cuda
        return _completer.route(device, lambda: CudaStreams(device))
    if tensors and smddp.client().config.device_runtime not in BUILTIN_RUNTIMES:
        # A registered runtime whose device memory is host memory (smddp's test rigs' stand-in for
        # CUDA) may claim CPU tensors with `torch_streams()`: its doubles of the calls above.
        rt = smddp.client().device_runtime()
        claim = getattr(rt, "torch_streams", None)
        if claim is not None:
            return _completer.route(rt, claim)
    return _HOST


# -- helpers --------------------------------------------------------------------------------------


def _check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise UnsupportedCollectiveError(f"smddp {what}: expected a torch.Tensor, got {type(t).__name__}")
    if not (t.is_cpu or t.is_cuda):  # t.device.type would make a device object on every call
        raise UnsupportedCollectiveError(
            f"smddp {what}: the tensor is on {t.device}; the smddp backend takes CPU and CUDA tensors"
        )
    if t.layout != torch.strided:
        raise UnsupportedCollectiveError(f"smddp {what}: {t.layout} tensors are not supported")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise UnsupportedCollectiveError(
            f"smddp {what}: dtype {str(t.dtype).removeprefix('torch.')} is not supported (supported: {names})"
        )
    return t.detach() if t.requires_grad else t  # (a detach is a dispatch: only where autograd needs it)


def _contiguous(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous tensor to hand smddp, and whether it is a copy that must be copied back."""
    if t.is_contiguous():
        return t, False
    return t.contiguous(), True


def _op(opts: Any, what: str) -> smddp.ReduceOp:
    op = opts.reduceOp
    for k, v in _OPS.items():
        if op == k:
            return v
    name = next((n for n in _OP_NAMES if op == getattr(dist.ReduceOp, n)), repr(op))
    raise UnsupportedCollectiveError(
        f"smddp {what}: ReduceOp.{name} is not supported (supported: SUM, AVG, MIN, MAX)"
    )


def _all(pairs: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> list[torch.Tensor]:
    """Every tensor of (tensor, contiguous buffer, copied) pairs: what a device Work touches."""
    return [x for t, buf, copied in pairs for x in ((t, buf) if copied else (t,))]


def _same_size(ts: Sequence[torch.Tensor], numel: int, dtype: torch.dtype, what: str) -> None:
    for t in ts:
        if t.numel() != numel or t.dtype != dtype:
            raise UnsupportedCollectiveError(
                f"smddp {what}: every tensor must have {numel} elements of {dtype} "
                f"(got {t.numel()} of {t.dtype}); uneven sizes are not supported"
            )


# -- the side group: what smddp does not run itself ------------------------------------------------


class SideGroup:
    """Where the smddp group sends the calls smddp does not run itself, as SageMaker's library v2
    hands them to NCCL: gloo for CPU tensors, NCCL for CUDA ones (where torch has it, else gloo).

    gloo is built with the group (every member builds it together, from the group's own store)
    but lazily connected (TORCH_GLOO_LAZY_INIT): no connection exists until a routed call needs
    one, and a send/recv connects only its two ranks. NCCL makes its communicators on first use.
    Each kind of call is logged once per process, with where it went and why; the client counts
    them for `smddp status` (Client.count_routed).
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        self._store = store
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._lock = threading.Lock()
        self._nccl: Any = None
        self._gloo = self._make_gloo()

    def _make_gloo(self) -> Any:
        store = dist.PrefixStore("smddp-side-gloo/", self._store)
        old = os.environ.get("TORCH_GLOO_LAZY_INIT")
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        try:
            return dist.ProcessGroupGloo(store, self._rank, self._size, self._timeout)
        finally:
            if old is None:
                os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
            else:
                os.environ["TORCH_GLOO_LAZY_INIT"] = old

    def backend_for(self, tensors: Sequence[Any]) -> tuple[str, Any]:
        """(name, backend) for a call on `tensors`: NCCL when they are CUDA tensors and torch has it."""
        cuda = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors)
        if cuda and dist.is_nccl_available():
            with self._lock:
                if self._nccl is None:
                    store = dist.PrefixStore("smddp-side-nccl/", self._store)
                    opts = dist.ProcessGroupNCCL.Options()  # CUDA builds of torch only (checked above)
                    opts._timeout = self._timeout
                    self._nccl = dist.ProcessGroupNCCL(store, self._rank, self._size, opts)
                return "nccl", self._nccl
        return "gloo", self._gloo

    def run(self, call: str, method: str, args: tuple, kwargs: dict | None, reason: str) -> Any:
        """Run `call` on the side backend (its `method`, with the arguments torch gave us)."""
        tensors = _tensors_in((*args, *(kwargs or {}).values()))
        name, backend = self.backend_for(tensors)
        try:
            first = smddp.client().count_routed(f"{call} ({name})")
        except SmddpError:  # smddp already shut down in this process: nothing counts the call
            first = False
        if first:
            log.warning("smddp: %s runs on the %s side group: %s", call, name, reason)
        return getattr(backend, method)(*args, **(kwargs or {}))


def _tensors_in(args: Any) -> list[Any]:
    """Every tensor in a call's arguments (lists of tensors and lists of lists included)."""
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_tensors_in(a))
    return out


#: How a routed call is put to the side backend: (call, method, args, kwargs) for its arguments.
Route = Callable[[str, str, tuple, dict], tuple[str, str, tuple, dict]]


def _as_given(call: str, method: str, args: tuple, kwargs: dict) -> tuple[str, str, tuple, dict]:
    return call, method, args, kwargs


def _reduce_options(kind: Callable[[], Any], opts: Any) -> Any:
    """torch's options of `kind` (AllreduceOptions, AllreduceCoalescedOptions) saying what `opts` does."""
    o = kind()
    if opts is not None:
        o.reduceOp = opts.reduceOp
        o.timeout = opts.timeout
        o.asyncOp = getattr(opts, "asyncOp", True)
    return o


def _several_as_coalesced(call: str, method: str, args: tuple, kwargs: dict) -> tuple[str, str, tuple, dict]:
    """An allreduce of several tensors, as smddp runs it (each on its own): the side's allreduce_coalesced."""
    tensors = args[0] if args else kwargs.get("tensors", ())
    if len(tensors) < 2:
        return call, method, args, kwargs
    opts = args[1] if len(args) > 1 else kwargs.get("opts")
    o = _reduce_options(dist.AllreduceCoalescedOptions, opts)
    return "all_reduce_coalesced", "allreduce_coalesced", (list(tensors), o), {}


def _routable(
    call: str, method: str, route: Route = _as_given
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A collective smddp runs itself when it can; what it refuses (an op, dtype or shape it does
    not carry, or any call of a subgroup) goes to the side group instead, as the same call (`route`
    says how, where the side backend's method of that name means something else). A refusal happens
    before anything is sent, and depends only on what every rank passes alike, so all ranks route
    together."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def side(self: ProcessGroupSmddp, reason: str, args: tuple, kwargs: dict) -> Any:
            assert self._side is not None
            return self._side.run(*route(call, method, args, kwargs), reason)

        @functools.wraps(fn)
        def routed(self: ProcessGroupSmddp, *args: Any, **kwargs: Any) -> Any:
            if self._side is not None and self._subgroup:
                return side(self, "smddp runs groups of every rank only", args, kwargs)
            try:
                return fn(self, *args, **kwargs)
            except UnsupportedCollectiveError as e:
                if self._side is None:
                    raise
                return side(self, str(e), args, kwargs)

        return routed

    return wrap


# -- the process group ----------------------------------------------------------------------------


@_untraced(dist.ProcessGroup)
class ProcessGroupSmddp(dist.ProcessGroup):
    """torch.distributed's view of an smddp job: every rank of the job, one group.

    Collectives go to smddp asynchronously (`smddp.*_async`); each returns an `SmddpWork`. Set
    `trace` to a list to record a `TraceEvent` per collective (used to measure overlap).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        timeout: timedelta = timedelta(minutes=30),
        side: SideGroup | None = None,
        subgroup: bool = False,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) constructor
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._timeout_s = timeout.total_seconds()
        self._side = side  # None: refuse what smddp does not run (groups made directly, in tests)
        self._subgroup = subgroup  # a group of some ranks: everything goes to the side group
        self.trace: list[TraceEvent] | None = None

    # -- identity

    def _native_device_route(self) -> str:
        """For the C++ backend, once its first device all-reduce came here: where this job's device
        all-reduces go ("" undecided, "step", "engine": Client.device_route)."""
        return smddp.client().device_route()

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"ProcessGroupSmddp(rank={self._rank}, size={self._size})"

    # torch keeps a group's name on its C++ backends, and a Python group has none: keep it here, so
    # that DeviceMesh, FSDP2, DTensor and the functional collectives can find the group by its name.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> GroupName:
        name = getattr(self, "_group_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return GroupName(name)

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "undefined")

    # -- plumbing

    def _timeout_of(self, opts: Any) -> timedelta:
        t = getattr(opts, "timeout", None)
        return t if isinstance(t, timedelta) and t > _NO_TIME else self._timeout

    def _seconds_of(self, opts: Any) -> float:
        """_timeout_of in seconds, as cheaply as it goes (the blocking all-reduce's hot path): torch's
        options carry a timedelta, unset (negative) unless the caller gave one."""
        t = getattr(opts, "timeout", _NO_TIME)
        return t.total_seconds() if t > _NO_TIME else self._timeout_s

    def _trace_start(self, name: str, nbytes: int) -> TraceEvent | None:
        """A new TraceEvent of this call in `trace` (None when nobody traces); its Work sets `done`."""
        if self.trace is None:
            return None
        trace = TraceEvent(name, nbytes, time.perf_counter())
        self.trace.append(trace)
        return trace

    def _submit(
        self,
        name: str,
        start: Callable[[_Device], list[smddp.Handle]],
        result: Any,
        opts: Any = None,
        finish: Callable[[], None] | None = None,
        nbytes: int = 0,
        tensors: Sequence[torch.Tensor] = (),
        device: _Device | None = None,
    ) -> SmddpWork:
        """Run `start(device)` for this call's `tensors` (inputs, outputs and scratch) and queue its Work;
        `device`: where they live, if the caller has found that out already."""
        device = device if device is not None else _device_of(tensors, name)
        work = SmddpWork(name, result, self._timeout_of(opts), self._trace_start(name, nbytes), device)
        if device is not _HOST and not getattr(opts, "asyncOp", True):
            # Device tensors, and torch waits for the Work at once in this thread (no async_op): the
            # completer's work runs here (the same completion, on the route's side stream), and the
            # SUBMIT goes from this thread's wait too (Client.waiting): no other thread is woken.
            with smddp.client().waiting():
                handles = start(device)  # raises (nothing sent) on a bad argument
            _complete_here(work, handles, finish, list(tensors))
            return work
        handles = start(device)  # raises (nothing sent) on a bad argument, before the Work is queued
        _queue_work(work, handles, finish, list(tensors) if device is not _HOST else None)
        return work

    # -- collectives

    def _allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work | None:
        """Each tensor all-reduced on its own (several are a coalesced call, on every path)."""
        if opts is not None and len(tensors) == 1 and self.trace is None:
            one = self._one_host_tensor(tensors[0])
            if one is not None:
                if getattr(opts, "asyncOp", True):
                    return self._allreduce_one_async(tensors, opts, *one)
                elif self._allreduce_one_now(opts, *one):
                    # Complete already, and torch's blocking all_reduce (the only caller that asks
                    # for asyncOp=False) waits for no Work where a backend returns none: making one
                    # (pybind's Work.__init__) cost as much as a fifth of the call.
                    return None
            elif not getattr(opts, "asyncOp", True) and self._allreduce_one_device_now(opts, tensors[0]):
                return None  # complete, and the caller's stream ordered after it already
        opts = opts if opts is not None else dist.AllreduceOptions()
        op = _op(opts, "all_reduce")
        ts = [_check_tensor(t, "all_reduce") for t in tensors]
        device = _device_of(ts, "all_reduce")
        if (
            device is _HOST
            and not getattr(opts, "asyncOp", True)
            and all(t.dtype in _NUMPY_DTYPES and t.is_contiguous() for t in ts)
        ):
            return self._allreduce_now(ts, op, opts, tensors)
        pairs = [(t, *_contiguous(t)) for t in ts]

        def start(d: _Device) -> list[smddp.Handle]:
            return [smddp.allreduce_async(d.buf(buf), op, **d.kw()) for _, buf, _ in pairs]

        def finish() -> None:
            for t, buf, copied in pairs:
                if copied:
                    t.copy_(buf)

        nbytes = sum(t.numel() * t.element_size() for t in ts)
        return self._submit("all_reduce", start, tensors, opts, finish, nbytes, _all(pairs), device)

    @staticmethod
    def _one_host_tensor(t: Any) -> tuple[torch.Tensor, DType, int, smddp.Client] | None:
        """`t` with its wire dtype, its element count and the client, where it is what torch's commonest
        all-reduce passes and the engine takes by its address: one contiguous, non-empty CPU tensor
        of a dtype numpy has, in one piece, with no runtime claiming CPU tensors. None where anything
        is out of the ordinary (the general way takes it, and refuses what it must with its full
        message). Each Python step here costs several times its own time in a job whose ranks come
        to the call from a barrier (cold caches): what is not needed is not asked."""
        wire = _WIRE.get(t.dtype) if type(t) is torch.Tensor else None
        if wire is None or not t.is_cpu or t.layout != torch.strided or not t.is_contiguous():
            return None
        c = smddp.client()
        n = t.numel()
        if not n or c.config.device_runtime not in BUILTIN_RUNTIMES or not whole(c, n * wire.itemsize):
            return None
        return t, wire, n, c

    def _allreduce_one_now(self, opts: Any, t: torch.Tensor, wire: DType, n: int, c: smddp.Client) -> bool:
        """`dist.all_reduce(t)` of one tensor `_one_host_tensor` took, in the least Python it takes: the
        engine's one pass on the tensor's memory, by its address (Client.allreduce_now: copy-in,
        SUBMIT, DONE, copy-out, GIL released). False, with nothing done, once the client is shutting
        down (the general way then refuses it)."""
        timeout = self._seconds_of(opts)
        # The tensor's address, not its numpy view (which costs more than the rest of this call). A
        # call that times out writes the tensor no more: its late result is dropped.
        return c.allreduce_now(t.data_ptr(), wire, n, _op(opts, "all_reduce"), timeout)

    def _allreduce_one_async(
        self, tensors: list[torch.Tensor], opts: Any, t: torch.Tensor, wire: DType, n: int, c: smddp.Client
    ) -> dist.Work:
        """`dist.all_reduce(t, async_op=True)` (and DDP's buckets) of one tensor `_one_host_tensor`
        took: started by the engine from the tensor's address (collectives.allreduce_async_at), its
        Work a host Work like any other, completed where it is consumed."""
        h = allreduce_async_at(c, t.data_ptr(), wire, n, _op(opts, "all_reduce"), t, tensors)
        work = SmddpWork("all_reduce", tensors, self._timeout_of(opts))
        _queue_work(work, [h], None, None)
        return work

    def _allreduce_one_device_now(self, opts: Any, t: Any) -> bool:
        """`dist.all_reduce(t)` of one contiguous device tensor that goes in one piece: both copies in line
        on the caller's current stream, the SUBMIT and the DONE taken in this thread
        (Client.device_allreduce_now), no Work (torch waits for none where a backend returns none,
        and the copy back is ordered before the caller's next work on its stream already). Errors
        raise from the call. False, with nothing done, for anything else (the general way takes it)."""
        if type(t) is not torch.Tensor or t.dtype not in _DEVICE_WIRE or not t.is_contiguous():
            return False
        device = _device_of([t], "all_reduce")
        n = t.numel()
        if not isinstance(device, _DeviceRoute) or not n:
            return False
        c = smddp.client()
        if not whole(c, n * t.element_size()):
            return False
        op = _op(opts, "all_reduce")  # (refused before anything is sent: routed to the side group)
        s = device.streams
        dev = c.device_buffer(s.buf(t), "all_reduce", writable=True)
        assert dev is not None  # (a described tensor is device memory)
        s.follow_copy(c.device_allreduce_now(dev, op, s.current_handle(), self._seconds_of(opts)))
        return True

    def _allreduce_now(self, ts: list[torch.Tensor], op: smddp.ReduceOp, opts: Any, result: Any) -> dist.Work:
        """A blocking all-reduce of contiguous host tensors: run here, whole, each through the engine in
        one pass (smddp.allreduce: copy-in, SUBMIT, DONE, copy-out, GIL released), as torch waits for it
        at once in this thread anyway. A failure raises here, as the Work's wait() would."""
        timeout = self._seconds_of(opts)

        def run() -> None:
            for t in ts:
                smddp.allreduce(_HOST.buf(t), op, timeout)

        return self._run_now("all_reduce", lambda: sum(t.numel() * t.element_size() for t in ts), run, result)

    def _run_now(
        self, name: str, nbytes: Callable[[], int], run: Callable[[], None], result: Any
    ) -> dist.Work:
        """A blocking call torch waits for at once in this thread: `run()` here, traced when someone
        traces (`nbytes()` only then: this is the hot path), and a Work already complete."""
        trace = self._trace_start(name, nbytes()) if self.trace is not None else None
        run()
        if trace is not None:
            trace.done = time.perf_counter()
        return _DoneWork(result)

    # What smddp refuses goes to the side group as the same call: several tensors are several
    # all-reduces (the side backend's allreduce would reduce them all into one, as for one tensor per
    # device), so they go to its allreduce_coalesced.
    allreduce = _routable("all_reduce", "allreduce", _several_as_coalesced)(_allreduce)

    @_routable("all_reduce_coalesced", "allreduce_coalesced")
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work | None:
        return self._allreduce(tensors, _reduce_options(dist.AllreduceOptions, opts))

    @_routable("broadcast", "broadcast")
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> SmddpWork:
        opts = opts if opts is not None else dist.BroadcastOptions()
        root = int(opts.rootRank)
        ts = [_check_tensor(t, "broadcast") for t in tensors]
        pairs = [(t, *_contiguous(t)) for t in ts]

        def start(d: _Device) -> list[smddp.Handle]:
            return [smddp.broadcast_async(d.buf(buf), root, **d.kw()) for _, buf, _ in pairs]

        def finish() -> None:
            for t, buf, copied in pairs:
                if copied:
                    t.copy_(buf)

        return self._submit("broadcast", start, tensors, opts, finish, tensors=_all(pairs))

    @_routable("all_gather", "allgather")
    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> SmddpWork:
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise UnsupportedCollectiveError("smddp all_gather: one input tensor per rank (no multi-device)")
        inp = _check_tensor(input_tensors[0], "all_gather")
        outs = [_check_tensor(t, "all_gather output") for t in output_tensors[0]]
        if len(outs) != self._size:
            raise UnsupportedCollectiveError(
                f"smddp all_gather: {len(outs)} output tensors for a group of {self._size}"
            )
        _same_size(outs, inp.numel(), inp.dtype, "all_gather")
        return self._gather_rows("all_gather", inp, outs, output_tensors, opts)

    def _gather_rows(
        self, name: str, inp: torch.Tensor, outs: list[torch.Tensor], output_tensors: Any, opts: Any
    ) -> SmddpWork:
        """One smddp all-gather of `inp`; row r lands in outs[r] (empty `outs`: keep nothing)."""
        buf, _ = _contiguous(inp)
        flat = torch.empty((self._size, inp.numel()), dtype=inp.dtype, device=inp.device)

        def start(d: _Device) -> list[smddp.Handle]:
            return [smddp.allgather_async(d.buf(buf), out=d.buf(flat), **d.kw())]

        def finish() -> None:
            for i, o in enumerate(outs):
                o.copy_(flat[i].view(o.shape))

        return self._submit(name, start, output_tensors, opts, finish, tensors=[inp, buf, flat, *outs])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SmddpWork:
        return self.all_gather_single(output, input, opts)

    @_routable("all_gather_into_tensor", "_allgather_base")
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SmddpWork:
        inp = _check_tensor(input, "all_gather_into_tensor")
        out = _check_tensor(output, "all_gather_into_tensor output")
        if out.numel() != inp.numel() * self._size or out.dtype != inp.dtype:
            raise UnsupportedCollectiveError(
                f"smddp all_gather_into_tensor: the output must hold {self._size} x {inp.numel()} "
                f"elements of {inp.dtype} (got {out.numel()} of {out.dtype})"
            )
        buf, _ = _contiguous(inp)
        obuf, copied = _contiguous(out)

        def start(d: _Device) -> list[smddp.Handle]:
            return [smddp.allgather_async(d.buf(buf), out=d.buf(obuf), **d.kw())]

        def finish() -> None:
            if copied:
                out.copy_(obuf)

        return self._submit(
            "all_gather_into_tensor", start, output, opts, finish, tensors=[inp, buf, out, obuf]
        )

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> SmddpWork:
        return self._coalesced("all_gather_into_tensor", self.all_gather_single, outputs, inputs, opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> SmddpWork:
        return self._coalesced("all_gather_into_tensor", self.all_gather_single, outputs, inputs, opts)

    @_routable("reduce_scatter", "reduce_scatter")
    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> SmddpWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = _op(opts, "reduce_scatter")  # before the packing copy: a refused op goes elsewhere without it
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise UnsupportedCollectiveError("smddp reduce_scatter: one output tensor per rank")
        out = _check_tensor(output_tensors[0], "reduce_scatter output")
        ins = [_check_tensor(t, "reduce_scatter") for t in input_tensors[0]]
        if len(ins) != self._size:
            raise UnsupportedCollectiveError(
                f"smddp reduce_scatter: {len(ins)} input tensors for a group of {self._size}"
            )
        _same_size(ins, out.numel(), out.dtype, "reduce_scatter")
        flat = torch.cat([t.reshape(-1) for t in ins])
        return self._reduce_scatter_into(out, flat, op, opts, "reduce_scatter", output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SmddpWork:
        return self.reduce_scatter_single(output, input, opts)

    @_routable("reduce_scatter_tensor", "_reduce_scatter_base")
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SmddpWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op = _op(opts, "reduce_scatter_tensor")
        out = _check_tensor(output, "reduce_scatter_tensor output")
        inp = _check_tensor(input, "reduce_scatter_tensor")
        if inp.numel() != out.numel() * self._size or inp.dtype != out.dtype:
            raise UnsupportedCollectiveError(
                f"smddp reduce_scatter_tensor: the input must hold {self._size} x {out.numel()} "
                f"elements of {out.dtype} (got {inp.numel()} of {inp.dtype})"
            )
        buf, _ = _contiguous(inp)
        return self._reduce_scatter_into(out, buf, op, opts, "reduce_scatter_tensor", output)

    def _reduce_scatter_into(
        self, out: torch.Tensor, flat: torch.Tensor, op: smddp.ReduceOp, opts: Any, name: str, result: Any
    ) -> SmddpWork:
        obuf, copied = _contiguous(out)

        def start(d: _Device) -> list[smddp.Handle]:
            return [smddp.reduce_scatter_async(d.buf(flat), op, out=d.buf(obuf), **d.kw())]

        def finish() -> None:
            if copied:
                out.copy_(obuf)

        return self._submit(name, start, result, opts, finish, tensors=[flat, out, obuf])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> SmddpWork:
        return self._coalesced("reduce_scatter_tensor", self.reduce_scatter_single, outputs, inputs, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> SmddpWork:
        return self._coalesced("reduce_scatter_tensor", self.reduce_scatter_single, outputs, inputs, opts)

    def _coalesced(
        self,
        name: str,
        one: Callable[[torch.Tensor, torch.Tensor, Any], SmddpWork],
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: Any,
    ) -> SmddpWork:
        if len(outputs) != len(inputs):
            raise UnsupportedCollectiveError(
                f"smddp {name} (coalesced): {len(outputs)} outputs, {len(inputs)} inputs"
            )
        works = [one(o, i, opts) for o, i in zip(outputs, inputs, strict=False)]

        def start(d: _Device) -> list[smddp.Handle]:
            return []

        def finish() -> None:
            for w in works:
                w.wait()

        return self._submit(f"{name} (coalesced)", start, outputs, opts, finish, tensors=[*outputs, *inputs])

    @_routable("barrier", "barrier")
    def barrier(self, opts: Any = None) -> dist.Work:
        if opts is not None and not getattr(opts, "asyncOp", True):
            # Run whole here, through the engine (smddp.barrier), as the blocking all-reduce is.
            timeout = self._seconds_of(opts)
            return self._run_now("barrier", lambda: 0, lambda: smddp.barrier(timeout), None)
        return self._submit("barrier", lambda d: [smddp.barrier_async()], None, opts)

    @_routable("reduce", "reduce")
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SmddpWork:
        """An all-reduce into a scratch copy; only the root's tensor receives the result."""
        opts = opts if opts is not None else dist.ReduceOptions()
        root = int(opts.rootRank)
        op = _op(opts, "reduce")
        ts = [_check_tensor(t, "reduce") for t in tensors]
        scratch = [t.contiguous().clone() for t in ts]

        def start(d: _Device) -> list[smddp.Handle]:
            return [smddp.allreduce_async(d.buf(s), op, **d.kw()) for s in scratch]

        def finish() -> None:
            if self._rank == root:
                for t, s in zip(ts, scratch, strict=False):
                    t.copy_(s)

        return self._submit("reduce", start, tensors, opts, finish, tensors=[*ts, *scratch])

    @_routable("gather", "gather")
    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> SmddpWork:
        """An all-gather whose result only the root keeps."""
        opts = opts if opts is not None else dist.GatherOptions()
        root = int(opts.rootRank)
        if len(input_tensors) != 1:
            raise UnsupportedCollectiveError("smddp gather: one input tensor per rank")
        inp = _check_tensor(input_tensors[0], "gather")
        outs = [_check_tensor(t, "gather output") for t in output_tensors[0]] if output_tensors else []
        if self._rank == root:
            if len(outs) != self._size:
                raise UnsupportedCollectiveError(
                    f"smddp gather: {len(outs)} output tensors for a group of {self._size}"
                )
            _same_size(outs, inp.numel(), inp.dtype, "gather")
        return self._gather_rows("gather", inp, outs, output_tensors, opts)

    @_routable("scatter", "scatter")
    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> SmddpWork:
        """A broadcast of the root's whole list; each rank keeps its part."""
        opts = opts if opts is not None else dist.ScatterOptions()
        root = int(opts.rootRank)
        if len(output_tensors) != 1:
            raise UnsupportedCollectiveError("smddp scatter: one output tensor per rank")
        out = _check_tensor(output_tensors[0], "scatter output")
        n = out.numel()
        if self._rank == root:
            ins = [_check_tensor(t, "scatter") for t in input_tensors[0]]
            if len(ins) != self._size:
                raise UnsupportedCollectiveError(
                    f"smddp scatter: {len(ins)} input tensors for a group of {self._size}"
                )
            _same_size(ins, n, out.dtype, "scatter")
            flat = torch.cat([t.reshape(-1) for t in ins])
        else:
            flat = torch.empty(self._size * n, dtype=out.dtype, device=out.device)

        def start(d: _Device) -> list[smddp.Handle]:
            return [smddp.broadcast_async(d.buf(flat), root, **d.kw())]

        def finish() -> None:
            out.copy_(flat[self._rank * n : (self._rank + 1) * n].view(out.shape))

        return self._submit("scatter", start, output_tensors, opts, finish, tensors=[flat, out])

    # -- what smddp does not run itself: the side group runs it (refused by name without one)

    def _elsewhere(self, call: str, method: str, args: tuple, kwargs: dict) -> Any:
        if self._side is None:
            raise UnsupportedCollectiveError(
                f"the smddp backend does not run {call} and this group has no side group "
                "(groups made by torch.distributed have one)"
            )
        return self._side.run(call, method, args, kwargs, "smddp does not run it")

    def alltoall(self, *args: Any, **kwargs: Any) -> Any:
        return self._elsewhere("all_to_all", "alltoall", args, kwargs)

    def alltoall_base(self, *args: Any, **kwargs: Any) -> Any:
        return self._elsewhere("all_to_all_single", "alltoall_base", args, kwargs)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Any:
        return self._elsewhere("all_to_all_single", "alltoall_base", args, kwargs)

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        return self._elsewhere("all_gather_coalesced", "allgather_coalesced", args, kwargs)

    def send(self, *args: Any, **kwargs: Any) -> Any:
        return self._elsewhere("send", "send", args, kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        return self._elsewhere("recv", "recv", args, kwargs)

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        return self._elsewhere("recv", "recv_anysource", args, kwargs)


# -- creation and registration --------------------------------------------------------------------


def create_process_group(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """torch.distributed's constructor for backend "smddp": joins the smddp job (collective).

    A group of every rank runs smddp's collectives and routes the rest to its side group; a group
    of some ranks (`new_group([0, 1])`, DeviceMesh dimensions) routes every call there. A group of
    every rank is the C++ backend where it loads (smddp.torch.native.backend_kind()), taking a
    ProcessGroupSmddp for what it does not run itself; else that ProcessGroupSmddp.
    """
    if not smddp.is_initialized():
        env = None
        if not under_smddp_launch(os.environ):
            # Under torchrun, or no launcher at all: this first group starts the job (its daemons)
            # through torch's store. A subgroup cannot: its store and ranks are not the job's.
            world = (
                dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE") or size)
            )
            if size != world:
                raise ConfigError(
                    f"the first smddp group has {size} of the {world} ranks: smddp starts with a group of "
                    'every rank (init_process_group("smddp"), or new_group(backend="smddp") of all)'
                )
            # A node whose daemon failed says so at once; one that never comes (its workers slow or stuck
            # before their first group) is bounded as under smddp-launch: --join-timeout, at most the
            # group's own timeout.
            join = settings.from_env(settings.WORKER)["join_timeout_s"]
            env = join_through_store(store, rank, size, min(timeout.total_seconds(), join))
        smddp.init(env=env)
    side = SideGroup(store, rank, size, timeout)  # torch's store for this group: its members only
    if size != smddp.size():
        return ProcessGroupSmddp(rank, size, timeout, side, subgroup=True)
    if rank != smddp.rank():
        raise ConfigError(
            f"torch.distributed rank {rank} is smddp rank {smddp.rank()}: start the job with smddp-launch, "
            "which sets RANK to the smddp rank, or pass rank=smddp.rank()"
        )
    group = ProcessGroupSmddp(rank, size, timeout, side)
    kind = native.backend_kind()
    smddp.client().note_front_end("torch backend", kind)  # (smddp status shows each rank's)
    if kind == "python":
        return group
    # The C++ backend: host collectives straight to the engine, the rest to `group`. Where a runtime
    # claims host tensors as device memory, as smddp's stand-in does, host tensors take the device
    # route instead, through the runtime's native doubles of torch's CUDA calls (torch_native()).
    c = smddp.client()
    direct = c.config.device_runtime in BUILTIN_RUNTIMES
    claim = None if direct else getattr(c.device_runtime(), "torch_native", None)
    doubles = claim() if claim is not None else {}
    return native.wrap(group, rank, size, timeout.total_seconds(), direct, doubles)


def register() -> None:
    """Register backend "smddp" with torch.distributed (done on `import smddp.torch`; idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cpu", "cuda"])
