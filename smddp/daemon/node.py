"""The node daemon: serves its local workers over shared memory and is server shard `node` for the job."""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from smddp import _engine
from smddp.daemon.config import DaemonConfig
from smddp.daemon.kernels import Reducer
from smddp.daemon.stats import Stats
from smddp.errors import (
    AuthenticationError,
    CollectiveError,
    CollectiveMismatchError,
    PeerLostError,
    ProtocolError,
    SmddpError,
)
from smddp.proto import handshake as hs
from smddp.proto.dtypes import DType, Kind, ReduceOp
from smddp.proto.failure import exit_status_of, failure_frame, read_failure
from smddp.proto.frames import HEADER_SIZE, Header, MsgType, Role, error_frame
from smddp.proto.layout import Chunk
from smddp.proto.messages import (
    Attach,
    Bye,
    Channel,
    Data,
    Done,
    Exited,
    Heartbeat,
    Report,
    SegmentMsg,
    StatusRequest,
    Submit,
)
from smddp.settings import uses_engine
from smddp.trace import span
from smddp.transport.auth import client_handshake
from smddp.transport.bootstrap import Job
from smddp.transport.conn import Connection, ConnectionClosed
from smddp.transport.shm import Arena, Segment, Slot

NO_SEGMENT = 2**32 - 1  # SUBMIT without data (a broadcast's non-root ranks)
MAX_HANDSHAKES = 64  # unauthenticated connections being served at once

log = logging.getLogger("smddp.daemon")


def describe(kind: Kind, dtype: DType, count: int, op: ReduceOp | None, root: int) -> str:
    """How a collective's fingerprint reads in an error message."""
    extra = f", op={op.name.lower()}" if op is not None else ""
    if kind == Kind.BROADCAST:
        extra = f", root={root}"
    elif kind == Kind.ALLREDUCE and root:
        extra += f", one of {root} pieces"  # a large buffer pipelined as `root` all-reduces
    return f"{kind.label}({dtype.label}, count={count}{extra})"


@dataclass
class WorkerLink:
    local_rank: int
    rank: int
    conn: Connection
    pid: int
    segments: dict[int, Segment] = field(default_factory=dict)
    said_bye: bool = False
    channel: bool = False  # its SUBMIT, RELEASE and BYE come on the engine's ring (CHANNEL)
    told: set[int] = field(default_factory=set)  # result segments it was sent


@dataclass
class PeerLink:
    node: int
    conn: Connection | None = None
    sendq: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    connected: threading.Event = field(default_factory=threading.Event)
    said_bye: bool = False
    # Frames queued and not yet sent by the writer; a small frame may skip the queue only when none
    # are (so frames never overtake queued ones: BYE stays last).
    backlog: int = 0
    qlock: threading.Lock = field(default_factory=threading.Lock)

    def enqueue(self, item: tuple | None) -> None:
        with self.qlock:
            self.backlog += 1
            self.sendq.put(item)


# Collectives of at most this many bytes are reduced on the thread that receives their last input.
INLINE_BYTES = 64 << 10
# Frames of at most this many payload bytes are sent by the thread that makes them, when the peer's
# writer is idle; larger ones always go through the writer (a long send must not hold up a reader).
DIRECT_BYTES = 64 << 10
# A worker that hung up without BYE: how long to wait for its wrapper's EXITED (its exit status, the
# cause's status every rank's wrapper then ends with) before failing the job without it. The wrapper
# has the report ready when its worker exits, so it comes within milliseconds unless it died too.
EXIT_REPORT_WAIT_S = 1.0
# The engine plane's worker threads spin this long for the next descriptor before they sleep.
PLANE_SPIN_US = 20.0
# A SUBMIT on a ring that names a segment whose ATTACH (on the socket) has not been read yet waits this long.
PLANE_ATTACH_WAIT_S = 10.0


class OpState:
    """One collective as this daemon sees it, from the first frame that mentions it to the last RELEASE."""

    def __init__(
        self,
        seq: int,
        kind: Kind,
        dtype: DType,
        count: int,
        op: ReduceOp | None,
        root: int,
        sm: _engine.Collective,
    ):
        self.seq = seq
        self.kind = kind
        self.dtype = dtype
        self.count = count
        self.op = op
        self.root = root
        # Layout, arrivals, completion and release: the engine's state machine (smddp/engine/collective.h),
        # which checks every chunk a frame claims before this daemon touches memory for it.
        self.sm = sm
        self.result_slot: Slot | None = None
        self.result: np.ndarray = np.empty(0, np.uint8)
        self.server_slot: Slot | None = None
        self.server: np.ndarray | None = None  # (nnodes, own range) partials, node order
        self.own_start = sm.own_range[0]
        self.inputs: list[np.ndarray | None] = []
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.phases: dict[str, list[float]] = {}  # phase -> [first start, last end], wall clock
        self.traced = False  # set when the job writes a timeline

    def phase(self, name: str, start: float, end: float) -> None:
        """Widen a phase of this collective to cover [start, end] (threads race benignly here)."""
        if not self.traced:
            return  # no timeline asked for: keep the hot path free of it
        span = self.phases.get(name)
        if span is None:
            self.phases[name] = [start, end]
        else:
            span[0] = min(span[0], start)
            span[1] = max(span[1], end)

    def trace_events(self, process: str, pid: int) -> list[dict]:
        """Chrome trace events: one lane per phase, one box per collective."""
        args = {"seq": self.seq, "what": self.describe()}
        return [
            span(f"#{self.seq} {name}", start, end, process, name, args)
            for name, (start, end) in self.phases.items()
        ]

    @property
    def done(self) -> bool:
        return self.sm.done

    @property
    def replicated(self) -> bool:
        """A small all-reduce: every node serves the whole buffer."""
        return self.sm.replicated

    @property
    def own_in_input(self) -> bool:
        """One worker on this node and a type reduced in place: its input is the node partial as it
        is, so the sharded path reads and sends it from the worker's slot instead of copying it."""
        return self.sm.own_in_input

    def describe(self) -> str:
        return describe(self.kind, self.dtype, self.count, self.op, self.root)


class NodeDaemon:
    """Daemon for node `node` of `job`: accepts workers on `unix_sock` and peers on `tcp_sock`."""

    def __init__(
        self,
        cfg: DaemonConfig,
        job: Job,
        node: int,
        tcp_sock: socket.socket,
        unix_sock: socket.socket,
        socket_dir: str,
    ) -> None:
        self.cfg = cfg
        self.job = job
        self.node = node
        self.nnodes = job.nnodes
        self.local_size = job.local_size
        self.world = job.size
        self.me = job.describe_node(node)
        # Every frame names its sender in case of error: format those names once, not per frame.
        self._rank_names = [job.describe_rank(r) for r in range(job.size)]
        self._node_names = [job.describe_node(j) for j in range(job.nnodes)]
        self.tcp_sock = tcp_sock
        self.unix_sock = unix_sock
        self.socket_dir = socket_dir
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = threading.Event()
        self.failure: str | None = None
        self._failure_frame: bytes | None = None  # the ERROR every local rank gets, late joiners too
        # The collectives in flight and the job-wide rules around them (fingerprints, sequence order,
        # ranks and nodes that left): the engine's table (smddp/engine/node_state.h). self.ops holds
        # this daemon's memory for each of them, created and dropped with the table's entries.
        self.table = _engine.NodeState(
            node,
            self.nnodes,
            self.local_size,
            self.world,
            cfg.chunk_bytes,
            cfg.replicate_bytes,
            self._node_names,
            [job.describe_rank(r) for r in job.ranks_of(node)],
        )
        self.ops: dict[int, OpState] = {}
        self.workers: list[WorkerLink | None] = [None] * self.local_size
        # Exit statuses of local ranks that joined and then ended badly (their wrapper's EXITED).
        self._exit_status: list[int | None] = [None] * self.local_size
        self._exit_reported = [threading.Event() for _ in range(self.local_size)]
        self.peers = {j: PeerLink(j) for j in range(self.nnodes) if j != node}
        self.results = Arena(cfg.result_segment_bytes, f"smddp-result-n{node}")
        self.scratch = Arena(cfg.result_segment_bytes, f"smddp-server-n{node}")
        # The engine data plane (--data-plane engine): the workers' rings, the reductions, the shard
        # exchange with the other daemons and DONE in the engine's own threads
        # (smddp/engine/local_plane.h). The table above then goes unused: the plane keeps its own,
        # and `rules` is whichever is in use.
        self.plane: _engine.LocalPlane | None = None
        self.rules: _engine.NodeState | _engine.LocalPlane = self.table
        if uses_engine(cfg.data_plane):
            self.plane = self.rules = _engine.LocalPlane(
                node,
                self.local_size,
                cfg.chunk_bytes,
                [job.describe_rank(r) for r in job.ranks_of(node)],
                self.me,
                self.results.native,
                PLANE_SPIN_US,
                cfg.heartbeat_timeout_s,
                PLANE_ATTACH_WAIT_S,
                cfg.threads,
                nnodes=self.nnodes,
                world=self.world,
                first_rank=job.ranks_of(node).start,
                replicate_bytes=cfg.replicate_bytes,
                node_names=self._node_names,
                scratch=self.scratch.native,
                heartbeat_s=cfg.heartbeat_timeout_s,
                trace=bool(cfg.timeline_dir),
            )
        # The plane carries the frames between daemons too: peers' links are handed to it.
        self._peer_plane = self.plane if self.nnodes > 1 else None
        self._plane_counted = (0, 0, 0.0)  # the plane's counters already in self.stats
        self._plane_peer_counted: dict[int, tuple[int, int]] = {}  # node -> bytes in, out in self.stats
        self._plane_queued: dict[int, int] = {}  # node -> frames queued to it, as last counted
        self._plane_count_lock = threading.Lock()
        self._tasks: collections.deque = collections.deque()  # server-side work first
        self._local_tasks: collections.deque = collections.deque()
        self._task_cv = threading.Condition(threading.Lock())
        self._threads: list[threading.Thread] = []
        self._started = time.monotonic()
        self._bye_sent_at: float | None = None
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.stats = Stats()
        self._reports: dict[int, dict[int, dict]] = {}  # request id -> node -> that daemon's report
        self._report_cv = threading.Condition(threading.Lock())
        self._next_request = 1
        self._stall_warned: dict[int, float] = {}  # seq -> when we last warned about it
        self.timeline: list[dict] = []  # Chrome trace events, written at exit when enabled
        self.reduce_kernel = Reducer(cfg.reduce_kernel).kernel  # what `smddp status` shows
        self._tls = threading.local()  # a Reducer per reader thread that runs small work inline

    # ------------------------------------------------------------------ lifecycle

    def serve(self) -> int:
        """Run until every local worker said BYE and every peer did too, or the job failed."""
        self._spawn(self._accept_loop, self.unix_sock, self._serve_worker, name="accept-unix")
        self._spawn(self._accept_loop, self.tcp_sock, self._serve_peer_accepted, name="accept-tcp")
        for j in self.peers:
            if self._peer_plane is None:
                self._spawn(self._writer_loop, self.peers[j], name=f"writer-{j}")
            if j < self.node:
                self._spawn(self._connect_peer, j, name=f"connect-{j}")
        if self.plane is None:
            for i in range(self.cfg.threads):
                self._spawn(self._compute_loop, name=f"compute-{i}")
        if self.plane is not None:
            self._spawn(self._plane_loop, self.plane, name="plane-events")
        self._spawn(self._heartbeat_loop, name="heartbeat")
        deadline = self._started + self.cfg.connect_timeout_s
        last_tick = 0.0
        while not self._finished.wait(0.2):
            now = time.monotonic()
            if now - last_tick >= 1.0:
                last_tick = now
                self.count_plane()
                self.stats.sample()
                self._inspect_stalls(now)
            if time.monotonic() > deadline and not self._all_connected():
                self.fail(self._missing_message(), PeerLostError)
            bye = self._bye_sent_at
            if bye is not None and time.monotonic() > bye + self.cfg.shutdown_timeout_s:
                waiting = [self.job.describe_node(j) for j, p in self.peers.items() if not p.said_bye]
                self.fail(f"{self.me}: finished, but {', '.join(waiting)} did not finish", PeerLostError)
        # A failure before every local rank came: keep the door open for the late ones (until the
        # connect deadline), so that each hears why instead of waiting for a daemon that has gone.
        while not self._all_connected() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._teardown()

    def _all_connected(self) -> bool:
        """Whether every local rank and peer has connected (a rank may instead have been reported
        gone before it could: EXITED)."""
        with self._lock:
            return all(w is not None or self.rules.left_early(i) for i, w in enumerate(self.workers)) and all(
                p.connected.is_set() for p in self.peers.values()
            )

    def _missing_message(self) -> str:
        missing = [
            self.job.describe_rank(self.job.ranks_of(self.node)[i])
            for i, w in enumerate(self.workers)
            if w is None and not self.rules.left_early(i)
        ]
        missing += [self.job.describe_node(j) for j, p in self.peers.items() if not p.connected.is_set()]
        return f"{self.me}: not connected after {self.cfg.connect_timeout_s:.0f}s: {', '.join(missing)}"

    def _teardown(self) -> int:
        self._stop.set()
        with self._task_cv:
            self._task_cv.notify_all()
        for p in self.peers.values():
            p.enqueue(None)
        for t in self._threads:
            if t.name.startswith("smddp-writer"):
                t.join(timeout=5.0)  # the BYE frames leave before the sockets close
        if self._peer_plane is not None:
            self._peer_plane.flush(5.0)  # the same on the engine's links
        for s in (self.tcp_sock, self.unix_sock):
            try:
                s.close()
            except OSError:
                pass
        lingering = False
        if self.failure is not None:
            # Our workers heard why; give them time to act on it (report, save, exit) before mpirun
            # would tear everything down on our exit. The job's exit status is then theirs.
            deadline = time.monotonic() + self.cfg.failure_linger_s
            while any(w is not None and not w.conn.closed for w in self.workers):
                if time.monotonic() > deadline:
                    lingering = True
                    break
                time.sleep(0.05)
        for w in self.workers:
            if w is not None:
                w.conn.close()
        for p in self.peers.values():
            if p.conn is not None:
                p.conn.close()
        if self.plane is not None:
            self.plane.close()  # its threads end before the memory they use goes
        for t in self._threads:
            t.join(timeout=2.0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        try:
            self.write_timeline()
        except OSError as e:
            log.warning("%s: could not write the timeline: %s", self.me, e)
        self.results.close()
        self.scratch.close()
        # A failed job whose workers all left exits 0: the workers' own exit statuses tell the story.
        return 1 if lingering else 0

    def _spawn(self, fn, *args, name: str) -> None:  # type: ignore[no-untyped-def]
        def guarded() -> None:
            try:
                fn(*args)
            except SmddpError as e:
                self.fail(str(e), type(e))
            except Exception as e:  # a bug: fail the job loudly rather than hang it
                log.exception("%s: internal error in %s", self.me, name)
                self.fail(f"{self.me}: internal error in {name}: {e!r}", CollectiveError)

        t = threading.Thread(target=guarded, name=f"smddp-{name}", daemon=True)
        self._threads.append(t)
        t.start()

    def fail(
        self, reason: str, kind: type[SmddpError] = CollectiveError, exit_status: int | None = None
    ) -> None:
        """Put the job in FAILED: tell every worker and peer why (and the exit status of the rank whose
        end caused it, when known), once, then stop."""
        frame = failure_frame(kind, reason, sender=self.node, exit_status=exit_status)
        with self._lock:
            if self.failure is not None or self._finished.is_set():
                return
            self.failure = reason
            self._failure_frame = frame
            if self.plane is not None:
                self.plane.abort()
            # Every local rank and peer hears it once: those connected now here, later ones when
            # they connect (_serve_worker, _peer_loop, _adopt_peer).
            told = list(self.workers)
            told_peers = [p for p in self.peers.values() if p.conn is not None]
        self.stats.error("failed", reason)
        log.error("%s: job failed: %s", self.me, reason)
        for w in told:
            if w is not None and not w.said_bye:
                _tell(w.conn, frame)
        for p in told_peers:
            if self._peer_plane is not None:
                self._to_peer(p, frame[:HEADER_SIZE], frame[HEADER_SIZE:])
            elif p.conn is not None and not p.conn.closed:
                _tell(p.conn, frame)
        self._finished.set()

    # ------------------------------------------------------------------ accepting

    def _accept_loop(self, lsock: socket.socket, handler) -> None:  # type: ignore[no-untyped-def]
        """Accept and authenticate in a thread per connection, at most MAX_HANDSHAKES at a time.

        A flood of strangers is refused at the door instead of costing a thread each.
        """
        lsock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                sock, addr = lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and addr else "local process"
            if not self._handshakes.acquire(blocking=False):
                log.warning("%s: refused connection from %s: too many handshakes in progress", self.me, peer)
                sock.close()
                continue
            t = threading.Thread(target=self._handle_accepted, args=(sock, peer, handler), daemon=True)
            t.start()

    def _handle_accepted(self, sock: socket.socket, peer: str, handler) -> None:  # type: ignore[no-untyped-def]
        conn = Connection(sock, f"unauthenticated {peer}")
        try:
            hello = self._authenticate(conn)
        except (SmddpError, OSError) as e:
            self._handshakes.release()
            # A stranger: refuse and log, but the job goes on.
            log.warning("%s: refused connection from %s: %s", self.me, peer, e)
            self.stats.error("refused", f"refused connection from {peer}: {e}")
            try:
                conn.send([error_frame(f"refused: {e}", sender=self.node)], timeout=1.0)
            except SmddpError:
                pass
            conn.close()
            return
        self._handshakes.release()
        try:
            handler(conn, hello)
        except SmddpError as e:
            self.fail(str(e), type(e))
        except Exception as e:
            log.exception("%s: internal error serving %s", self.me, conn.peer)
            self.fail(f"{self.me}: internal error serving {conn.peer}: {e!r}")

    def _authenticate(self, conn: Connection) -> hs.Hello:
        if conn.is_unix and conn.peer_uid() != os.getuid():
            raise AuthenticationError(f"uid {conn.peer_uid()} is not the job's user")
        nonce = hs.new_nonce()
        conn.send([hs.challenge(self.job.job_id, nonce, self.node)], timeout=self.cfg.handshake_timeout_s)
        h, body, fds = conn.recv_frame(timeout=self.cfg.handshake_timeout_s, max_length=hs.HELLO_SIZE)
        for fd in fds:
            os.close(fd)
        hello = hs.parse_hello(h, body)
        hs.verify_hello(self.job.secret, self.job.job_id, nonce, hello)
        allowed = (Role.WORKER, Role.CONTROL) if conn.is_unix else (Role.DAEMON,)
        if hello.role not in allowed:
            raise AuthenticationError(f"role {hello.role.name} is not accepted on this socket")
        conn.send([hs.welcome(self.job.secret, self.job.job_id, nonce, hello, self.node)], timeout=5.0)
        return hello

    # ------------------------------------------------------------------ workers

    def _serve_worker(self, conn: Connection, hello: hs.Hello) -> None:
        if hello.role == Role.CONTROL:
            self._serve_control(conn)
            return
        ranks = self.job.ranks_of(self.node)
        if hello.rank not in ranks:
            raise AuthenticationError(f"rank {hello.rank} does not belong to {self.me}")
        local = hello.rank - ranks.start
        pid = conn.peer_pid()
        conn.peer = self.job.describe_rank(hello.rank, pid)
        link = WorkerLink(local, hello.rank, conn, pid)
        with self._lock:
            if self.workers[local] is not None:
                raise AuthenticationError(f"rank {hello.rank} connected twice")
            if self.rules.left_early(local):
                raise AuthenticationError(f"rank {hello.rank} connected after its process was reported gone")
            self.workers[local] = link
            self._rank_names[hello.rank] = conn.peer
            self.rules.name_rank(local, conn.peer)
            failed = self._failure_frame
            # Everything already in the result arena, so DONE can point anywhere in it.
            for seg in self.results.segments.values():
                self._send_segment(link, seg)
        log.info("%s: %s connected", self.me, conn.peer)
        if failed is not None:
            # The job failed before this rank came: say why at once, then wait for it to leave.
            _tell(conn, failed)
            self._drain(conn)
            conn.close()
            return
        try:
            self._worker_loop(link)
        except ConnectionClosed:
            if link.channel and self.plane is not None and self.plane.remove_worker(local):
                # Its ring said BYE (handled in order after everything before it), then it hung up.
                link.said_bye = True
                self._maybe_finish()
            if not (link.said_bye or self._finished.is_set()):
                reason = self._worker_lost(link)
                status = self._await_exit_status(link.local_rank)
                if status is not None:
                    how = f"killed by signal {status - 128}" if status > 128 else f"exit status {status}"
                    reason += f" ({how})"
                self.fail(reason, PeerLostError, exit_status=status)
        except SmddpError as e:
            # Keep the connection open until the worker leaves, so that it reads the ERROR rather
            # than a broken pipe (teardown closes it at the end of the linger time regardless).
            self.fail(str(e), type(e))
            self._drain(conn)
        if link.channel and self.plane is not None:
            self.plane.remove_worker(local)
        conn.close()

    def _drain(self, conn: Connection) -> None:
        """Read and drop whatever a worker of a failed job still sends, until it hangs up."""
        while True:
            try:
                h, fds = conn.recv_header()
                for fd in fds:
                    os.close(fd)
                conn.discard(h.length, timeout=5.0)
            except SmddpError:
                return

    def _worker_lost(self, link: WorkerLink) -> str:
        return f"{self.job.describe_rank(link.rank, link.pid)} {_process_fate(link.pid)}"

    def _await_exit_status(self, local: int) -> int | None:
        """The exit status the wrapper of local rank `local` reports, waited for a moment; None if none."""
        self._exit_reported[local].wait(EXIT_REPORT_WAIT_S)
        return self._exit_status[local]

    def _on_exited(self, rank: int, status: int) -> None:
        """The launcher's wrapper of local `rank` says its process ended with `status`.

        A rank that never joined is gone for good: any collective that needs it fails now, naming
        it as a lost rank, and a node whose ranks all left (or never came) finishes as after BYE.
        A rank that joined and ended badly is named by its connection's end; its status is recorded
        for the failure (the cause's exit status, which every rank's wrapper then ends with).
        """
        ranks = self.job.ranks_of(self.node)
        if rank not in ranks:
            raise ProtocolError(f"EXITED for rank {rank}, which does not belong to {self.me}")
        local = rank - ranks.start
        if self.workers[local] is not None:
            self._exit_status[local] = status
            self._exit_reported[local].set()
            return
        how = f"was killed by signal {status - 128}" if status > 128 else f"exited with status {status}"
        reason = (
            f"{self.job.describe_rank(rank)} {how} without joining the job (it never called smddp.init(), "
            "or failed before it)"
        )
        try:
            with self._lock:
                recorded = self.rules.rank_left_early(local, self.workers[local] is not None, reason)
        except PeerLostError as e:  # a collective in flight waits for it, and never gets it
            log.info("%s: %s", self.me, reason)
            self.fail(str(e), PeerLostError)
            return
        if recorded:
            log.info("%s: %s", self.me, reason)
            self._maybe_finish()

    def _send_segment(self, link: WorkerLink, seg: Segment) -> None:
        """Tell a worker of a result segment, once (lock held)."""
        if seg.id in link.told:
            return
        link.told.add(seg.id)
        header = SegmentMsg(self.node, seg.id, seg.size).header().encode()
        self._to_worker(link, [header], fds=[seg.fd])

    def _to_worker(self, link: WorkerLink, parts: list[bytes], fds: list[int] | None = None) -> None:
        """Send to a local worker; a broken connection means that worker is lost, and says so.

        Turning ConnectionClosed into the worker's PeerLostError here matters: this runs on peer
        reader threads too, whose handlers would otherwise blame the peer daemon.
        """
        try:
            link.conn.send(parts, fds or (), idle=self.cfg.heartbeat_timeout_s)
        except ConnectionClosed:
            raise PeerLostError(self._worker_lost(link)) from None

    def _worker_loop(self, link: WorkerLink) -> None:
        conn = link.conn
        while True:
            # No stop flag: a worker's connection stays up through a failure until the worker leaves.
            h, fds = conn.recv_header()
            if h.sender != link.rank:
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"{conn.peer} sent a frame claiming to be rank {h.sender}")
            if fds and h.type not in (MsgType.ATTACH, MsgType.CHANNEL):
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"{conn.peer} passed file descriptors with {h.type.name}")
            if link.channel and h.type in (MsgType.SUBMIT, MsgType.RELEASE, MsgType.BYE):
                raise ProtocolError(f"{conn.peer} sent {h.type.name} on its socket: its ring carries them")
            if h.type is MsgType.CHANNEL:
                self._on_channel(link, h, fds)
            elif h.type is MsgType.SUBMIT:
                self._on_submit(link, h)
            elif h.type is MsgType.RELEASE:
                self._on_release(link, h)
            elif h.type is MsgType.ATTACH:
                if len(fds) != 1:
                    raise ProtocolError(f"{conn.peer}: ATTACH must carry exactly one fd, got {len(fds)}")
                att = Attach.of(h)
                if att.segment in link.segments:
                    os.close(fds[0])
                    raise ProtocolError(f"{conn.peer}: segment {att.segment} attached twice")
                seg = link.segments[att.segment] = Segment.attach(
                    att.segment, fds[0], att.size, writable=False
                )
                if link.channel and self.plane is not None:
                    self.plane.add_segment(link.local_rank, seg.native)
            elif h.type is MsgType.BYE:
                link.said_bye = True
                conn.close()
                with self._lock:  # raises if a collective still needed this rank (a mismatch)
                    self.table.rank_said_bye(link.local_rank)
                self._maybe_finish()
                return
            elif h.type is MsgType.ERROR:
                text = conn.recv_bytes(h.length, timeout=5.0).decode("utf-8", "replace")
                raise CollectiveError(f"{conn.peer} aborted the job: {text}")
            else:
                raise ProtocolError(f"{conn.peer} sent {h.type.name}, which workers may not send")

    def _on_channel(self, link: WorkerLink, h: Header, fds: list[int]) -> None:
        """The worker's rings (docs/protocol.md, CHANNEL): from now on the engine's plane serves it."""
        if self.plane is None or link.channel or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            why = (
                "this job's daemons move the bytes themselves"
                if self.plane is None
                else "a second one, or no fd"
            )
            raise ProtocolError(f"{link.conn.peer} sent CHANNEL, refused: {why}")
        ch = Channel.of(h)
        if ch.size < _engine.CHANNEL_BYTES:
            os.close(fds[0])
            raise ProtocolError(
                f"{link.conn.peer}: a channel of {ch.size} bytes, {_engine.CHANNEL_BYTES} needed"
            )
        native = _engine.segment_attach(0, fds[0], ch.size, True)
        self.plane.add_worker(link.local_rank, link.rank, link.conn.peer, native)
        link.channel = True

    def _plane_loop(self, plane: _engine.LocalPlane) -> None:
        """The plane's events: result segments its workers must be sent, peers' control frames, and
        the plane's own failure."""
        while not (self._stop.is_set() or self._finished.is_set()):
            ev = plane.next_event(0.5)
            if ev is None:
                continue
            if ev[0] == "segment":
                assert isinstance(ev[1], _engine.Segment)
                with self._lock:
                    seg = self.results.adopt(ev[1])
                    for w in self.workers:
                        if w is not None and not w.said_bye:
                            try:
                                self._send_segment(w, seg)
                            except PeerLostError:
                                pass  # its hang-up is seen by its own thread, which names it
            elif len(ev) == 6:  # ("peer", node, type, seq, aux, payload): a peer's control frame
                _, node, mtype, seq, aux, body = ev
                self._on_peer_control(self.peers[node], MsgType(mtype), seq, aux, body)
            elif len(ev) == 3:
                _, fault, why = ev
                kind: type[SmddpError] = {2: CollectiveMismatchError, 3: PeerLostError}.get(
                    fault, ProtocolError
                )
                self.fail(why, kind)

    def count_plane(self) -> None:
        """Bring what the plane did since the last call into the daemon's statistics."""
        if self.plane is None:
            return
        with self._plane_count_lock:  # the main loop's tick and a status request may come together
            self._count_plane_locked(self.plane)

    def _count_plane_locked(self, plane: _engine.LocalPlane) -> None:
        for kind, dtype, nbytes, seconds in plane.take_completions():
            self.stats.done(Kind(kind).label, DType(dtype).label, nbytes, seconds)
        n, reduced, secs = plane.counters()
        _, reduced0, secs0 = self._plane_counted
        if reduced > reduced0:
            self.stats.add_reduce(reduced - reduced0, secs - secs0)
        self._plane_counted = (n, reduced, secs)
        for node, _up, bytes_in, bytes_out, queued in plane.peer_counters():
            self._plane_queued[node] = queued
            in0, out0 = self._plane_peer_counted.get(node, (0, 0))
            if bytes_in > in0:
                self.stats.add_in(node, bytes_in - in0)
            if bytes_out > out0:
                self.stats.add_out(node, bytes_out - out0)
            self._plane_peer_counted[node] = (bytes_in, bytes_out)
        if self.cfg.timeline_dir:
            process = f"node {self.node} daemon"
            for seq, what, phases in plane.take_traces():
                args = {"seq": seq, "what": what}
                self.timeline.extend(
                    span(f"#{seq} {name}", start, end, process, name, args) for name, start, end in phases
                )

    def _on_submit(self, link: WorkerLink, header: Header) -> None:
        who = self._rank_names[link.rank]
        m = Submit.of(header)
        kind, dtype = m.kind, m.dtype
        nbytes = m.count * dtype.itemsize
        if m.segment == NO_SEGMENT:
            data = np.empty(0, dtype.storage) if nbytes == 0 else None
        else:
            seg = link.segments.get(m.segment)
            if seg is None:
                raise ProtocolError(f"{who} named segment {m.segment}, which it never attached")
            try:
                data = seg.view(m.offset, nbytes).view(dtype.storage)
            except ProtocolError as e:  # named: every rank's error says who sent it
                raise ProtocolError(f"{who} submitted collective #{m.seq} outside its memory: {e}") from None
        if data is None and not (kind == Kind.BROADCAST and m.root != link.rank):
            raise ProtocolError(f"{who} submitted collective #{m.seq} without data")
        tasks: list = []
        with self._lock:
            if self.failure is not None:
                return
            # In sequence order, the same fingerprint as every other sight of it, nobody gone.
            sm, all_in = self.table.submit(
                link.local_rank,
                m.seq,
                kind,
                dtype,
                dtype.itemsize,
                _widened(dtype),
                m.count,
                m.op or 0,
                m.root,
            )
            op = (
                self._new_op(sm, m.seq, kind, dtype, m.count, m.op, m.root)
                if sm is not None
                else self.ops[m.seq]
            )
            op.inputs[link.local_rank] = data if data is not None else np.empty(0, dtype.storage)
            op.phase("wait for local ranks", op.wall0, time.time())
            if all_in:
                tasks = self._local_tasks_for(op)
        if tasks:
            self._dispatch(op, tasks, local=True)

    def _on_release(self, link: WorkerLink, h: Header) -> None:
        with self._lock:
            if self.table.release(link.local_rank, h.seq):
                self._retire(self.ops[h.seq])

    def _retire(self, op: OpState) -> None:
        """Free an op's memory: every worker copied its result out and every send left (lock held)."""
        del self.ops[op.seq]
        if op.server_slot is not None:  # a replicated op: its own partial is sent from there
            self.scratch.free(op.server_slot)
            op.server_slot = None
            op.server = None
        self._stall_warned.pop(op.seq, None)
        if self.cfg.timeline_dir:
            self.timeline.extend(op.trace_events(f"node {self.node} daemon", self.node))
        if op.result_slot is not None:
            self.results.free(op.result_slot)

    # ------------------------------------------------------------------ op state

    def _op_for(
        self, seq: int, kind: Kind, dtype: DType, count: int, rop: ReduceOp | None, root: int, who: str
    ) -> OpState:
        """The state of collective `seq` as a peer's frame names it: created on first sight, else
        checked against its fingerprint by the table (lock held)."""
        sm = self.table.op_for(seq, kind, dtype, dtype.itemsize, _widened(dtype), count, rop or 0, root, who)
        return self.ops[seq] if sm is None else self._new_op(sm, seq, kind, dtype, count, rop, root)

    def _new_op(
        self,
        sm: _engine.Collective,
        seq: int,
        kind: Kind,
        dtype: DType,
        count: int,
        rop: ReduceOp | None,
        root: int,
    ) -> OpState:
        """Memory for a collective the table just created: its server rows and its result (lock held)."""
        op = OpState(seq, kind, dtype, count, rop, root, sm)
        op.inputs = [None] * self.local_size
        op.traced = bool(self.cfg.timeline_dir)
        if sm.server_rows:
            # Every node's partial of the range we serve, one row each (ours too), in node order.
            a, b = sm.own_range
            op.server_slot, _ = self.scratch.alloc(sm.server_rows * (b - a) * dtype.itemsize)
            op.server = self.scratch.view(op.server_slot).view(dtype.storage).reshape(sm.server_rows, b - a)
        total = sm.result_bytes
        op.result_slot, new_seg = self.results.alloc(total)
        if new_seg is not None:
            for w in self.workers:
                if w is not None and not w.said_bye:
                    self._send_segment(w, new_seg)
        op.result = self.results.view(op.result_slot)
        self.ops[seq] = op
        return op

    def _header(self, t: MsgType, op: OpState, shard: int, offset: int, length: int) -> bytes:
        """The header of a PARTIAL, RESULT or BLOCK of `op`: `length` bytes at byte `offset` of `shard`."""
        return (
            Data(t, self.node, op.seq, shard, offset, length, op.root, op.count, op.dtype, op.op, op.kind)
            .header()
            .encode()
        )

    # ------------------------------------------------------------------ scheduling

    def _local_tasks_for(self, op: OpState) -> list:
        """Work that starts once all local ranks submitted, in the engine's order (for a sharded
        reduction every shard's chunks interleaved, the next node's first, so every server starts early)."""
        if op.sm.is_gather:
            # Never empty: every node has a block in a gather collective, if only an empty one.
            return [(self._local_gather, op, a, b) for _, _, a, b in op.sm.local_tasks()]
        return [(self._local_reduce, op, Chunk(*c)) for c in op.sm.local_tasks()]

    def _dispatch(self, op: OpState, tasks: list, local: bool) -> None:
        """Run a small collective's work here, on the thread that made it ready; queue the rest.

        Handing a few KiB to a compute thread costs more (a wake-up, on a busy machine a scheduler
        slice) than reducing them; large work goes to the compute threads, so readers keep reading.
        """
        if op.count * op.dtype.itemsize > INLINE_BYTES:
            self._enqueue(tasks, local)
            return
        reducer = self._thread_reducer()
        for fn, *args in tasks:
            if self.failure is not None:
                return
            fn(reducer, *args)

    def _thread_reducer(self) -> Reducer:
        r = getattr(self._tls, "reducer", None)
        if r is None:
            r = self._tls.reducer = Reducer(self.cfg.reduce_kernel)
        return r

    def _enqueue(self, tasks: list, local: bool) -> None:
        with self._task_cv:
            (self._local_tasks if local else self._tasks).extend(tasks)
            self._task_cv.notify(len(tasks))

    def _compute_loop(self) -> None:
        reducer = Reducer(self.cfg.reduce_kernel)
        while True:
            with self._task_cv:
                while not self._tasks and not self._local_tasks:
                    if self._stop.is_set() or self._finished.is_set():
                        return
                    self._task_cv.wait(0.5)
                task = self._tasks.popleft() if self._tasks else self._local_tasks.popleft()
            if self.failure is not None:
                continue
            fn, *args = task
            fn(reducer, *args)

    # ------------------------------------------------------------------ reduce path

    def _typed(self, op: OpState) -> np.ndarray:
        return op.result.view(op.dtype.storage)

    def _local_reduce(self, reducer: Reducer, op: OpState, c: Chunk) -> None:
        inputs = [x[c.start : c.end] for x in op.inputs if x is not None]
        res = self._typed(op)[c.start : c.end]
        rop = op.op if op.op is not None else ReduceOp.SUM  # a barrier reduces nothing
        t0, w0 = time.perf_counter(), time.time()
        if self.nnodes == 1:
            reducer.reduce(inputs, res, op.dtype, rop, self.world)
            self._reduced(op, "local reduce", inputs, t0, w0)
            self._chunk_completed(op)
            return
        # The node partial of an average is a sum: the server divides once.
        partial_op = ReduceOp.SUM if rop == ReduceOp.AVG else rop
        if op.replicated:
            # Our partial is our own server input and goes to every peer from there; that row is
            # not freed before these sends have left (_maybe_retire).
            assert op.server is not None
            dest = op.server[self.node, c.start : c.end]
            reducer.reduce(inputs, dest, op.dtype, partial_op)
            self._reduced(op, "local reduce", inputs, t0, w0)
            isz = op.dtype.itemsize
            hdr = self._header(MsgType.PARTIAL, op, 0, c.start * isz, c.count * isz)
            for j in self.peers:
                self._send(j, op, hdr, dest)
            self._partial_arrived(op, c.index, self.node)
        elif c.shard == self.node:
            if not op.own_in_input:
                assert op.server is not None
                dest = op.server[self.node, c.start - op.own_start : c.end - op.own_start]
                reducer.reduce(inputs, dest, op.dtype, partial_op)
                self._reduced(op, "local reduce", inputs, t0, w0)
            self._partial_arrived(op, c.index, self.node)
        else:
            isz = op.dtype.itemsize
            hdr = self._header(MsgType.PARTIAL, op, c.shard, c.start * isz, c.count * isz)
            if op.kind == Kind.ALLREDUCE and op.own_in_input:
                # One local input is its own partial: it goes out from the worker's slot, which the
                # worker reuses only after DONE, i.e. after this chunk's RESULT came back from a
                # server that had received all of it. (A reduce_scatter gets no RESULT for this
                # chunk, so its DONE can come before the send has left: it sends a copy.)
                self._send(c.shard, op, hdr, inputs[0])
                return
            # The partial goes out from the result region: the result of this chunk only comes back
            # after the server has it, so nothing overwrites it before the send is done.
            reducer.reduce(inputs, res, op.dtype, partial_op)
            self._reduced(op, "local reduce", inputs, t0, w0)
            self._send(c.shard, op, hdr, res)
            if op.kind == Kind.REDUCE_SCATTER:
                self._chunk_completed(op)  # no RESULT comes back for another node's shard

    def _reduced(self, op: OpState, phase: str, inputs: list[np.ndarray], t0: float, w0: float) -> None:
        self.stats.add_reduce(sum(x.nbytes for x in inputs), time.perf_counter() - t0)
        op.phase(phase, w0, time.time())

    def _partial_arrived(self, op: OpState, index: int, node: int) -> None:
        with self._lock:
            ready = op.sm.partial_arrived(index, node, self._node_names[node])
        if ready:
            self._dispatch(op, [(self._server_reduce, op, Chunk(*op.sm.own_chunk(index)))], local=False)

    def _server_reduce(self, reducer: Reducer, op: OpState, c: Chunk) -> None:
        assert op.server is not None
        lo, hi = c.start - op.own_start, c.end - op.own_start
        res = self._typed(op)[c.start : c.end]
        rop = op.op if op.op is not None else ReduceOp.SUM
        inputs = [op.server[i, lo:hi] for i in range(self.nnodes)]
        if op.own_in_input:
            own = op.inputs[0]
            assert own is not None
            inputs[self.node] = own[c.start : c.end]
        t0, w0 = time.perf_counter(), time.time()
        reducer.reduce(inputs, res, op.dtype, rop, self.world)
        self._reduced(op, "server reduce", inputs, t0, w0)
        if op.kind != Kind.REDUCE_SCATTER and not op.replicated:
            isz = op.dtype.itemsize
            hdr = self._header(MsgType.RESULT, op, self.node, c.start * isz, c.count * isz)
            for j in self.peers:
                self._send(j, op, hdr, res)
        self._chunk_completed(op)

    # ------------------------------------------------------------------ gather path

    def _local_gather(self, reducer: Reducer, op: OpState, a: int, b: int) -> None:
        block = op.sm.own_range
        w0 = time.time()
        if b == a:
            pass  # an empty block still travels: it carries our fingerprint
        elif op.kind == Kind.BROADCAST:
            src = op.inputs[op.root - self.job.ranks_of(self.node).start]
            assert src is not None
            op.result[a:b] = src.view(np.uint8)[a:b]
        else:
            per = op.count * op.dtype.itemsize
            for r, x in enumerate(op.inputs):
                assert x is not None
                s0 = block[0] + r * per
                lo, hi = max(a, s0), min(b, s0 + per)
                if lo < hi:
                    op.result[lo:hi] = x.view(np.uint8)[lo - s0 : hi - s0]
        op.phase("local copy", w0, time.time())
        hdr = self._header(MsgType.BLOCK, op, self.node, a, b - a)
        for j in self.peers:
            self._send(j, op, hdr, op.result[a:b])
        self._chunk_completed(op)

    # ------------------------------------------------------------------ status and stalls

    def _serve_control(self, conn: Connection) -> None:
        """`smddp status`: answer STATUS with every daemon's report until the client says BYE."""
        conn.peer = f"control client (pid {conn.peer_pid()})"
        try:
            while True:
                h, _ = conn.recv_header(self._stop)
                if h.type is MsgType.BYE:
                    return
                if h.type is MsgType.EXITED:
                    gone = Exited.of(h)
                    self._on_exited(gone.rank, gone.status)
                    continue
                if h.type is not MsgType.STATUS:
                    raise ProtocolError(f"{conn.peer} sent {h.type.name}")
                body = json.dumps(self.job_report()).encode()
                conn.send_frame(Report(self.node, 0, len(body)).header(), body, timeout=10.0)
        except SmddpError as e:
            log.info("%s: %s left: %s", self.me, conn.peer, e)  # a status client never fails the job
        finally:
            conn.close()

    def job_report(self, timeout: float = 2.0) -> dict:
        """This daemon's report and every peer's, asked for over the peer connections."""
        with self._report_cv:
            req = self._next_request
            self._next_request += 1
            self._reports[req] = {self.node: self.local_report()}
        ask = StatusRequest(self.node, req).header().encode()
        asked = [p for p in self.peers.values() if p.connected.is_set() and not p.said_bye]
        for p in asked:
            self._to_peer(p, ask)
        deadline = time.monotonic() + timeout
        with self._report_cv:
            while len(self._reports[req]) < 1 + len(asked) and time.monotonic() < deadline:
                self._report_cv.wait(max(0.0, deadline - time.monotonic()))
            got = self._reports.pop(req)
        daemons = []
        for j in range(self.nnodes):
            if j in got:
                daemons.append(got[j])
            else:
                d = self.job.daemons[j]
                daemons.append({"node": j, "host": d.host, "pid": d.pid, "state": "no answer"})
        return {
            "job": self.job.job_hex,
            "nnodes": self.nnodes,
            "world": self.world,
            "attempt": self.cfg.restart_count,
            "daemons": daemons,
        }

    def _routed_counts(self) -> dict[str, int]:
        """Calls the local ranks' front ends sent to their side groups (Client.count_routed files)."""
        total: dict[str, int] = {}
        try:
            names = [
                n for n in os.listdir(self.socket_dir) if n.startswith("routed-") and n.endswith(".json")
            ]
        except OSError:
            return total
        for name in names:
            try:
                with open(os.path.join(self.socket_dir, name)) as f:
                    counts = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(counts, dict):
                for k, v in counts.items():
                    if isinstance(k, str) and isinstance(v, int):
                        total[k] = total.get(k, 0) + v
        return total

    def local_report(self) -> dict:
        """What `smddp status` shows for this daemon (JSON-ready)."""
        self.count_plane()
        now = time.monotonic()
        with self._lock:
            ops = self._in_flight(now)
            workers = [w for w in self.workers if w is not None]
            stalled = [r for r in ops if r["age_s"] > self.cfg.stall_warning_s]
            oldest_info = ops[0] if ops else None
            local_q, server_q = (
                self.plane.queued_tasks() if self.plane else (len(self._local_tasks), len(self._tasks))
            )
        if self.failure is not None:
            state = f"FAILED: {self.failure}"
        elif self._bye_sent_at is not None:
            state = "finishing"
        elif len(workers) < self.local_size or not all(p.connected.is_set() for p in self.peers.values()):
            state = "starting"
        else:
            state = "running"
        snap = self.stats.snapshot()
        d = self.job.daemons[self.node]
        return {
            "routed": self._routed_counts(),
            "node": self.node,
            "host": d.host,
            "pid": os.getpid(),
            "address": f"{d.tcp_host}:{d.tcp_port}",
            "uptime_s": now - self._started,
            "state": state,
            "reduce_kernel": self.reduce_kernel,
            "workers": {
                "connected": len(workers),
                "expected": self.local_size,
                "ranks": [w.rank for w in workers],
            },
            "peers": [
                {
                    "node": j,
                    "host": self.job.daemons[j].host,
                    "connected": p.connected.is_set(),
                    "bytes_in": snap["bytes_in"].get(j, 0),
                    "bytes_out": snap["bytes_out"].get(j, 0),
                    "rate_in": snap["rate_in"].get(j, 0.0),
                    "rate_out": snap["rate_out"].get(j, 0.0),
                    "send_queue": self._plane_queued.get(j, 0) if self._peer_plane else p.sendq.qsize(),
                }
                for j, p in self.peers.items()
            ],
            "collectives": {"done": snap["collectives"], "in_flight": len(ops), "by_kind": snap["by_kind"]},
            "oldest": oldest_info,
            "stalled": stalled,
            "reduction": {
                "bytes": snap["reduce_bytes"],
                "seconds": snap["reduce_seconds"],
                "gbytes_per_s": snap["reduce_bytes"] / snap["reduce_seconds"] / 1e9
                if snap["reduce_seconds"]
                else 0.0,
            },
            "queues": {"local_tasks": local_q, "server_tasks": server_q},
            "latency": snap["latency"],
            "errors": snap["errors"],
            "last_errors": snap["last_errors"],
        }

    def _waiting_for(self, op: OpState) -> list[str]:
        """Who has not yet done their part of `op` (lock held): local ranks, then nodes."""
        ranks = self.job.ranks_of(self.node)
        missing = [self.job.describe_rank(ranks[i]) for i, x in enumerate(op.inputs) if x is None]
        # (Our own partial waits for our own ranks, named above.)
        missing += [self.job.describe_node(j) for j in op.sm.late_nodes()]
        return missing

    def _in_flight(self, now: float) -> list[dict]:
        """The collectives in flight and not done, oldest first: seq, what, age_s, waiting_for (lock held)."""
        if self.plane is not None:
            ranks = self.job.ranks_of(self.node)
            rows = [
                {
                    "seq": seq,
                    "what": what,
                    "age_s": age,
                    "waiting_for": [self.job.describe_rank(ranks[i]) for i in late]
                    + [self.job.describe_node(j) for j in late_nodes],
                }
                for seq, age, what, late, late_nodes in self.plane.waiting()
            ]
        else:
            rows = [
                {
                    "seq": op.seq,
                    "what": op.describe(),
                    "age_s": now - op.t0,
                    "waiting_for": self._waiting_for(op),
                }
                for op in self.ops.values()
                if not op.done
            ]
        return sorted(rows, key=lambda r: -r["age_s"])

    def _inspect_stalls(self, now: float) -> None:
        """Warn about collectives that waited longer than the stall warning time, naming who is late."""
        limit = self.cfg.stall_warning_s
        with self._lock:
            late = [
                r
                for r in self._in_flight(now)
                if r["age_s"] > limit and now - self._stall_warned.get(r["seq"], 0.0) > limit
            ]
            for r in late:
                self._stall_warned[r["seq"]] = now
        for r in late:
            who = r["waiting_for"]
            log.warning(
                "%s: collective #%d %s has waited %.0fs for: %s",
                self.me,
                r["seq"],
                r["what"],
                r["age_s"],
                ", ".join(who) or "(nobody: in progress)",
            )
            self.stats.error("stall", f"collective #{r['seq']} waited {r['age_s']:.0f}s for {', '.join(who)}")

    def write_timeline(self) -> None:
        if not self.cfg.timeline_dir:
            return
        self.count_plane()  # the engine's traces of the last collectives
        path = os.path.join(self.cfg.timeline_dir, f"daemon-n{self.node}.json")
        with open(path, "w") as f:
            json.dump(self.timeline, f)

    # ------------------------------------------------------------------ completion

    def _chunk_completed(self, op: OpState) -> None:
        with self._lock:
            if not op.sm.chunk_completed():
                return
            if op.server_slot is not None and not op.sm.server_live:
                # Every server reduce has run and nothing is sent from the server rows (only a
                # replicated op sends its own row): reuse the space now, not when the op retires,
                # so the next collectives' server buffers land on pages already touched.
                self.scratch.free(op.server_slot)
                op.server_slot = None
                op.server = None
            workers = list(self.workers)
            assert op.result_slot is not None
            slot = op.result_slot
        self.stats.done(op.kind.label, op.dtype.label, op.count * op.dtype.itemsize, time.monotonic() - op.t0)
        done = (
            Done(self.node, op.seq, slot.segment, slot.offset, op.root, op.count, op.dtype, op.op, op.kind)
            .header()
            .encode()
        )
        for w in workers:
            assert w is not None
            self._to_worker(w, [done])

    # ------------------------------------------------------------------ peers

    def _send(self, node: int, op: OpState, hdr: bytes, payload: np.ndarray) -> None:
        with self._lock:
            op.sm.send_started()
        peer = self.peers[node]
        if payload.nbytes <= DIRECT_BYTES and self._send_direct(peer, op, hdr, payload):
            return
        peer.enqueue((hdr, payload, op))

    def _send_direct(self, peer: PeerLink, op: OpState, hdr: bytes, payload: np.ndarray) -> bool:
        """Send a small frame on this thread when the peer's writer has nothing queued and is idle.

        The writer-thread hand-off costs a wake-up per frame, which is most of a small collective's
        time. A failure here is the peer's (named), not that of whoever's thread this is.
        """
        conn = peer.conn
        if conn is None or self.failure is not None:
            return False
        t0 = time.time()
        nbytes = len(hdr) + payload.nbytes
        with peer.qlock:
            # Nothing queued, and the kernel takes the frame at once: this thread never waits on a
            # slow peer (readers that waited on each other's sends could deadlock).
            if peer.backlog or not conn.try_acquire(nbytes):
                return False
        try:
            conn.send_held([hdr, payload], idle=self.cfg.heartbeat_timeout_s)
        except ConnectionClosed as e:
            raise PeerLostError(f"{self.me} lost contact: {e}") from None
        self._sent(peer, op, nbytes, t0)
        return True

    def _sent(self, peer: PeerLink, op: OpState, nbytes: int, t0: float) -> None:
        self.stats.add_out(peer.node, nbytes)
        op.phase("send", t0, time.time())
        with self._lock:
            if self.table.send_finished(op.seq):
                self._retire(op)

    def _writer_loop(self, peer: PeerLink) -> None:
        while not peer.connected.wait(0.5):
            if self._stop.is_set() or self._finished.is_set():
                return
        assert peer.conn is not None
        while True:
            item = peer.sendq.get()
            if item is None:
                return
            hdr, payload, op = item
            if self.failure is not None:
                return
            idle = self.cfg.heartbeat_timeout_s
            try:
                if hdr is None:  # BYE marker: everything before it has left
                    peer.conn.send_frame(Bye(self.node).header(), idle=idle)
                elif op is None:  # a heartbeat, a status request or report
                    peer.conn.send([hdr] if payload is None else [hdr, payload], idle=idle)
                else:
                    t0 = time.time()
                    peer.conn.send([hdr, payload], idle=idle)
                    self._sent(peer, op, len(hdr) + payload.nbytes, t0)
            finally:
                with peer.qlock:
                    peer.backlog -= 1

    def _heartbeat_loop(self) -> None:
        """Every quarter of the heartbeat timeout, tell every peer and worker that we are alive.

        Peers go through the writer queue: behind a large frame the frame itself is the sign of life.
        """
        beat = Heartbeat(self.node).header().encode()
        period = self.cfg.heartbeat_timeout_s / 4
        while not self._finished.wait(period):
            for p in self.peers.values():
                # (The engine's links beat on their own.)
                if self._peer_plane is None and p.connected.is_set() and not p.said_bye:
                    p.enqueue((beat, None, None))
            for w in list(self.workers):
                if w is not None and not w.said_bye and not w.conn.closed:
                    try:
                        w.conn.send([beat], idle=self.cfg.heartbeat_timeout_s)
                    except SmddpError:
                        pass  # its reader notices the broken connection and fails the job

    def _connect_peer(self, j: int) -> None:
        ep = self.job.daemons[j]
        deadline = time.monotonic() + self.cfg.connect_timeout_s
        while True:
            try:
                sock = socket.create_connection((ep.tcp_host, ep.tcp_port), timeout=5.0)
                break
            except OSError as e:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise PeerLostError(
                        f"{self.me} cannot reach {self.job.describe_node(j)} at {ep.tcp_host}:{ep.tcp_port}: {e}"
                    ) from None
                time.sleep(0.1)
        conn = Connection(sock, self.job.describe_node(j))
        client_handshake(
            conn, self.job.secret, self.job.job_id, Role.DAEMON, self.node, self.cfg.handshake_timeout_s
        )
        self._peer_loop(self.peers[j], conn)

    def _serve_peer_accepted(self, conn: Connection, hello: hs.Hello) -> None:
        if hello.role != Role.DAEMON or not (self.node < hello.rank < self.nnodes):
            raise AuthenticationError(f"daemon {hello.rank} should not connect to {self.me}")
        peer = self.peers[hello.rank]
        if peer.connected.is_set():
            raise AuthenticationError(f"{self.job.describe_node(hello.rank)} connected twice")
        conn.peer = self.job.describe_node(hello.rank)
        self._peer_loop(peer, conn)

    def _adopt_peer(self, peer: PeerLink, conn: Connection) -> None:
        """Hand an authenticated peer link to the engine's plane, which reads and writes it from now on."""
        assert self._peer_plane is not None
        with self._lock:
            peer.conn = conn
            failed = self._failure_frame
            self._peer_plane.add_peer(peer.node, conn.sock.detach())
        if failed is not None:
            # The job failed before this peer came: it hears why first, and fails its own ranks.
            self._to_peer(peer, failed[:HEADER_SIZE], failed[HEADER_SIZE:])
        peer.connected.set()
        log.info("%s: connected to %s (engine link)", self.me, conn.peer)

    def _to_peer(self, peer: PeerLink, header: bytes, body: bytes | None = None) -> None:
        """Queue a control frame to a peer behind everything queued to it before."""
        if self._peer_plane is not None:
            self._peer_plane.send_control(peer.node, header, body or b"")
        else:
            peer.enqueue((header, body, None))

    def _on_peer_control(self, peer: PeerLink, t: MsgType, seq: int, aux: int, body: bytes) -> None:
        """A peer's STATUS, REPORT, ERROR or BYE (whole), from either data plane."""
        if t is MsgType.STATUS:
            report = json.dumps(self.local_report()).encode()
            self._to_peer(peer, Report(self.node, seq, len(report)).header().encode(), report)
        elif t is MsgType.REPORT:
            got = json.loads(body)
            with self._report_cv:
                if seq in self._reports:
                    self._reports[seq][peer.node] = got
                    self._report_cv.notify_all()
        elif t is MsgType.ERROR:
            kind, why = read_failure(body.decode("utf-8", "replace"))
            self.fail(why, kind, exit_status=exit_status_of(aux))
        elif t is MsgType.BYE:
            # (The engine's table heard it first: a collective it leaves unfinished failed there.)
            peer.said_bye = True
            self._maybe_finish()

    def _peer_loop(self, peer: PeerLink, conn: Connection) -> None:
        if self._peer_plane is not None:
            self._adopt_peer(peer, conn)
            return
        with self._lock:
            peer.conn = conn
            failed = self._failure_frame
        if failed is not None:
            # The job failed before this peer came: it hears why first (before `connected` lets
            # the teardown close this connection), and fails its own ranks.
            _tell(conn, failed)
        peer.connected.set()
        log.info("%s: connected to %s", self.me, conn.peer)
        try:
            while True:
                h, _ = conn.recv_header(self._stop, idle=self.cfg.heartbeat_timeout_s)
                if h.type in (MsgType.PARTIAL, MsgType.RESULT, MsgType.BLOCK):
                    self._on_data(peer.node, conn, h)
                elif h.type is MsgType.HEARTBEAT:
                    continue
                elif h.type is MsgType.STATUS:
                    self._on_peer_control(peer, h.type, h.seq, h.aux, b"")
                elif h.type is MsgType.REPORT:
                    self._on_peer_control(peer, h.type, h.seq, h.aux, conn.recv_bytes(h.length, timeout=10.0))
                elif h.type is MsgType.BYE:
                    peer.said_bye = True
                    # Its BYE follows all its frames: an op not done here never gets what it lacks.
                    with self._lock:
                        self.table.peer_said_bye(peer.node)
                    self._maybe_finish()
                    return
                elif h.type is MsgType.ERROR:
                    self._on_peer_control(peer, h.type, h.seq, h.aux, conn.recv_bytes(h.length, timeout=5.0))
                    return
                else:
                    raise ProtocolError(f"{conn.peer} sent {h.type.name}, which daemons may not send")
        except ConnectionClosed as e:
            if peer.said_bye or self._finished.is_set():
                return
            hint = " (frozen, or the link is down)" if "silent" in str(e) else ""
            raise PeerLostError(f"{self.me} lost contact: {e}{hint}") from None

    def _on_data(self, node: int, conn: Connection, header: Header) -> None:
        who = self._node_names[node]
        h = Data.of(header)
        if h.sender != node:
            raise ProtocolError(f"{who} sent a frame claiming to be from node {h.sender}")
        with self._lock:
            if self.failure is not None:
                raise ConnectionClosed("job failed")
            op = self._op_for(h.seq, h.kind, h.dtype, h.count, h.op, h.root, who)
            # The engine locates the frame as exactly one chunk it still expects, or refuses it.
            if h.type is MsgType.BLOCK:
                _, a, b = op.sm.locate_block(node, h.offset, h.length, who)
                dest = op.result[a:b]
                index = -1
            elif h.type is MsgType.PARTIAL:
                index, a, b = op.sm.locate_partial(node, h.shard, h.offset, h.length, who, self.me)
                assert op.server is not None  # live while a partial is due (the engine checked)
                dest = op.server[node, a - op.own_start : b - op.own_start]
            else:
                _, a, b = op.sm.locate_result(node, h.shard, h.offset, h.length, who)
                dest = self._typed(op)[a:b]
                index = -1
        t0 = time.time()
        conn.recv_into(dest, idle=self.cfg.heartbeat_timeout_s)
        op.phase("receive", t0, time.time())
        self.stats.add_in(node, HEADER_SIZE + h.length)
        if h.type is MsgType.PARTIAL:
            self._partial_arrived(op, index, node)
        else:
            self._chunk_completed(op)

    def _maybe_finish(self) -> None:
        """After the last local BYE: flush every queue, say BYE; finish when every peer has said it."""
        with self._lock:
            if not self.rules.all_ranks_gone():
                return
            first = self._bye_sent_at is None
            if first:
                self._bye_sent_at = time.monotonic()
        if first:
            for p in self.peers.values():
                if self._peer_plane is not None:
                    self._to_peer(p, Bye(self.node).header().encode())
                else:
                    p.enqueue((None, None, None))
        if all(p.said_bye for p in self.peers.values()):
            self._finished.set()


def _tell(conn: Connection, frame: bytes) -> None:
    """Send a failure's ERROR frame (2 s at most); a connection that has gone needs no telling."""
    try:
        conn.send([frame], timeout=2.0)
    except SmddpError:
        pass


def _widened(dtype: DType) -> bool:
    """Summed in a wider type (float16, bfloat16): never reduced in place."""
    return dtype.accumulator != dtype.storage


def _process_fate(pid: int) -> str:
    """How a local process that hung up is doing: gone (or a zombie) means it died.

    A killed process closes its sockets before it becomes a zombie, so give it a moment to finish.
    """
    deadline = time.monotonic() + 0.3
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "died (its process is gone)"
        if state in ("Z", "X"):
            return "died (its process exited or was killed)"
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if state == "T":
        return "was stopped (SIGSTOP) and closed its connection"
    return "closed its connection without shutting down"
