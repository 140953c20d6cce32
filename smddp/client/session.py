"""The worker side: one connection to the node daemon, an arena of shared slots, and handles."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from smddp import _engine, settings
from smddp.client.device.buffers import (
    DeviceBuffer,
    device_kind,
    library_of,
    library_stream,
    read_cai,
    read_dlpack,
    stream_handle,
)
from smddp.client.device.copies import DeviceIO, DevicePlan
from smddp.client.device.runtime import DeviceRuntime, check_runtime_name, load_runtime
from smddp.client.device.step import UNDECIDED, NodeStep, StepHandle
from smddp.client.device.step import decide as decide_step
from smddp.client.device.step import start as start_step
from smddp.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    DeviceError,
    DeviceUnavailableError,
    GraphCaptureError,
    InvalidArgumentError,
    NotInitializedError,
    PeerLostError,
    ProtocolError,
    SmddpError,
    TransportError,
    UnsupportedBufferError,
    fresh,
)
from smddp.proto.dtypes import DType, Kind, ReduceOp
from smddp.proto.failure import exit_status_of, infra_of, read_failure
from smddp.proto.frames import MsgType, Role, decode_header
from smddp.proto.messages import Bye, Channel
from smddp.settings import KiB, MiB, default
from smddp.trace import span
from smddp.transport.auth import client_handshake
from smddp.transport.bootstrap import Membership, Placement, default_socket_dir, job_dir, join_job
from smddp.transport.conn import Connection, ConnectionClosed
from smddp.transport.shm import Arena, Slot

# What a rank sends on the engine's path that sends no data (a barrier, a broadcast's other ranks), and
# what one that takes nothing back (a barrier, a broadcast's root) takes: no slot, nothing copied.
NO_DATA = np.empty(0, np.uint8)
# run()'s two answers that carry nothing (the engine returns these very objects).
_RAN_DONE = _engine.RAN_DONE
_RAN_CLOSED = _engine.RAN_CLOSED
# Host results up to this many bytes in all may wait for the next descriptor to be RELEASEd (the
# engine's: WorkerChannel.release).
RELEASE_BATCH_BYTES = 256 << 10
# How long a wait on the engine's rings spins before it sleeps on the ring's futex: long enough to
# catch a small collective's DONE without a sleep and a wake-up; the spin yields the core between
# looks, so the daemon's threads and the other workers still run (see PLANE_SPIN_US in the daemon).
# The fast path's wait stops spinning for a while when its spins keep missing (WorkerChannel::finish).
RING_SPIN_US = 200.0
# How a copy-in's event is watched (by a blocking call that sends its own SUBMIT, CopyIn.wait, and by
# the engine's device watch): polls that yield the core for this long (a 4 MiB copy at 20 GB/s takes
# about 200 us), then short naps (never past the wait's deadline, as an event synchronize would be).
COPY_SPIN_S = 0.001
log = logging.getLogger("smddp.client")


@dataclass(frozen=True)
class ClientConfig:
    """The worker's knobs; `from_env` reads what smddp-launch exported (declared in smddp.settings)."""

    timeout_s: float = default("timeout_s")  # default for wait(timeout=None) and shutdown
    arena_bytes: int = 256 << 20  # first input segment (from_env: twice the fusion buffer, 64 MiB at least)
    fusion_bytes: int = int(default("fusion_mb") * MiB)
    # In a job of several nodes, an all-reduce larger than this (host or device memory) goes as
    # consecutive pieces of at most this size, so the daemon starts on the first while this rank
    # copies the next, and results are copied out while later pieces are in flight (0 = never).
    # Every rank must use the same value.
    pipeline_bytes: int = default("pipeline_kb") * KiB
    connect_timeout_s: float = 60.0  # fixed: how long a worker waits for its daemon's job.json
    heartbeat_timeout_s: float = default("heartbeat_timeout_s")  # the daemon beats every quarter of this
    timeline_dir: str = default("timeline_dir")
    log_level: str = default("log_level")
    job_id_hex: str = default("job_id")
    device_runtime: str = default("device_runtime")
    node_reduce: str = default("node_reduce")
    step_slot_bytes: int = default("step_slot_kb") * KiB

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientConfig:
        v = settings.from_env(settings.WORKER, env)
        fusion = int(v["fusion_mb"] * MiB)
        return cls(
            timeout_s=v["timeout_s"],
            arena_bytes=max(fusion * 2, 64 << 20),
            fusion_bytes=fusion,
            pipeline_bytes=v["pipeline_kb"] * KiB,
            heartbeat_timeout_s=v["heartbeat_timeout_s"],
            timeline_dir=v["timeline_dir"],
            log_level=v["log_level"],
            job_id_hex=v["job_id"],
            device_runtime=check_runtime_name(v["device_runtime"]),
            node_reduce=v["node_reduce"],
            step_slot_bytes=v["step_slot_kb"] * KiB,
        )


class Latch:
    """A flag set once and waited for, as threading.Event's set/is_set/wait, whose Event is made only
    when a thread has to block on it: most collectives are waited for by the thread that completes
    them, and an Event costs more to make (a Condition and its lock: 3-6 us here) than that wait.

    set() takes no lock. It writes the flag, then reads the event; a blocking waiter writes the event,
    then reads the flag: whichever comes second sees what the other wrote (the GIL orders them), so
    the event is set or the waiter returns. One class-wide lock makes the events, so that two waiters
    of one latch share one (a thread blocks on a latch rarely: that lock is seldom taken)."""

    __slots__ = ("_event", "_flag")
    _making = threading.Lock()

    def __init__(self) -> None:
        self._flag = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        with Latch._making:
            event = self._event
            if event is None:
                event = self._event = threading.Event()
        if self._flag:
            return True
        return event.wait(timeout)


class Handle(metaclass=abc.ABCMeta):  # noqa: B024 (abstract for its registered engine subclasses, not its methods)
    """An in-flight collective; `wait()` returns its result or raises why the job failed.

    For device buffers, `wait()` blocks the host only until the result has reached this node and
    its copy to the device is enqueued; the copy is ordered before later work on the caller's
    stream by an event that stream waits on (see docs/gpu.md).

    What the client hands out is the engine's record of a collective (EngineHandle, DeviceHandle) or
    one made of pieces (PipelinedHandle); this class holds what they share.
    """

    # Until set: no callbacks yet, no result or error yet.
    _callbacks: list[Callable[[Handle], None]] | None = None
    _result: Any = None
    _error: SmddpError | None = None

    def __init__(
        self, seq: int, kind: Kind, dtype: DType, count: int, result: Any, default_timeout_s: float
    ) -> None:
        self.seq = seq
        self.kind = kind
        self.dtype = dtype
        self.count = count
        self._result = result
        self._default_timeout_s = default_timeout_s
        self._event = Latch()
        self._lock = threading.Lock()  # orders add_done_callback against _finish

    def done(self) -> bool:
        """True once the result is in place (or the collective failed); never blocks."""
        return self._event.is_set()

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call `fn(handle)` once the collective has finished (or failed), when `wait()` would no longer block.

        It runs in the thread that finishes the collective (one that waits, or the client's DONE
        thread), or at once in this thread if that has happened: keep it short, and never wait on
        another collective in it. An exception it raises is logged and goes no further.
        """
        with self._lock:
            if not self._event.is_set():
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _call_back(fn, self)

    def wait(self, timeout: float | None = None, stream: Any = None) -> Any:
        """Block until complete; `timeout=None` means the job's default (SMDDP_TIMEOUT_S).

        A timeout leaves the collective in flight: call wait() again to collect it later.
        Device buffers: later work on `stream` sees the result. `stream` defaults to the one given
        to the collective, else the buffer's CUDA Array Interface stream, else the current stream
        (torch's for a torch tensor, the device runtime's otherwise) of the thread calling wait().
        """
        t = self._default_timeout_s if timeout is None else timeout
        if not self._event.wait(t):
            raise CollectiveTimeoutError.waiting(
                t, f"collective #{self.seq} ({self.kind.label}, {self.dtype.label}, count={self.count})"
            )
        if self._error is not None:
            raise fresh(self._error)
        return self._result

    def synchronize(self, timeout: float | None = None) -> Any:
        """wait(), then block the host until a device result is in device memory (any stream may read it)."""
        return self.wait(timeout)

    def _wait(self, timeout_s: float) -> Any:
        """wait(timeout_s), for smddp's own callers, with no stream ordered: an engine record's is the
        engine's (`Started._wait`: positional, so nanobind's cheapest dispatch), a device handle's
        included (its wait() orders the stream after it)."""
        return self.wait(timeout_s)

    def _drop(self) -> None:
        """Its caller was told it failed (a blocking call that timed out): it completes all the same
        (the other ranks need it), but its result goes nowhere from now on."""
        raise NotImplementedError

    def _finish(self, result: Any = None, error: SmddpError | None = None) -> None:
        self._result = result
        self._error = error
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            _call_back(fn, self)


if TYPE_CHECKING:
    # For the type checker an engine record is a Handle too (its base, in the stubs' terms); at run
    # time nanobind's classes take one base, and Handle knows its engine subclasses by registration.
    # (Handle's seq, kind, dtype and count are attributes; the record's are read-only properties.)
    class _EngineBase(_engine.Started, Handle):  # type: ignore[override]
        pass
else:
    _EngineBase = _engine.Started


class EngineHandle(_EngineBase):
    """A host collective the engine started asynchronously (Client.start_async): the engine's own
    record of it (`_engine.Started`, which WorkerChannel.begin makes as this class) is the handle. Its
    copy-in and SUBMIT were the engine's, and wait() is the engine's too: the DONE taken, the result
    copied out and the RELEASE held, GIL released, and its result returned with no Python run
    (Started.wait). Only what that does not end in comes here (_settle): not in time, the job's
    failure, a refusal, or a DONE another thread completes.

    Nothing else is woken for it, and it is on no table of the client's (the channel's live() lists
    it for shutdown), until a callback is added or it is polled: from then on it is collected
    (_collect: on the client's table, Started.collect), and a DONE taken while nobody waits is
    completed in the engine by the thread that took it (the client's DONE thread, or a waiter), which
    then runs the callbacks (Client._on_engine_done); a wait that completes it runs them (_completed).
    Handle's other fields keep their class defaults: none of them applies."""

    _callbacks: list[Callable[[Handle], None]] | None = None
    _result: Any = None
    _error: SmddpError | None = None
    _event: Latch | None = None  # type: ignore[assignment]  # made once collected: what a waiter of another thread's completion waits on
    _callbacks_lock = threading.Lock()  # orders add_done_callback against _finish (only for callbacks)

    @property
    def _default_timeout_s(self) -> float:  # type: ignore[override]
        return float(self._client.config.timeout_s)

    @property
    def _slot(self) -> Slot | None:
        return self.slot

    def synchronize(self, timeout: float | None = None) -> Any:
        """wait(), then block the host until a device result is in device memory (any stream may read it)."""
        return self.wait(timeout)

    def done(self) -> bool:
        if self.finished:
            return True
        if self._client._failure is not None:
            return True  # (its wait raises the failure)
        self._collect()  # polled rather than waited for: from now on the DONE thread completes it
        return bool(self.finished)

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        self._collect()  # someone must take its DONE if nobody waits
        with EngineHandle._callbacks_lock:
            if not self.finished:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _call_back(fn, self)

    def _drop(self) -> None:
        if self._event is None:
            self._collect(drop=True)
        elif not self.finished:
            self.collect(True)  # collected already: the channel's destination replaced by none

    def _collect(self, drop: bool = False) -> None:
        """Callbacks or polls wait for it: on the client's table (its failure finishes it), and the
        engine's taker of its DONE completes it (Started.collect; `drop`: its result goes nowhere)."""
        if self._event is not None:
            return
        c = self._client
        with c._lock:
            if self._event is not None or self.finished:
                return
            self._event = Latch()
            failed = c._failure
            if failed is None:
                c._handles[self.seq] = self
        if failed is not None:
            self._finish(error=failed)
        elif self.collect(drop) is None:
            self._completed()  # a wait completed it before it saw it collected: its callbacks run here

    def _completed(self) -> None:
        """Completed by a wait once collected (Started.wait calls this): off the client's table and
        finished here, callbacks included, unless the job's failure finished it first."""
        c = self._client
        with c._lock:
            mine = c._handles.pop(self.seq, None) is not None
        if mine:
            self._finish(self._value)

    def _finish(self, result: Any = None, error: SmddpError | None = None) -> None:
        if error is not None:
            self._error = error
        with EngineHandle._callbacks_lock:
            self._complete(error is not None)
            callbacks, self._callbacks = self._callbacks, None
        if self._event is not None:
            self._event.set()
        for fn in callbacks or ():
            _call_back(fn, self)

    def _settle(self, end: bool | BaseException | None, t: float, waited: float, stream: Any) -> Any:
        """What a wait that did not end in its result raises or returns (Started.wait): `end` is True
        (finished: failed), False (not in time, or the channel aborted), None (another thread is
        completing it: a second waiter, or the DONE thread once collected) or the exception of the
        channel's refusal (a DONE or ring the daemon broke, or its ring full: the client fails). `t`:
        the time left of the wait's `waited` seconds."""
        c = self._client
        if isinstance(end, BaseException):
            c._engine_failed(end)
        deadline = time.monotonic() + t
        while True:
            if self.finished:
                if self._error is not None:
                    raise fresh(self._error)
                return self._value
            if c._failure is not None:
                raise fresh(c._failure)
            if c._closed:
                raise NotInitializedError("smddp has been shut down")
            left = deadline - time.monotonic()
            if end is False or left <= 0:
                raise CollectiveTimeoutError.waiting(
                    waited,
                    f"collective #{self.seq} ({self.kind.label}, {self.dtype.label}, count={self.count})",
                )
            event = self._event
            if event is not None:
                event.wait(min(left, 0.05))
            else:
                time.sleep(min(left, 1e-4))  # the other waiter finishes it as soon as it has the GIL


class DeviceHandle(EngineHandle):
    """A collective of device buffers (Client.submit): the engine's record of it, as for a host one
    (WorkerChannel.reserve_record: its sequence number, its DONE checked and its result located by
    whoever takes it, on the channel's one table), and its way through the device, the engine's too
    (DeviceEngine): its SUBMIT given the moment the copy of its data into its slot lands (give_when),
    its result copied back to the device by whoever takes its DONE and RELEASEd once that copy has
    landed (deliver_to).

    wait() blocks the host only until the result has reached this node and its copy to the device
    is enqueued; that copy is ordered before later work on the caller's stream by an event the
    stream waits on (docs/gpu.md)."""

    _plan: DevicePlan  # set by Client.submit
    _ready: _engine.CopyIn | None = None  # its copy-in (the engine's), for a blocking call's own wait

    def wait(self, timeout: float | None = None, stream: Any = None) -> Any:
        t = self._default_timeout_s if timeout is None else timeout
        result = self._wait(t)
        plan = self._plan
        if stream is None:
            io = self._client._device
            assert io is not None  # (a device plan made it)
            consumer = io.consumer_stream(plan)
        else:
            consumer = stream_handle(stream)
        if consumer != plan.inline:  # the copy back ran on that stream itself: in order already
            self._device_order(consumer)
        return result

    def synchronize(self, timeout: float | None = None) -> Any:
        t = self._default_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + t
        result = self.wait(t)
        if not self._device_synchronize(max(0.0, deadline - time.monotonic())):
            raise CollectiveTimeoutError.waiting(
                t, f"collective #{self.seq}'s copy to the device (behind the work queued before it)"
            )
        return result

    def done(self) -> bool:
        if not EngineHandle.done(self):
            return False
        try:
            return self._error is not None or self._device_done()
        except DeviceError:
            return True  # its copy back failed: the client fails with it (the DONE thread)


def when_all(handles: Sequence[Handle], fn: Callable[[], None]) -> None:
    """Call `fn()` once every handle has finished (at once if there are none), in the thread that
    finishes the last; the same rules as Handle.add_done_callback."""
    if not handles:
        fn()
        return
    left = [len(handles)]
    lock = threading.Lock()

    def one(_h: Handle) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        fn()

    for h in handles:
        h.add_done_callback(one)


def _call_back(fn: Callable[[Handle], None], handle: Handle) -> None:
    try:
        fn(handle)
    except Exception:  # a caller's callback must not stop the thread that finished the handle
        log.exception("smddp: a done-callback of collective #%d raised", handle.seq)


Handle.register(EngineHandle)  # (DeviceHandle with it)
Handle.register(StepHandle)


class PipelinedHandle(Handle):
    """A collective submitted as consecutive pieces (ClientConfig.pipeline_bytes): one Handle to the caller."""

    def __init__(self, pieces: list[Handle], count: int, result: Any) -> None:
        first = pieces[0]
        super().__init__(first.seq, first.kind, first.dtype, count, result, first._default_timeout_s)
        self.pieces = pieces

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """`fn(self)` once every piece has finished."""
        when_all(self.pieces, lambda: fn(self))

    def done(self) -> bool:
        return all(h.done() for h in self.pieces)

    def _drop(self) -> None:
        for h in self.pieces:
            h._drop()

    def wait(self, timeout: float | None = None, stream: Any = None) -> Any:
        t = self._default_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + t
        for h in self.pieces:
            try:
                h.wait(max(0.0, deadline - time.monotonic()), stream)
            except CollectiveTimeoutError:
                raise CollectiveTimeoutError.waiting(
                    t,
                    f"collective #{self.seq} ({self.kind.label}, {self.dtype.label}, count={self.count}, "
                    f"in {len(self.pieces)} pieces #{self.seq}-#{self.pieces[-1].seq})",
                ) from None
        return self._result

    def synchronize(self, timeout: float | None = None) -> Any:
        t = self._default_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + t
        self.wait(t)
        for h in self.pieces:  # device pieces: each one's copy to the device reached, on the host
            h.synchronize(max(0.0, deadline - time.monotonic()))
        return self._result


class Client:
    """One worker's session with its node daemon. Build it with `Client.connect()`."""

    def __init__(
        self, config: ClientConfig, membership: Membership, conn: Connection, job_dir: str = ""
    ) -> None:
        self.config = config
        self.job_dir = job_dir  # the daemon's private directory ("" = unknown: nothing is written there)
        # Calls the front ends of this process routed elsewhere (count_routed), and when last written.
        self._routed: dict[str, int] = {}
        self._routed_lock = threading.Lock()
        self._routed_at = 0.0
        self._front: dict[str, str] = {}  # note_front_end's (under _routed_lock)
        self.membership = membership
        self.job = membership.job
        self.rank = membership.rank
        self.size = self.job.size
        self.local_size = self.job.local_size
        self.local_rank = self.rank - membership.node * self.local_size
        self.node = membership.node
        self._conn = conn
        # Sequence numbers are the channel's, and so is their order on the ring (a SUBMIT given before
        # one reserved ahead of it waits there); this lock guards the handle table.
        self._lock = threading.Lock()
        # seq -> a collected collective (callbacks or polls wait for it: the DONE thread completes it)
        self._handles: dict[int, EngineHandle] = {}
        self._arena = Arena(config.arena_bytes, f"smddp-rank{self.rank}")
        self._failure: SmddpError | None = None
        self._wrapper: WrapperPipe | None = None  # smddp-launch's wrapper listens here (set by connect)
        self._closed = False
        self._timeline: list[dict] = []
        # The device path, built when the first device buffer arrives (a CPU-only job never builds it).
        self._device_lock = threading.Lock()
        self._device: DeviceIO | None = None
        # The engine's device path (DeviceEngine), made with the device machinery, for its runtime's driver.
        self._device_engine: _engine.DeviceEngine | None = None
        # The engine's C function table for native front ends (native_api()), made at the first ask.
        self._native: _engine.NativeApi | None = None
        # The GPU step (node_reduce): decided by every rank together at the first device all-reduce.
        self._node_step: NodeStep | None = None
        self._node_step_decided = False
        self.node_reduce_why = UNDECIDED  # why device all-reduces go through the host ("" where they do not)
        self._held_cv = threading.Condition(self._lock)  # _copying_in went down
        # Device copy-ins being pinned and enqueued outside the lock (submit): shutdown waits for them
        # before it waits for the copies themselves, and refuses new ones first (_closing).
        self._copying_in = 0
        self._closing = False
        self._tls = threading.local()  # .waited: inside waiting()
        # ATTACH, SUBMIT, RELEASE and BYE go on this channel's submit ring, SEGMENT and DONE come on
        # its done ring, the fds of ATTACH and SEGMENT on its side socket (docs/protocol.md, CHANNEL);
        # the unix socket carries the rest.
        self._channel = _engine.WorkerChannel(f"smddp-channel-rank{self.rank}")
        # What every asynchronous collective the engine starts shares; it makes their records as
        # EngineHandles, each naming this client.
        self._channel.bind(
            self._arena.native, self.rank, RELEASE_BATCH_BYTES, config.timeout_s, RING_SPIN_US, EngineHandle,
            self,
        )  # fmt: skip
        if config.timeline_dir:
            self._channel.set_trace(True)  # the engine's collectives keep their phases (_write_timeline)
        # On one node a large all-reduce streams through the channel (its daemon publishes the result
        # as it is reduced); across nodes it goes as pipelined pieces instead (pipeline_bytes).
        self._channel.set_stream(self.job.nnodes == 1)
        seg = self._channel.segment
        conn.send_frame(
            Channel(self.rank, 0, seg.size).header(),
            fds=[seg.fd, self._channel.daemon_end],
            timeout=config.timeout_s,
        )
        seg.close_fd()  # the daemon has its own; the mapping stays
        self._channel.close_daemon_end()
        self._done_thread = threading.Thread(target=self._done_loop, name="smddp-client-done", daemon=True)
        self._done_thread.start()
        self._reader = threading.Thread(target=self._read_loop, name="smddp-client-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ setup / teardown

    @classmethod
    def connect(cls, config: ClientConfig, env: Mapping[str, str] | None = None) -> Client:
        """Find this node's daemon from where smddp-launch placed us, then connect and authenticate.

        No MPI here: the workers' MPI world (if the script uses one) is the script's own.
        """
        environ = os.environ if env is None else env
        place = Placement.from_env(environ)
        directory = job_dir(default_socket_dir(), place.job_hex, place.node)
        me = join_job(place, directory, config.connect_timeout_s)
        _configure_logging(config.log_level, me.rank, me.node)
        ep = me.job.daemons[me.node]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + config.connect_timeout_s
        while True:
            try:
                sock.connect(ep.socket_path)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    sock.close()
                    raise PeerLostError(
                        f"rank {me.rank}: cannot reach the daemon at {ep.socket_path}: {e}"
                    ) from None
                time.sleep(0.05)
        conn = Connection(sock, f"the daemon of {me.job.describe_node(me.node)} (pid {ep.pid})")
        try:
            client_handshake(
                conn, me.job.secret, me.job.job_id, Role.WORKER, me.rank, config.connect_timeout_s
            )
        except BaseException:
            conn.close()
            raise
        log.info("connected to %s", conn.peer)
        client = cls(config, me, conn, directory)
        client._wrapper = WrapperPipe.open(environ)
        return client

    def count_routed(self, key: str) -> bool:
        """Count one call a front end sent elsewhere (a side group), for `smddp status`; True the
        first time `key` is seen in this process (every group of the process counts together).

        The counts go to `routed-<rank>.json` in the daemon's private directory, renamed into place;
        the daemon adds every local rank's counts to its report. Written when a new kind of call
        appears, else at most once a second, and at shutdown.
        """
        with self._routed_lock:
            first = key not in self._routed
            self._routed[key] = self._routed.get(key, 0) + 1
            due = first or time.monotonic() - self._routed_at >= 1.0
        if due:
            self._write_routed()
        return first

    def _write_routed(self) -> None:
        with self._routed_lock:  # one writer of the file at a time
            self._routed_at = time.monotonic()
            if self._routed:
                self._show_daemon("routed", self._routed)

    def _show_daemon(self, what: str, said: dict) -> None:
        """(_routed_lock held) `said` as `<what>-<rank>.json` in the daemon's private directory, renamed
        into place, for its report to `smddp status`."""
        if not self.job_dir:
            return
        path = os.path.join(self.job_dir, f"{what}-{self.rank}.json")
        try:
            with open(f"{path}.tmp", "w") as f:
                json.dump(said, f)
            os.replace(f"{path}.tmp", path)
        except OSError:
            pass  # the daemon has gone (the job is ending): nothing left to show them to

    def note_front_end(self, key: str, value: str) -> None:
        """Say what a front end chose in this process (the torch backend a group got), for `smddp
        status`: `front-<rank>.json` in the daemon's private directory, renamed into place, which the
        daemon shows per rank."""
        with self._routed_lock:
            self._front[key] = value
            self._show_daemon("front", self._front)

    def shutdown(self, timeout: float | None = None) -> None:
        """Wait for in-flight collectives, tell the daemon goodbye, release everything. Idempotent."""
        if self._closed:
            return
        t = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + t
        with self._lock:
            # No device copy-in starts from now on, and the ones being enqueued (outside the lock) are
            # waited for: every copy into smddp's memory is then known to the engine (settle below).
            self._closing = True
            self._held_cv.wait_for(lambda: self._copying_in == 0, max(0.0, deadline - time.monotonic()))
            pending: list[EngineHandle] = list(self._handles.values())
        known = {h.seq for h in pending}
        # The engine's collectives nobody waited for or collected are on no table but the channel's.
        pending += [h for h in self._channel.live() if h.seq not in known]
        for h in pending:
            try:  # nothing takes an unwaited one's DONE: its wait does (the engine's: no stream to order)
                h._wait(max(0.0, deadline - time.monotonic()))
            except SmddpError:
                pass  # failed or not in time: said below
        while self._channel.blocking() and time.monotonic() < deadline:  # another thread's blocking call
            time.sleep(0.001)
        native = self._native
        # The native front ends' works complete through their own waits or the DONE thread: waited
        # for here until the deadline, and any left fail below, after the channel is closed.
        while native is not None and native.pending() and time.monotonic() < deadline:
            time.sleep(0.001)
        unfinished = [h.seq for h in pending if not h.finished] + sorted(self._channel.blocking())
        native_left = native.pending() if native is not None else 0
        device, engine = self._device, self._device_engine
        copying = False  # a device copy into or out of smddp's memory still running at the bound
        if device is not None and engine is not None:
            # A RELEASE goes once its result's copy to the device has landed (the engine's watch):
            # let those leave before BYE. And every copy touching smddp's memory must have ended
            # before it is unpinned and unmapped, the in-line ones on callers' streams too (behind
            # the callers' own kernels).
            copying = not engine.settle(max(0.0, deadline - time.monotonic()))
            copying = not device.copies_done(max(0.0, deadline - time.monotonic())) or copying
        if self._node_step is not None and not self._node_step.close(max(0.0, deadline - time.monotonic())):
            # Its lanes (or a peer's reads of its slots) did not end: its memory stays until the
            # process ends, and the job fails, as for a copy that did not end.
            copying = True
        with self._lock:
            self._closed = True
            self._channel.close_starts()  # (BYE must be the last descriptor)
            self._held_cv.notify_all()
        if engine is not None:
            engine.stop(
                False
            )  # no SUBMIT given nor RELEASE sent after BYE (nor into a channel that is going)
        if native is not None:
            # (no start from here on; what is left fails: its destination is written no more)
            native.fail_all("NotInitializedError", "smddp has been shut down")
        self._write_routed()  # the final counts, before BYE lets the daemon finish
        if self._failure is None and not unfinished and not native_left and not copying:
            try:
                self._send_frames([Bye(self.rank).header().encode()], timeout=5.0)
            except SmddpError:
                pass
        self._channel.abort()
        self._channel.unbind()  # (it held this client: no cycle is left for the garbage collector)
        self._conn.hang_up()  # (the reader wakes and leaves before the socket is closed under it)
        self._reader.join(timeout=5.0)
        self._conn.close()
        self._done_thread.join(timeout=5.0)
        self._write_timeline()
        if copying:
            # A copy may still write or read this memory: it stays pinned and mapped (the process's
            # end takes it, after the device's), and the job fails (no BYE was sent), rather than a
            # copy running into memory that is gone.
            log.error(
                "rank %d: shut down with a device copy into or out of smddp's memory still running after "
                "%gs (behind the kernels queued before it): its memory is left mapped until the process ends",
                self.rank, t,
            )  # fmt: skip
        else:
            if device is not None:
                # Unpin before anything unmaps the segments (the engine's result segments, then the
                # client's input ones); the runtime goes last.
                if engine is not None:
                    engine.stop(True)
                device.close()
                device.rt.close()
            self._arena.close()
        if self._wrapper is not None:
            self._wrapper.close()
        if copying:
            raise DeviceError(
                f"rank {self.rank}: shut down with a device copy into or out of smddp's memory still running "
                f"after {t:g}s: its memory is left mapped until the process ends, and the job fails"
                + (f" (collectives {unfinished} unfinished)" if unfinished else "")
            )
        if unfinished or native_left:
            # Leaving without BYE tells the daemon this rank is gone, so the job fails instead of hanging.
            left = f"collectives {unfinished}" if unfinished else ""
            if native_left:
                left += (" and " if left else "") + f"{native_left} native collectives"
            raise CollectiveTimeoutError(f"rank {self.rank}: shut down with {left} unfinished")

    # ------------------------------------------------------------------ collectives

    def _check_open(self) -> None:
        if self._closed:
            raise NotInitializedError("smddp has been shut down")
        if self._failure is not None:
            raise fresh(self._failure)

    def _alloc_locked(self, nbytes: int) -> tuple[Slot | None, ConnectionClosed | None]:
        """A slot of the arena, with _lock held; a new segment is ATTACHed on the ring first, ahead of
        the SUBMIT that names it (the channel does both under its push lock, as the fast path's
        start does). The daemon's loss comes back for the caller to fail with (and no slot)."""
        try:
            got = self._channel.alloc(
                self._arena.native, nbytes, self.rank, self.config.timeout_s, RING_SPIN_US
            )
        except TimeoutError:
            return None, ConnectionClosed(
                f"the daemon did not read this worker's ring for {self.config.timeout_s:g}s (frozen or gone)"
            )
        except ProtocolError as e:  # its fd could not go (not for a closed daemon end: that is no error)
            return None, ConnectionClosed(str(e))
        if got.fresh is not None:
            self._arena.adopt(got.fresh)
        return Slot(got.segment, got.offset, nbytes), None

    def submit(
        self,
        kind: Kind,
        dtype: DType,
        count: int,
        op: ReduceOp | None,
        root: int,
        result: Any,
        device: DevicePlan,
        hold: bool = True,
    ) -> DeviceHandle:
        """A collective of device buffers, the engine's record (DeviceHandle) under the channel's next
        sequence number: the copy of `device.src` into a shared slot (an asynchronous device-to-host
        copy), and its SUBMIT, given by the engine the moment that copy lands (DeviceEngine.give_when;
        the channel keeps every later SUBMIT behind it meanwhile). Its result goes back to the device
        as the plan says, enqueued by whoever takes its DONE (DeviceEngine.deliver_to), and its wait
        returns `result`. A plan with no `src` (a broadcast's receiver) sends no data. Host
        collectives are start_async's. `hold` False: a SUBMIT that waits for its copy-in is not handed
        to the engine; the caller watches the copy (the handle's `_ready`) and gives it
        (device_allreduce_now)."""
        nbytes = count * dtype.itemsize
        lost: ConnectionClosed | None = None
        refused: TimeoutError | ProtocolError | None = None
        src = device.src
        slot = None
        ready = None
        engine = self._device_path()
        with self._lock:
            self._check_open()
            if self._closing:
                raise NotInitializedError("smddp is shutting down")
            if src is not None:
                slot, lost = self._alloc_locked(nbytes)
                if slot is not None:
                    self._copying_in += 1
        if slot is not None:
            assert src is not None
            # Outside the lock: pinning a new segment touches every page of it, and a copy into memory
            # that could not be pinned blocks until the producer's kernels are done; the DONE thread
            # needs the lock for every other collective's completion meanwhile.
            try:
                ready = self._copy_in(engine, device, src, slot)
            finally:
                with self._lock:
                    self._copying_in -= 1
                    self._held_cv.notify_all()
        with self._lock:
            handle: DeviceHandle | None = None
            if lost is None:
                if self._closed or self._failure is not None:
                    # (its copy-in may still run into the slot, so the slot stays taken: the arena
                    # is not used again, and shutdown waits for the copy before it unmaps anything)
                    self._check_open()
                handle = self._channel.reserve_record(
                    kind, count, dtype, op or 0, root, slot,
                    _result_bytes(kind, nbytes, self.size), result, device.keepalive, DeviceHandle,
                )  # fmt: skip
                handle._plan = device
                self._deliver_to(engine, handle, device)
                if ready is None:
                    refused = self._give_locked(handle)
                elif hold:
                    # This one waits for its copy-in (the channel keeps later SUBMITs behind it).
                    self._hold(engine, handle, ready)
                else:
                    handle._ready = ready
        if lost is not None:  # (no slot was taken: _alloc_locked gives none with a loss)
            # Outside the lock: _fail takes it too (the reader thread may be failing us right now).
            self._fail(_daemon_lost(f"rank {self.rank}: lost the node daemon: {lost}"))
            assert self._failure is not None  # set by _fail, now or by the reader before it
            raise fresh(self._failure) from None
        if refused is not None:
            raise self._give_failed(refused) from None
        assert handle is not None
        return handle

    def submit_step_pieces(
        self, step: NodeStep, kind: Kind, dev: DeviceBuffer, op: ReduceOp | None, producer: int | None,
        out: DeviceBuffer | None = None, root: int = 0,
    ) -> _engine.StepDone:  # fmt: skip
        """Across nodes, the GPU step's collective `kind` of device buffer `dev` (step.start): a slot
        for each of its pieces, the pieces enqueued on the step (NodeStep.start_across) with what each
        sends copied into its slot on the step's in lane, and a record for each piece, which goes once
        its copy lands (where it sends nothing, once the in lane reaches it). An all-reduce's piece
        sends this rank's slice of the node's partial (its SUBMIT says the node summed it), and so
        does a reduce-scatter's (whose block of the result comes back straight into `out`); an
        all-gather's, its input's piece
        (the result's rows of this rank's slice come back, `out` the node's to fill); a broadcast's,
        the root's piece (the others send nothing). Each piece's slice of the result comes back on the
        step's back lane at its DONE, followed by the slice's out_ready (the node's gather lanes wait
        for every rank's); the broadcast's root takes nothing back (its slice is its own). Collected, so that the DONE thread takes each DONE: nobody waits for the
        pieces but through the step's end, which is returned."""
        engine = self._device_path()
        isz = dev.dtype.itemsize
        g, me, world = self.local_size, self.local_rank, self.size
        rows = world // g  # (an all-gather's result rows each rank brings back a piece)
        if kind is Kind.REDUCE_SCATTER:
            assert out is not None  # (a piece is [a, b) of every rank's block: the world's blocks)
            counts = step.step.piece_counts(out.count, isz * world)
        else:
            counts = step.step.piece_counts(dev.count, isz * rows if kind is Kind.ALLGATHER else isz)
        summed = kind in (Kind.ALLREDUCE, Kind.REDUCE_SCATTER)
        sends = kind is not Kind.BROADCAST or self.rank == root
        aux = (
            root
            if kind is Kind.BROADCAST
            else len(counts)
            if len(counts) > 1 and kind is Kind.ALLREDUCE
            else 0
        )
        slots: list[Slot | None] = []
        lost: ConnectionClosed | None = None
        with self._lock:
            self._check_open()
            if self._closing:
                raise NotInitializedError("smddp is shutting down")
            for m in counts:
                if not sends:
                    slots.append(None)
                    continue
                # A summed piece's slot holds this rank's slice alone (SUBMIT_NODE_SUMMED): elements
                # [t*me//g, t*(me+1)//g) of its t (a reduce-scatter's: the world's blocks of m); a
                # gather's, the piece it sends.
                t = m * world if kind is Kind.REDUCE_SCATTER else m
                nbytes = (t * (me + 1) // g - t * me // g) * isz if summed else m * isz
                slot, lost = self._alloc_locked(nbytes)
                if slot is None:
                    break
                slots.append(slot)
            self._copying_in += 1
        try:
            if lost is not None:
                self._fail(_daemon_lost(f"rank {self.rank}: lost the node daemon: {lost}"))
                assert self._failure is not None
                raise fresh(self._failure) from None
            at = [(-1, 0) if sl is None else (sl.segment, sl.offset) for sl in slots]
            done, copies, pieces = step.start_across(
                kind, engine, self._arena.native, at, dev, op, producer, out, root
            )
        finally:
            with self._lock:
                self._copying_in -= 1
                self._held_cv.notify_all()
        handles: list[DeviceHandle] = []
        with self._lock:
            self._check_open()
            for slot, copy, (number, count, back, offset, nbytes, out_ready) in zip(
                slots, copies, pieces, strict=True
            ):
                # (a reduce-scatter's SUBMIT is of the world's blocks of the piece; an all-gather's
                # result is the world's rows)
                total = count * world if kind is Kind.REDUCE_SCATTER else count
                result_bytes = total * isz * (world if kind is Kind.ALLGATHER else 1)
                handle = self._channel.reserve_record(
                    kind, total, dev.dtype, op or 0, aux, slot, result_bytes, None, None, DeviceHandle,
                    node_summed=summed,
                )  # fmt: skip
                # (out_ready 0: nothing comes back, the broadcast's root having its slice already)
                way_back = [(back, offset, nbytes)] if out_ready else []
                engine.deliver_to(
                    handle, dev.device, step.step.back_lane, None, way_back, None,
                    (out_ready, number & 0xFFFFFFFF) if out_ready else None,
                )  # fmt: skip
                # (one that sends nothing waits for its point of the in lane all the same: no piece's
                # result may come back before the node's ranks are done with its slot)
                self._hold(engine, handle, copy)
                handles.append(handle)
        for h in handles:
            h._collect()
        return done

    def _give_locked(self, handle: DeviceHandle) -> TimeoutError | ProtocolError | None:
        """(lock held) Give `handle`'s SUBMIT, unless the client failed or closed (its wait then says
        so); the channel's refusal, for the caller to raise once the lock is let go (_give_failed)."""
        if self._failure is not None or self._closed:
            return None
        try:
            handle.give(self.config.timeout_s)
        except (TimeoutError, ProtocolError) as e:
            return e
        return None

    def _hold(self, engine: _engine.DeviceEngine, handle: DeviceHandle, ready: _engine.CopyIn) -> None:
        """(lock held) `handle`'s SUBMIT goes once its copy-in (`ready`) is complete: given by the
        engine's device watch the moment the copy lands (no thread of this client's)."""
        if not engine.give_when(handle, ready):
            # Stopped: shutdown has begun, and its wait for this one ends with the shutdown's.
            log.warning(
                "rank %d: collective #%d started as smddp shut down: it never goes", self.rank, handle.seq
            )

    def _deliver_to(self, engine: _engine.DeviceEngine, handle: DeviceHandle, plan: DevicePlan) -> None:
        """(lock held) Where `handle`'s result goes once its DONE is taken: each output's bytes to its
        device buffer, on the caller's stream in line, or else on the device's copy-back lane after
        the caller's stream at the call (`before`); the engine copies and RELEASEs (DeviceEngine)."""
        io = self._device
        assert io is not None
        if plan.inline is not None:
            stream, before = plan.inline, None
        else:
            stream, before = io.lane(plan.device).h2d, plan.before
        parts = [(dst.ptr, off, n) for dst, off, n in plan.outputs]
        # What the copies need alive until they land: the destinations (and their owners).
        engine.deliver_to(handle, plan.device, stream, before, parts, (plan.keepalive, plan.outputs))

    def _device_path(self) -> _engine.DeviceEngine:
        """The engine's device path for this client's runtime (its driver_library() loaded into the
        engine), made with the device machinery (_device_io)."""
        self._device_io()
        engine = self._device_engine
        if engine is None:
            self._check_open()
            raise NotInitializedError("smddp is shutting down")
        return engine

    def device_allreduce_now(
        self, dev: DeviceBuffer, op: ReduceOp, stream: int, timeout: float | None
    ) -> DeviceHandle | StepHandle:
        """A blocking all-reduce of device buffer `dev` in place, in one piece, for a caller that waits
        for it at once on `stream` (the stream its work on `dev` is queued on): the copy to the host
        in line on `stream`, this thread waiting for it and sending the SUBMIT, taking the DONE and
        enqueuing the copy back in line on `stream` too (the engine, in this wait). Returns its
        record, complete: the caller's later work on `stream` is ordered after its copy back already
        (a host that reads the buffer next waits for that copy: its synchronize()). The same record,
        copies and RELEASE as submit() and DeviceHandle.wait(), without their hand-offs: nothing is
        handed to another thread but the RELEASE, which the engine's device watch sends once the copy
        back has landed (issue 28: a 4 KiB call's Python there was most of its time beyond the
        copies).

        Raises as a wait does. A copy-in not complete within `timeout` leaves its SUBMIT to the
        engine (given once the copy lands); the wait times out then, and its result is dropped.

        Where the job's device all-reduces take the GPU step (node_step), it goes there instead, and
        its StepHandle, complete and ordered before `stream`'s later work, is returned."""
        t = self.config.timeout_s if timeout is None else timeout
        step = self.node_step(dev)
        if step is not None:
            h = start_step(self, step, dev, op, stream, None)
            try:
                h.wait(t)
            except CollectiveTimeoutError:
                h._drop()
                raise
            return h
        deadline = time.monotonic() + t
        _refuse_capture(self._device_path(), dev.device, stream)
        plan = DevicePlan(
            dev.device, dev, None, [(dev, 0, dev.nbytes)], stream, dev.library, dev.keepalive, inline=stream
        )
        handle = self.submit(Kind.ALLREDUCE, dev.dtype, dev.count, op, 0, None, plan, hold=False)
        ready = handle._ready
        assert ready is not None  # (an all-reduce's plan has a source)
        error: SmddpError | None = None
        try:
            # Polled by the engine, GIL released: yielding the core at first, then in short naps.
            copied = ready.wait(max(0.0, deadline - time.monotonic()))
        except SmddpError as e:
            error = DeviceError(f"the copy-in of collective #{handle.seq} failed: {e}")
        if error is not None:
            self._device_failed(error)  # (the record is the channel's live one: the failure finishes it)
            copied = True
        refused: TimeoutError | ProtocolError | None = None
        engine = self._device_path() if not copied else None
        with self._lock:
            if engine is None:
                refused = self._give_locked(handle)
            else:
                self._hold(engine, handle, ready)  # the engine gives it once its copy lands
        if refused is not None:
            raise self._give_failed(refused) from None
        try:
            # Its DONE's taker (this wait, mostly) enqueues the copy back (the engine: deliver_to).
            handle._wait(max(0.0, deadline - time.monotonic()))
        except CollectiveTimeoutError:
            # Nobody waits for it again, and its caller is told it failed: it completes (whichever thread
            # takes its DONE RELEASEs it), but its result is never copied back into the caller's tensor.
            handle._drop()
            raise CollectiveTimeoutError.waiting(
                t, f"collective #{handle.seq} (allreduce, {dev.dtype.label}, count={dev.count})"
            ) from None
        return handle

    def allreduce_now(
        self,
        buf: np.ndarray | int,
        dtype: DType,
        count: int,
        op: ReduceOp,
        timeout: float | None,
    ) -> bool:
        """A blocking all-reduce of host memory in place, run by the engine from the copy into shared
        memory to the copy of the result back and its RELEASE (WorkerChannel start/finish, without
        the GIL): no Handle, no Python per DONE (behind device SUBMITs still waiting for their
        copy-in, it waits in the channel and goes right after them). False, with nothing done, once
        the client is shutting down (the general way's open check then refuses the call).

        `buf` is a C-contiguous, writable numpy array of `count` elements of `dtype` (empty too),
        taken whole (the caller checked: collectives.allreduce), or the address of such memory, not
        empty (a torch tensor's data_ptr(), whose numpy view costs more than the rest of the call). A
        collective that does not complete within `timeout` raises CollectiveTimeoutError, as wait()
        does, and its result is dropped: it completes as an asynchronous collective of the engine's
        (_parked) whose result goes nowhere, so nothing writes `buf` after the error.
        """
        return self._now(buf, dtype, count, op, timeout, Kind.ALLREDUCE)

    def barrier_now(self, timeout: float | None) -> bool:
        """A blocking barrier, run by the engine as allreduce_now is (SUBMIT, DONE, RELEASE, GIL
        released; no data): no Handle, no DONE thread. False, with nothing done, once the client is
        shutting down."""
        return self._now(NO_DATA, DType.UINT8, 0, None, timeout, Kind.BARRIER)

    def _now(
        self,
        buf: np.ndarray | int,
        dtype: DType,
        count: int,
        op: ReduceOp | None,
        timeout: float | None,
        kind: Kind,
    ) -> bool:
        if self._closed or self._failure is not None:
            self._check_open()
        try:
            # Slot, copy-in, SUBMIT under the channel's next seq, DONE, copy-out, RELEASE: one call
            # (the arena, rank, RELEASE batch, spin and the job's timeout as bind() gave them).
            t = self.config.timeout_s if timeout is None else timeout
            ran = self._channel.run(kind, buf, count, dtype, op or 0, t)
        except (TimeoutError, ProtocolError) as e:
            raise self._engine_failed(e) from None
        if ran is _RAN_DONE:
            return True
        if ran is _RAN_CLOSED:
            return False  # shutting down: the general way refuses it
        assert ran.end is _engine.RunEnd.PARKED and ran.slot is not None
        raise self._parked(ran.seq, ran.slot, dtype, count, op, t, kind)

    def start_async(
        self,
        kind: Kind,
        src: np.ndarray | tuple[np.ndarray, ...] | int,
        dtype: DType,
        count: int,
        op: ReduceOp | None,
        root: int,
        dst: np.ndarray | int,
        src_offset: int,
        result_bytes: int,
        owner: Any,
        result: Any,
        keepalive: Any,
    ) -> EngineHandle:
        """An asynchronous host collective of any kind, started by the engine (a slot, the copy of `src`
        into shared memory and the SUBMIT under the channel's next seq, GIL released:
        WorkerChannel::start); its handle's wait() runs the rest there too, and so does whichever
        thread takes its DONE once callbacks or a poll wait for it (Started.collect).

        `src` is what this rank sends (1-D, C-contiguous, or a tuple of such parts sent one after
        another; empty: nothing, as a broadcast's other ranks and a barrier; or the address of `count`
        elements of `dtype`, an all-reduce's in place). Where the result goes: `dst` (1-D,
        C-contiguous; empty for none) takes its bytes of the result from `src_offset`; `result_bytes`
        is the whole result's size (the range the DONE names, and what its RELEASE frees). `dst` may
        be the address of the collective's `count` elements instead, with `owner` the object that owns
        it, which the engine keeps alive while it may still copy there. `result` is what the handle's
        wait returns; `keepalive`, what it holds until then. Behind device SUBMITs still waiting for
        their copy-in it waits in the channel and goes right after them. Once the client is shut
        down or failed, it raises why, with nothing done."""
        if self._closed or self._failure is not None:
            self._check_open()
        try:
            handle: EngineHandle | None = self._channel.begin(
                kind, src, count, dtype, op or 0, root, dst, src_offset, result_bytes, owner, result,
                keepalive,
            )  # fmt: skip
        except (TimeoutError, ProtocolError) as e:
            raise self._engine_failed(e) from None
        return self._started(handle)

    def start_allreduce(
        self, src: np.ndarray | int, dtype: DType, count: int, op: ReduceOp, result: Any, keep: Any
    ) -> EngineHandle:
        """start_async of an all-reduce in place and in one piece, the one every training step starts:
        `src` (1-D, C-contiguous, writable; or the address of `count` elements of `dtype`, whose
        owner `keep` is) takes its result back; `keep` keeps that memory in place while the engine
        may still copy into it. The engine's shortest start (WorkerChannel.begin_allreduce)."""
        if self._closed or self._failure is not None:
            self._check_open()
        try:
            handle: EngineHandle | None = self._channel.begin_allreduce(src, dtype, count, op, result, keep)
        except (TimeoutError, ProtocolError) as e:
            raise self._engine_failed(e) from None
        return self._started(handle)

    def _started(self, handle: EngineHandle | None) -> EngineHandle:
        """What begin() or begin_allreduce() made, as start_async returns it."""
        if handle is None:  # starts closed: shut down meanwhile (or failed: _check_open says which)
            self._check_open()
            raise NotInitializedError("smddp has been shut down")
        failed = self._failure
        if failed is not None:
            handle._finish(error=failed)  # the failure came as it started: _fail may not have seen it
        return handle

    def _give_failed(self, e: TimeoutError | ProtocolError) -> SmddpError:
        """What a reserved SUBMIT's give() that failed raises: as _engine_failed, except that a
        CollectiveTimeoutError fails the client too, since every later SUBMIT waits behind this one."""
        if isinstance(e, CollectiveTimeoutError):
            self._fail(e)
            assert self._failure is not None
            return fresh(self._failure)
        return self._engine_failed(e)

    def _engine_failed(self, e: TimeoutError | ProtocolError) -> SmddpError:
        """What a fast call raises once the channel failed it: the daemon's loss (its ring left full
        for the whole timeout), or a frame or ring it broke (distrusted). The client is failed first.
        A CollectiveTimeoutError (the collectives before it had no result within the timeout: nothing
        was started) is raised as it is, and fails nothing: those collectives' own waits say the rest."""
        if isinstance(e, CollectiveTimeoutError):
            return e if self._failure is None else fresh(self._failure)
        if isinstance(e, TimeoutError):
            self._fail(
                _daemon_lost(
                    f"rank {self.rank}: lost the node daemon: it did not read this worker's ring "
                    f"for {self.config.timeout_s:g}s (frozen or gone)"
                )
            )
        else:
            if self._failure is None and not self._closed:
                self._distrust(e)
            if self._failure is None:
                return e  # (closed meanwhile)
        assert self._failure is not None
        return fresh(self._failure)

    def _parked(
        self,
        seq: int,
        slot: Slot,
        dtype: DType,
        count: int,
        op: ReduceOp | None,
        t: float,
        kind: Kind,
    ) -> SmddpError:
        """What a blocking fast call raises when its collective did not complete within `t` (the channel
        parked it): the client's failure if it failed meanwhile, else CollectiveTimeoutError, with the
        collective made an asynchronous one of the engine's first (WorkerChannel.resume) with no
        destination, collected, so that the engine's taker of its DONE RELEASEs it and copies nothing."""
        if self._failure is not None or self._closed:
            # Nothing will complete it now: out of the engine's table of fast collectives, which
            # shutdown waits on and names as unfinished.
            self._channel.adopt(seq)
            return (
                fresh(self._failure)
                if self._failure is not None
                else NotInitializedError("smddp has been shut down")
            )
        # Its caller is told it failed: its result is dropped (nothing comes back into `buf`, now or
        # when its DONE comes), and the collective completes for the other ranks' sake.
        handle: EngineHandle | None = self._channel.resume(
            seq, slot, kind, count, dtype, op or 0, NO_DATA, None
        )
        if handle is not None:
            handle._collect()
        return CollectiveTimeoutError.waiting(
            t, f"collective #{seq} ({kind.label}, {dtype.label}, count={count})"
        )

    # ------------------------------------------------------------------ the device path

    @property
    def piece_bytes(self) -> int:
        """The piece size of this job's all-reduces, host and device memory alike and whichever
        front end starts them (so that every rank cuts alike): pipeline_bytes in a job of several
        nodes, else whole.

        Pieces overlap this rank's copies with the network; on one node there is no network to overlap,
        and the extra collectives only cost: host memory 56 ms -> 65 ms for 64 MiB, 4 workers (2 cores);
        device memory on an H200 with 8 reduction threads, 4 MiB pieces against whole buffers, 16 MiB
        4.16 against 2.98 ms (2 ranks) and 4.15 against 4.23 ms (4 ranks), 64 MiB 7.80 against 7.44 ms
        and 11.39 against 11.44 ms (bench-results/gpu/2026-11-27)."""
        return self.config.pipeline_bytes if self.job.nnodes > 1 else 0

    def native_api(self) -> Any:
        """A capsule of the engine's C function table over this client (smddp/engine/capi.h): host
        collectives started, waited for and completed from native code with no Python and no GIL
        (the C++ torch backend's way in), and device all-reduces on the engine's device path once this
        client's device machinery has started (its first device collective, or device_runtime()). The
        same channel, arena, rank, timeout and all-reduce pieces as this client's own calls; failed
        with the client, and shut down with it."""
        with self._lock:
            self._check_open()
            if self._native is None:
                self._native = _engine.NativeApi(self._channel, self.size, self.piece_bytes)
                if self._device_engine is not None:
                    self._native.use_device(self._device_engine)
            return self._native.capsule()

    def device_runtime(self) -> DeviceRuntime:
        """The runtime this client copies device buffers with (SMDDP_DEVICE_RUNTIME), built on first use."""
        return self._device_io().rt

    def _device_io(self) -> DeviceIO:
        """The device machinery, built on first use: the runtime, and the engine's device path over the
        runtime's CUDA driver (DeviceUnavailableError naming why, where the engine cannot load it)."""
        with self._device_lock:
            if self._device is None:
                self._check_open()
                self._start_device(load_runtime(self.config.device_runtime))
            assert self._device is not None
            return self._device

    def _start_device(self, rt: DeviceRuntime) -> None:
        """(_device_lock held, or before any device collective) The device machinery over runtime `rt`."""
        try:
            engine = _engine.DeviceEngine(self._channel, rt.driver_library(), COPY_SPIN_S * 1e6)
        except OSError as e:
            rt.close()
            raise DeviceUnavailableError(
                f"the device runtime {rt.name!r} names a CUDA driver the engine cannot load: {e}"
            ) from None
        self._device_engine = engine
        self._device = DeviceIO(rt)
        with self._lock:  # (the C table, if one was made, runs its device route on this path from now on)
            if self._native is not None:
                self._native.use_device(engine)

    def device_buffer(self, buf: Any, what: str, writable: bool) -> DeviceBuffer | None:
        """`buf` as device memory (None for host memory), checked against the runtime before anything is
        sent. A DeviceBuffer (a front end's tensor, device.buffers.described) is taken as it is."""
        if isinstance(buf, DeviceBuffer):
            self._io_taking(buf.keepalive, what)
            view = buf
        else:
            found = device_kind(buf)
            if found is None:
                return None
            via, device = found
            io = self._io_taking(buf, what)
            if via == "dlpack":
                # The export records an event on its library's current stream for our lane to wait on:
                # under capture that would draw the lane into the graph, so it is refused first.
                _refuse_capture(self._device_path(), device, library_stream(io.rt, library_of(buf), device))
                view = read_dlpack(buf, what, device, io.lane(device).d2h)
            else:
                view = read_cai(buf, what)
                view = dataclasses.replace(view, device=io.rt.pointer_device(view.ptr) if view.count else 0)
        if writable and view.readonly:
            raise UnsupportedBufferError(
                f"{what}: the device array is read-only, and this collective writes into it"
            )
        return view

    def _io_taking(self, owner: Any, what: str) -> DeviceIO:
        """The device machinery, once its runtime takes `owner`'s memory; else why not."""
        try:
            io = self._device_io()
        except DeviceUnavailableError as e:
            raise DeviceUnavailableError(f"{what}: {type(owner).__name__} is CUDA memory, but {e}") from None
        why = io.rt.refuse(owner)
        if why is not None:
            raise DeviceUnavailableError(f"{what}: the device runtime is {io.rt.name!r} and {why}")
        return io

    def device_plan(
        self,
        src: DeviceBuffer | None,
        outputs: list[tuple[DeviceBuffer, int, int]],
        stream: Any,
        like: DeviceBuffer,
        keepalive: Any,
        inline: bool = True,
    ) -> DevicePlan:
        """The streams and copies of one device collective; `like` is the buffer that names the device.
        `inline`: its copies may run on the caller's stream when the caller waits at once (not for a
        collective in pieces, whose copies overlap on the lanes)."""
        explicit = None if stream is None else stream_handle(stream)
        io = self._device_io()
        exported = False  # a buffer read through DLPack: its export ordered the copy-in lane
        for b, _off, _n in [*([(src, 0, 0)] if src is not None else []), *outputs]:
            if b.device != like.device:
                raise UnsupportedBufferError(
                    f"device buffers of one collective must be on one device: cuda:{b.device} and cuda:{like.device}"
                )
            exported = exported or b.via == "dlpack"
        consumer = explicit if explicit is not None else (like.stream if like.stream_given else None)
        producer = io.producer_stream(like, explicit)
        engine = self._device_path()
        _refuse_capture(engine, like.device, producer, consumer)
        here = _in_line(producer, explicit, exported) if inline and self._waited() else None
        if here is not None:
            # Waited for at once (Client.waiting): the copies run on the caller's stream, in line,
            # after its work there (DevicePlan.inline); no event orders them.
            return DevicePlan(
                like.device, src, None, outputs, here if consumer is None else consumer, like.library,
                keepalive, inline=here,
            )  # fmt: skip
        # The point of the producer's stream the copies wait for: recorded there by the engine.
        before = None if producer is None else engine.mark(like.device, producer)
        return DevicePlan(like.device, src, before, outputs, consumer, like.library, keepalive)

    def device_route(self) -> str:
        """Where this job's device all-reduces go, as a native front end asks it once: "" while
        undecided (the first device collective decides, every rank together: node_step), "step"
        (the GPU step) or "engine" (the engine's device path, which the C table's start_device runs)."""
        if not self._node_step_decided or self._device_engine is None:
            return ""
        return "step" if self._node_step is not None else "engine"

    def node_step(self, dev: DeviceBuffer) -> NodeStep | None:
        """The GPU step this job's device collectives take (node_reduce; across nodes, all-reduces
        alone), or None: the host path. Decided at the first device collective that may take it, by
        every rank together (step.decide: a collective, which every rank reaches at that call)."""
        if self.config.node_reduce == "host":
            if not self._node_step_decided:
                self._channel.set_node_reduce(1)  # (its daemon shows it)
                self._node_step_decided = True
                self.node_reduce_why = "node_reduce host"
            return None
        if not self._node_step_decided:
            self._node_step, self.node_reduce_why = decide_step(self, dev)
            self._node_step_decided = True
            self._channel.set_node_reduce(2 if self._node_step is not None else 3)
        step = self._node_step
        if step is not None and dev.device != step.device:
            raise UnsupportedBufferError(
                f"the node's GPU step runs on cuda:{step.device}; this buffer is on cuda:{dev.device} "
                "(every device collective of a rank on the step goes through one device)"
            )
        return step

    def refuse_capture(self, device: int, *streams: int | None) -> None:
        """GraphCaptureError where one of `streams` of `device` is capturing a CUDA graph (_refuse_capture)."""
        _refuse_capture(self._device_path(), device, *streams)

    def in_line(self, like: DeviceBuffer, explicit: int | None) -> int | None:
        """The stream on which the copies of a collective of `like` alone may run in line for a caller
        that waits for it at once (_in_line), `explicit` being the `stream=` it passed."""
        return _in_line(self._device_io().producer_stream(like, explicit), explicit, like.via == "dlpack")

    def _copy_in(
        self, engine: _engine.DeviceEngine, plan: DevicePlan, src: DeviceBuffer, slot: Slot
    ) -> _engine.CopyIn:
        """Enqueue the copy of `src` into `slot`: the engine's (DeviceEngine.copy_in, which page-locks
        the slot's segment the first time), on the caller's stream in line or else on the device's
        copy-in lane after the caller's stream at the call (`before`). On failure free the slot and
        raise (nothing still writes into it: the engine enqueued no copy, or waited for the one it did
        before it said it failed)."""
        io = self._device
        assert io is not None
        if plan.inline is not None:
            stream, before = plan.inline, None
        else:
            stream, before = io.lane(src.device).d2h, plan.before
        try:
            return engine.copy_in(
                self._arena.native, slot.segment, slot.offset, src.nbytes, src.device, src.ptr, stream, before
            )
        except BaseException:
            self._arena.free(slot)
            raise

    def _device_failed(self, err: SmddpError) -> None:
        """A device copy failed (or its RELEASE found the daemon gone): fail here, and hang up so the
        daemon fails the job for every rank."""
        if isinstance(err, TransportError):
            err = _daemon_lost(f"rank {self.rank}: lost the node daemon: {err}")
        self._fail(err if isinstance(err, CollectiveError) else CollectiveError(f"rank {self.rank}: {err}"))
        self._conn.hang_up()  # (closed at shutdown, once the reader has left it)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Collectives submitted by this thread inside the block are waited for by it at once (the
        blocking calls, and torch's calls without async_op): a device one's copies may run in line
        on the caller's stream (device_plan)."""
        tls = self._tls
        outer = getattr(tls, "waited", False)
        tls.waited = True
        try:
            yield
        finally:
            tls.waited = outer

    def _waited(self) -> bool:
        """Whether this thread is inside waiting(): what it starts, it waits for at once."""
        return bool(getattr(self._tls, "waited", False))

    # ------------------------------------------------------------------ the reader thread

    def _read_loop(self) -> None:
        try:
            while True:
                h, fds = self._conn.recv_header(idle=self.config.heartbeat_timeout_s)
                if fds:  # a result segment's fd travels beside its SEGMENT, on the channel
                    for fd in fds:
                        os.close(fd)
                    raise ProtocolError(f"the daemon passed file descriptors with {h.type.name}")
                if h.type is MsgType.HEARTBEAT:
                    continue
                elif h.type is MsgType.ERROR:
                    text = self._conn.recv_bytes(h.length, timeout=5.0).decode("utf-8", "replace")
                    kind, why = read_failure(text)
                    err = kind(why)
                    status = exit_status_of(h.aux)
                    if isinstance(err, CollectiveError):
                        err.exit_status = status
                        err.infra = infra_of(h.aux)
                    self._fail(err)
                    return
                else:
                    raise ProtocolError(f"the daemon sent {h.type.name}, which workers do not expect")
        except ConnectionClosed as e:
            if not self._closed:
                hint = " (frozen, overloaded or gone)" if "silent" in str(e) else ""
                self._fail(_daemon_lost(f"rank {self.rank}: lost the node daemon: {e}{hint}"))
        except SmddpError as e:
            self._distrust(e)
        except Exception as e:  # a bug; never leave waiters hanging
            log.exception("smddp client reader crashed")
            self._fail(CollectiveError(f"rank {self.rank}: internal error in the client: {e!r}"))

    def _done_loop(self) -> None:
        """The collected collectives (callbacks or polls wait for them, maybe nobody ever waits), from
        the done ring: the engine completes each whose DONE this thread takes, and it finishes here."""
        channel = self._channel
        try:
            while not self._closed:
                got = channel.pop(0.5, 0.0)  # a wait (the engine's finish) takes the ring from us
                if got is not None:
                    self._taken(got)
                native = self._native
                if native is not None and (failed_native := native.take_failure()) is not None:
                    self._native_failed(*failed_native)
                engine = self._device_engine
                if engine is not None:
                    for note in engine.reap():  # (and what landed copies back held goes)
                        log.warning("rank %d: %s", self.rank, note)
                    failed = engine.failure() if self._failure is None else None
                    if failed is not None:  # a device copy the engine watched failed, or the daemon's ring
                        kind, why = failed
                        self._device_failed(
                            DeviceError(f"rank {self.rank}: {why}") if kind == 1 else TransportError(why)
                        )
        except SmddpError as e:
            self._distrust(e)
        except Exception as e:  # a bug; never leave waiters hanging
            log.exception("smddp client done-ring thread crashed")
            self._fail(CollectiveError(f"rank {self.rank}: internal error in the client: {e!r}"))

    def _native_failed(self, error_class: str, why: str) -> None:
        """What a native front end's start or wait met that fails the client (native_api): the
        daemon lost (its ring left full), or a frame or ring it broke, as the Python calls fail it."""
        if error_class == "PeerLostError":
            self._fail(_daemon_lost(why))
        else:
            self._distrust(ProtocolError(why))

    def _distrust(self, e: SmddpError) -> None:
        """A frame we cannot trust: fail here, and hang up so the daemon fails the job for everyone."""
        self._fail(e if isinstance(e, CollectiveError) else CollectiveError(f"rank {self.rank}: {e}"))
        self._conn.hang_up()  # (closed at shutdown, once the reader has left it)

    def _taken(self, got: _engine.Completed | _engine.Unmatched) -> None:
        """What the DONE thread's pop of the done ring gave: a collected collective the engine completed
        (a device one's with where its result lies). A DONE itself (Unmatched) never comes here but for a
        collective this rank does not have (the daemon's fault)."""
        match got:
            case _engine.Completed(seq, error):
                self._on_engine_done(seq, error)
            case _engine.Unmatched(header):
                seq = decode_header(header).seq
                raise ProtocolError(f"DONE for collective #{seq} does not match anything this rank submitted")

    def _on_engine_done(self, seq: int, error: str | None = None) -> None:
        """A collected collective completed by the engine in a pop (a host one's result in place and its
        RELEASE held or sent; a device one's copy back enqueued, or `error`, why it could not be): its
        input slot goes back and its handle finishes here (callbacks included)."""
        with self._lock:
            handle = self._handles.pop(seq, None)
        if handle is None and (self._failure is not None or self._closed):
            return  # the failure finished it meanwhile (its memory is the channel's to keep until now)
        if not isinstance(handle, EngineHandle):
            raise ProtocolError(f"the engine completed collective #{seq}, which this rank did not collect")
        if handle._slot is not None:
            self._arena.free(handle._slot)
        if error is not None:
            self._device_failed(DeviceError(error))
            handle._finish(error=self._failure)
            return
        handle._finish(handle._value)

    def _send_frames(self, parts: list[bytes], timeout: float) -> None:
        """SUBMIT and BYE headers onto the submit ring, in order (the channel sends held RELEASEs first)."""
        for part in parts:
            try:
                self._channel.push(part, timeout, RING_SPIN_US)
            except TimeoutError:
                raise ConnectionClosed(
                    f"the daemon did not read this worker's ring for {timeout:g}s (frozen or gone)"
                ) from None

    def _spans(self, seq: int, kind: Kind, dtype: DType, count: int, times: tuple[float, ...]) -> None:
        """One collective's phases on this rank as Chrome trace events: copy in, in flight, copy out."""
        t0, t1, t_done, t_copied = times
        what = {"seq": seq, "what": f"{kind.label}({dtype.label}, count={count})"}
        for name, a, b in (("copy in", t0, t1), ("in flight", t1, t_done), ("copy out", t_done, t_copied)):
            self._timeline.append(span(f"#{seq} {name}", a, b, f"rank {self.rank}", name, what))

    def _write_timeline(self) -> None:
        if not self.config.timeline_dir:
            return
        # Every collective's phases are the channel's (the engine's records, the device ones included).
        traces, dropped = self._channel.take_traces()
        for t in traces:
            self._spans(
                t.seq, Kind(t.kind), DType(t.dtype), t.elements, (t.start, t.submitted, t.done, t.copied)
            )
        if dropped:
            log.warning(
                "rank %d: the timeline kept the first %d collectives of the engine's and not the %d after them",
                self.rank, len(traces), dropped,
            )  # fmt: skip
        self._timeline.sort(key=lambda e: e["ts"])
        try:
            with open(os.path.join(self.config.timeline_dir, f"rank{self.rank}.json"), "w") as f:
                json.dump(self._timeline, f)
        except OSError as e:
            log.warning("rank %d: could not write the timeline: %s", self.rank, e)

    def _fail(self, err: SmddpError) -> None:
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = err
            handles = list(self._handles.values())
            self._handles.clear()
            self._held_cv.notify_all()
        self._channel.abort()
        for h in handles:
            h._finish(error=self._failure)
        for h in self._channel.live():  # the engine's asynchronous ones nobody collected
            h._finish(error=self._failure)
        native = self._native
        if native is not None and self._failure is not None:  # the native front ends' works too
            native.fail_all(type(self._failure).__name__, str(self._failure))
        status = getattr(err, "exit_status", None)
        if first and status is not None and self._wrapper is not None:
            self._wrapper.cause(status)
        if first and getattr(err, "infra", False) and self._wrapper is not None:
            self._wrapper.infra(str(err))


def _refuse_capture(engine: _engine.DeviceEngine, device: int, *streams: int | None) -> None:
    """GraphCaptureError, before anything is enqueued or sent, where a device collective's stream is
    capturing a CUDA graph: its copies are waited for by the host (the sums are the daemons'), which
    a capture cannot hold, and under capture they would be recorded and never run, so its SUBMIT
    would wait for a copy that never comes. Issue it outside the captured region (before or after
    the graph's launch)."""
    for s in streams:
        if s is not None and engine.capturing(device, s):
            raise GraphCaptureError(
                f"a device collective on stream {s:#x} of cuda:{device}, which is capturing a CUDA graph: "
                "smddp's collectives cannot be captured (their copies are waited for by the host); issue "
                "it outside torch.cuda.graph() / stream capture"
            )


def _in_line(producer: int | None, explicit: int | None, exported: bool) -> int | None:
    """Where a device collective's copies may run in line for a caller that waits for it at once: on
    `producer`, the stream its work on the buffers is queued on (the one passed, the buffer's, or its
    library's current one). None where they may not: no stream is known, or a DLPack export
    (`exported`) made the copy-in lane wait for its library's current stream while `stream=`
    (`explicit`) names another, so a copy in line on that one alone would not wait for the
    producer's work."""
    if producer is None or (exported and explicit is not None):
        return None
    return producer


def _daemon_lost(why: str) -> PeerLostError:
    """This worker lost its own daemon (gone, silent, or not reading its ring): an infrastructure
    cause, which the worker's wrapper reports to smddp-launch (the daemon cannot)."""
    err = PeerLostError(why)
    err.infra = True
    return err


def _configure_logging(level: str, rank: int, node: int) -> None:
    """smddp's own log lines on a worker: one per event, rank and node in front, at SMDDP_LOG_LEVEL.

    Only the "smddp" logger is touched, never the application's root logger.
    """
    logger = logging.getLogger("smddp")
    try:
        logger.setLevel(level.upper())
    except ValueError:
        logger.setLevel(logging.WARNING)
    if not any(getattr(h, "_smddp", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[smddp rank {rank} node {node} %(levelname)s] %(message)s"))
        handler._smddp = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False


def _result_bytes(kind: Kind, nbytes: int, world: int) -> int:
    return nbytes * world if kind == Kind.ALLGATHER else nbytes


def check_op(op: Any) -> ReduceOp:
    if type(op) is ReduceOp:  # smddp.SUM and the others: no Enum lookup on every call
        return op
    try:
        return ReduceOp(op)
    except ValueError:
        raise InvalidArgumentError(f"op must be one of smddp.SUM, AVG, MIN, MAX, got {op!r}") from None


class WrapperPipe:
    """The pipe smddp-launch's wrapper of this worker listens on (SMDDP_JOINED_FD): "j" once the
    worker joined (the wrapper reports EXITED for ranks that did not), "c<status>" when the job
    failed because another rank ended with that exit status (the wrapper then ends with it too), and
    "i<why>" when it failed for an infrastructure cause (the wrapper tells smddp-launch's ledger).
    The fd is taken out of the environment and never inherited by programs the script runs."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    @classmethod
    def open(cls, env: Mapping[str, str]) -> WrapperPipe | None:
        fd_s, _, ino_s = env.get("SMDDP_JOINED_FD", "").partition(":")
        os.environ.pop("SMDDP_JOINED_FD", None)
        if not (fd_s.isdigit() and ino_s.isdigit()):
            return None
        fd = int(fd_s)
        try:
            # Only the pipe the wrapper made: the script may have closed that fd number and reused it.
            st = os.fstat(fd)
            if not (stat.S_ISFIFO(st.st_mode) and st.st_ino == int(ino_s)):
                return None
            os.set_inheritable(fd, False)
        except OSError:
            return None  # gone: the wrapper then says EXITED for a rank that joined, which the daemon ignores
        pipe = cls(fd)
        pipe._write(b"j")
        return pipe

    def cause(self, exit_status: int) -> None:
        self._write(b"c%d\n" % exit_status)

    def infra(self, why: str) -> None:
        """The job failed for an infrastructure cause this worker saw (its daemon lost): the wrapper
        tells smddp-launch, which restarts for such a cause (its daemon may be unable to say)."""
        self._write(b"i" + " ".join(why.split()).encode("utf-8", "replace")[:300] + b"\n")

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self._fd < 0:
                return
            try:
                os.write(self._fd, data)
            except OSError:
                os.close(self._fd)  # the wrapper is gone
                self._fd = -1
