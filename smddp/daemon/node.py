"""The node daemon: serves its local workers over shared memory and is server shard `node` for the job."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import threading
import time
from dataclasses import dataclass, field

from smddp import _engine
from smddp.daemon.config import DaemonConfig, PlaneConfig
from smddp.daemon.fabric import FabricChoice
from smddp.daemon.kernels import engine_kernels
from smddp.daemon.stats import LATENCY_BUCKETS, SIZE_LIMITS, Stats
from smddp.errors import (
    AuthenticationError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveStallError,
    PeerLostError,
    ProtocolError,
    SmddpError,
)
from smddp.proto import handshake as hs
from smddp.proto.failure import exit_status_of, failure_frame, infra_of, infra_status, read_failure
from smddp.proto.frames import HEADER_SIZE, NODE_REDUCE_LABELS, Header, MsgType, Role, error_frame
from smddp.proto.messages import (
    Bye,
    Channel,
    Exited,
    Heartbeat,
    Report,
    StatusRequest,
)
from smddp.trace import span
from smddp.transport.auth import client_handshake
from smddp.transport.bootstrap import Job
from smddp.transport.conn import Connection, ConnectionClosed
from smddp.transport.shm import Arena

MAX_HANDSHAKES = 64  # unauthenticated connections being served at once

log = logging.getLogger("smddp.daemon")


@dataclass
class WorkerLink:
    local_rank: int
    rank: int
    conn: Connection
    pid: int
    said_bye: bool = False
    channel: bool = False  # its ATTACH, SUBMIT, RELEASE and BYE come on the engine's ring (CHANNEL)


@dataclass
class PeerLink:
    node: int
    conn: Connection | None = None
    connected: threading.Event = field(default_factory=threading.Event)
    said_bye: bool = False


# A worker that hung up without BYE: how long to wait for its wrapper's EXITED (its exit status, the
# cause's status every rank's wrapper then ends with) before failing the job without it. The wrapper
# has the report ready when its worker exits, so it comes within milliseconds unless it died too.
EXIT_REPORT_WAIT_S = 1.0
# Why a rank whose wrapper was told to end went: what the failure says of it.
TORN_DOWN = (
    "mpirun or the scheduler tore the job down: another process of it ended first, or it was cancelled"
)
# The engine plane's worker threads spin this long for the next descriptor before they sleep (yielding
# the core between looks, smddp/engine/ring.cc): measured with 4 workers on 2 cores, a 4 KiB
# all-reduce took ~100 us with 200 us here and in the client's RING_SPIN_US, ~200 us with 20 us.
PLANE_SPIN_US = 200.0
TCP = FabricChoice("tcp", why="the default")


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
        fabric: FabricChoice = TCP,
    ) -> None:
        self.cfg = cfg
        self.fabric = fabric
        self.job = job
        self.node = node
        self.nnodes = job.nnodes
        self.local_size = job.local_size
        self.world = job.size
        self.me = job.describe_node(node)
        self._node_names = [job.describe_node(j) for j in range(job.nnodes)]
        self.tcp_sock = tcp_sock
        self.unix_sock = unix_sock
        self.socket_dir = socket_dir
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = threading.Event()
        self.failure: str | None = None
        self.failure_infra = False  # the failure's cause is the infrastructure's (proto.failure.INFRA_BIT)
        self._failure_frame: bytes | None = None  # the ERROR every local rank gets, late joiners too
        self.workers: list[WorkerLink | None] = [None] * self.local_size
        # Exit statuses of local ranks that joined and then ended badly (their wrapper's EXITED).
        self._exit_status: list[int | None] = [None] * self.local_size
        self._exit_reported = [threading.Event() for _ in range(self.local_size)]
        self._torn_down = [False] * self.local_size  # ... and whether its wrapper was told to end
        self.peers = {j: PeerLink(j) for j in range(self.nnodes) if j != node}
        self.results = Arena(cfg.result_segment_bytes, f"smddp-result-n{node}")
        self.scratch = Arena(cfg.result_segment_bytes, f"smddp-server-n{node}")
        # The data plane (smddp/engine/local_plane.h): the workers' rings, the job's rules for every
        # collective (fingerprints, order, who left), the reductions, the shard exchange with the
        # other daemons over the links handed to it (add_peer), heartbeats and DONE, all on the
        # engine's own threads. Python serves the handshakes, the sockets' control frames, status.
        plane = PlaneConfig(
            node=node,
            local_size=self.local_size,
            world=self.world,
            first_rank=job.ranks_of(node).start,
            nnodes=self.nnodes,
            chunk_bytes=cfg.chunk_bytes,
            rank_names=tuple(job.describe_rank(r) for r in job.ranks_of(node)),
            me=self.me,
            spin_us=PLANE_SPIN_US,
            push_timeout_s=cfg.heartbeat_timeout_s,
            threads=cfg.compute_threads(),
            replicate_bytes=cfg.replicate_bytes,
            node_names=tuple(self._node_names),
            heartbeat_s=cfg.heartbeat_timeout_s,
            trace=bool(cfg.timeline_dir),
            fabric=fabric.fabric,
            ofi_library=fabric.library,
            ofi_provider=fabric.provider,
            size_limits=SIZE_LIMITS,
            latency_buckets=LATENCY_BUCKETS,
        )
        self.plane = _engine.LocalPlane(plane, self.results.native, self.scratch.native)
        self._plane_reduced = (0, 0.0)  # the plane's reduced bytes and seconds already in self.stats
        self._plane_peer_counted: dict[int, tuple[int, int]] = {}  # node -> bytes in, out in self.stats
        self._plane_queued: dict[int, int] = {}  # node -> frames queued to it, as last counted
        self._plane_count_lock = threading.Lock()
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
        self.reduce_kernel = engine_kernels()  # what `smddp status` shows

    # ------------------------------------------------------------------ lifecycle

    def serve(self) -> int:
        """Run until every local worker said BYE and every peer did too, or the job failed."""
        self._spawn(self._accept_loop, self.unix_sock, self._serve_worker, name="accept-unix")
        self._spawn(self._accept_loop, self.tcp_sock, self._serve_peer_accepted, name="accept-tcp")
        for j in self.peers:
            if j < self.node:
                self._spawn(self._connect_peer, j, name=f"connect-{j}")
        self._spawn(self._plane_loop, self.plane, name="plane-events")
        self._spawn(self._heartbeat_loop, name="heartbeat")
        # Peers are daemons, up within seconds of each other: one missing after connect_timeout_s is
        # the infrastructure's failure. A local rank joins when its script calls smddp.init(), after
        # its own start-up (imports, JIT builds, data), which may take minutes: join_timeout_s.
        connect_by = self._started + self.cfg.connect_timeout_s
        join_by = self._started + self.cfg.join_timeout_s
        last_tick = 0.0
        while not self._finished.wait(0.2):
            now = time.monotonic()
            if now - last_tick >= 1.0:
                last_tick = now
                self.count_plane()
                self.stats.sample()
                self._inspect_stalls(now)
            if now > connect_by and (peers := self._missing_peers()):
                msg = (
                    f"{self.me}: not connected after {self.cfg.connect_timeout_s:g}s (--connect-timeout): "
                    + ", ".join(peers)
                )
                self.fail(msg, PeerLostError, infra=True)
            if now > join_by and (ranks := self._missing_ranks()):
                msg = (
                    f"{self.me}: {', '.join(ranks)} did not join (call smddp.init()) within "
                    f"{self.cfg.join_timeout_s:g}s of the job's start (--join-timeout): its script is slow "
                    "or stuck before it"
                )
                self.fail(msg, PeerLostError, infra=False)
            bye = self._bye_sent_at
            if bye is not None and time.monotonic() > bye + self.cfg.shutdown_timeout_s:
                waiting = [self.job.describe_node(j) for j, p in self.peers.items() if not p.said_bye]
                msg = f"{self.me}: finished, but {', '.join(waiting)} did not finish"
                self.fail(msg, PeerLostError, infra=True)
        # A failure before every local rank came: keep the door open for the late ones (until the
        # connect deadline), so that each hears why instead of waiting for a daemon that has gone.
        while (self._missing_ranks() or self._missing_peers()) and time.monotonic() < connect_by:
            time.sleep(0.05)
        return self._teardown()

    def _missing_ranks(self) -> list[str]:
        """The local ranks that have not connected (nor been reported gone before they could: EXITED)."""
        with self._lock:
            absent = [i for i, w in enumerate(self.workers) if w is None and not self.plane.left_early(i)]
        return [self.job.describe_rank(self.job.ranks_of(self.node)[i]) for i in absent]

    def _missing_peers(self) -> list[str]:
        """The peer daemons that have not connected."""
        return [self.job.describe_node(j) for j, p in self.peers.items() if not p.connected.is_set()]

    def _teardown(self) -> int:
        self._stop.set()
        self.plane.flush(5.0)  # the BYE and ERROR frames leave before the links close
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
        self.plane.close()  # with the peers' links, whose sockets it owns  # its threads end before the memory they use goes
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
        self,
        reason: str,
        kind: type[SmddpError] = CollectiveError,
        exit_status: int | None = None,
        infra: bool = False,
    ) -> None:
        """Put the job in FAILED: tell every worker and peer why (the exit status of the rank whose end
        caused it, when known, and whether the cause is the infrastructure's), once, then stop."""
        frame = failure_frame(kind, reason, sender=self.node, exit_status=exit_status, infra=infra)
        with self._lock:
            if self.failure is not None or self._finished.is_set():
                return
            self.failure = reason
            self.failure_infra = infra
            self._failure_frame = frame
            self.plane.abort()
            # Every local rank and peer hears it once: those connected now here, later ones when
            # they connect (_serve_worker, _adopt_peer).
            told = list(self.workers)
            told_peers = [p for p in self.peers.values() if p.conn is not None]
        self.stats.error("failed", reason)
        log.error("%s: job failed: %s", self.me, reason)
        for w in told:
            if w is not None and not w.said_bye:
                _tell(w.conn, frame)
        for p in told_peers:
            self._to_peer(p, frame[:HEADER_SIZE], frame[HEADER_SIZE:])
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
            if self.plane.left_early(local):
                raise AuthenticationError(f"rank {hello.rank} connected after its process was reported gone")
            self.workers[local] = link
            self.plane.name_rank(local, conn.peer)
            failed = self._failure_frame
        log.info("%s: %s connected", self.me, conn.peer)
        if failed is not None:
            # The job failed before this rank came: say why at once, then wait for it to leave.
            _tell(conn, failed)
            self._drain(conn)
            conn.close()
            return
        removed = False  # its engine thread was stopped (remove_worker, once)
        try:
            self._worker_loop(link)
        except ConnectionClosed:
            removed = link.channel
            if removed and self.plane.remove_worker(local):
                # Its ring said BYE (handled in order after everything before it), then it hung up.
                link.said_bye = True
                self._maybe_finish()
            if not (link.said_bye or self._finished.is_set()):
                reason = self._worker_lost(link)
                status, torn_down = self._await_exit_status(link.local_rank)
                if torn_down:
                    # A consequence, not the cause: the cause's own rank, daemon or node says that.
                    reason += f" (stopped with its job: {TORN_DOWN})"
                    self.fail(reason, PeerLostError, infra=False)
                else:
                    if status is not None:
                        how = f"killed by signal {status - 128}" if status > 128 else f"exit status {status}"
                        reason += f" ({how})"
                    self.fail(reason, PeerLostError, exit_status=status, infra=infra_status(status))
        except SmddpError as e:
            # Keep the connection open until the worker leaves, so that it reads the ERROR rather
            # than a broken pipe (teardown closes it at the end of the linger time regardless).
            self.fail(str(e), type(e))
            self._drain(conn)
        if link.channel and not removed:
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

    def _await_exit_status(self, local: int) -> tuple[int | None, bool]:
        """The exit status the wrapper of local rank `local` reports, waited for a moment (None if
        none), and whether that wrapper was told to end (the job torn down around it)."""
        self._exit_reported[local].wait(EXIT_REPORT_WAIT_S)
        return self._exit_status[local], self._torn_down[local]

    def _on_exited(self, rank: int, status: int, torn_down: bool = False) -> None:
        """The launcher's wrapper of local `rank` says its process ended with `status`.

        A rank that never joined is gone for good: any collective that needs it fails now, naming
        it as a lost rank, and a node whose ranks all left (or never came) finishes as after BYE.
        A rank that joined and ended badly is named by its connection's end; its status is recorded
        for the failure (the cause's exit status, which every rank's wrapper then ends with).
        `torn_down`: its wrapper was told to end (mpirun tore the job down because another process
        ended first, or the job was cancelled): its end is no cause, of the infrastructure or not.
        """
        ranks = self.job.ranks_of(self.node)
        if rank not in ranks:
            raise ProtocolError(f"EXITED for rank {rank}, which does not belong to {self.me}")
        local = rank - ranks.start
        if self.workers[local] is not None:
            self._exit_status[local] = status
            self._torn_down[local] = torn_down
            self._exit_reported[local].set()
            return
        if torn_down:
            how = f"was stopped with its job ({TORN_DOWN})"
        elif status > 128:
            how = f"was killed by signal {status - 128}"
        else:
            how = f"exited with status {status}"
        reason = (
            f"{self.job.describe_rank(rank)} {how} without joining the job (it never called smddp.init(), "
            "or failed before it)"
        )
        try:
            with self._lock:
                recorded = self.plane.rank_left_early(local, self.workers[local] is not None, reason)
        except PeerLostError as e:  # a collective in flight waits for it, and never gets it
            log.info("%s: %s", self.me, reason)
            self.fail(str(e), PeerLostError, infra=not torn_down and infra_status(status))
            return
        if recorded:
            log.info("%s: %s", self.me, reason)
            self._maybe_finish()

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
            if fds and h.type is not MsgType.CHANNEL:
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"{conn.peer} passed file descriptors with {h.type.name}")
            if h.type in (MsgType.ATTACH, MsgType.SUBMIT, MsgType.RELEASE, MsgType.BYE):
                raise ProtocolError(f"{conn.peer} sent {h.type.name} on its socket: its ring carries them")
            if h.type is MsgType.CHANNEL:
                self._on_channel(link, h, fds)
            elif h.type is MsgType.ERROR:
                text = conn.recv_bytes(h.length, timeout=5.0).decode("utf-8", "replace")
                raise CollectiveError(f"{conn.peer} aborted the job: {text}")
            else:
                raise ProtocolError(f"{conn.peer} sent {h.type.name}, which workers may not send")

    def _on_channel(self, link: WorkerLink, h: Header, fds: list[int]) -> None:
        """The worker's rings and side socket (docs/protocol.md, CHANNEL): from now on the engine's
        plane serves it."""
        if link.channel or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(
                f"{link.conn.peer} sent CHANNEL, refused: a second one, or {len(fds)} fds (its segment "
                "and its side socket are two)"
            )
        ch = Channel.of(h)
        if ch.size < _engine.CHANNEL_BYTES:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(
                f"{link.conn.peer}: a channel of {ch.size} bytes, {_engine.CHANNEL_BYTES} needed"
            )
        seg_fd, side = fds
        if not stat.S_ISSOCK(os.fstat(side).st_mode):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"{link.conn.peer}: CHANNEL's second fd is not its side socket")
        try:
            native = _engine.segment_attach(0, seg_fd, ch.size, True)  # takes seg_fd over
        except BaseException:
            os.close(side)
            raise
        self.plane.add_worker(link.local_rank, link.rank, link.conn.peer, native, side)  # takes side over
        link.channel = True

    def _plane_loop(self, plane: _engine.LocalPlane) -> None:
        """The plane's events: peers' control frames, and the plane's own failure."""
        while not (self._stop.is_set() or self._finished.is_set()):
            ev = plane.next_event(0.5)
            if ev is None:
                continue
            match ev:
                case _engine.PeerFrame(node, mtype, seq, aux, body):  # a peer's control frame
                    self._on_peer_control(self.peers[node], MsgType(mtype), seq, aux, body)
                case _engine.PlaneFailure(fault, why):  # the plane's own failure
                    kind: type[SmddpError] = {
                        "mismatch": CollectiveMismatchError,
                        "peer_lost": PeerLostError,
                    }.get(fault, ProtocolError)
                    # A peer lost or silent (its daemon, node or link) is the infrastructure's doing.
                    self.fail(why, kind, infra=kind is PeerLostError)

    def count_plane(self) -> None:
        """Bring what the plane did since the last call into the daemon's statistics."""
        with self._plane_count_lock:  # the main loop's tick and a status request may come together
            self._count_plane_locked()

    def _count_plane_locked(self) -> None:
        plane = self.plane
        for c in plane.take_completions():
            self.stats.done(c.kind, c.dtype, c.size_class, c.bucket, c.completed, c.seconds)
        totals = plane.counters()
        reduced, secs = totals.reduced_bytes, totals.reduce_seconds
        reduced0, secs0 = self._plane_reduced
        if reduced > reduced0:
            self.stats.add_reduce(reduced - reduced0, secs - secs0)
        self._plane_reduced = (reduced, secs)
        for peer in plane.peer_counters():
            node, bytes_in, bytes_out = peer.node, peer.bytes_in, peer.bytes_out
            self._plane_queued[node] = peer.queued
            in0, out0 = self._plane_peer_counted.get(node, (0, 0))
            if bytes_in > in0:
                self.stats.add_in(node, bytes_in - in0)
            if bytes_out > out0:
                self.stats.add_out(node, bytes_out - out0)
            self._plane_peer_counted[node] = (bytes_in, bytes_out)
        if self.cfg.timeline_dir:
            process = f"node {self.node} daemon"
            for t in plane.take_traces():
                args = {"seq": t.seq, "what": t.what}
                self.timeline.extend(
                    span(f"#{t.seq} {name}", start, end, process, name, args) for name, start, end in t.phases
                )

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
                    self._on_exited(gone.rank, gone.status, gone.torn_down)
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

    def _rank_files(self, what: str) -> dict[str, dict]:
        """The local ranks' `<what>-<rank>.json` files (Client._show_daemon), by rank: shown, never trusted."""
        out: dict[str, dict] = {}
        try:
            names = [
                n for n in os.listdir(self.socket_dir) if n.startswith(f"{what}-") and n.endswith(".json")
            ]
        except OSError:
            return out
        for name in names:
            rank = name[len(what) + 1 : -len(".json")]
            try:
                with open(os.path.join(self.socket_dir, name)) as f:
                    said = json.load(f)
            except (OSError, ValueError):
                continue
            if rank.isdigit() and isinstance(said, dict):
                out[rank] = said
        return out

    def _routed_counts(self) -> dict[str, int]:
        """Calls the local ranks' front ends sent to their side groups (Client.count_routed files)."""
        total: dict[str, int] = {}
        for counts in self._rank_files("routed").values():
            for k, v in counts.items():
                if isinstance(k, str) and isinstance(v, int):
                    total[k] = total.get(k, 0) + v
        return total

    def _front_ends(self) -> dict[str, dict[str, str]]:
        """What each local rank's front ends chose (Client.note_front_end files), by rank."""
        return {
            rank: {k: v for k, v in said.items() if isinstance(k, str) and isinstance(v, str)}
            for rank, said in self._rank_files("front").items()
        }

    def _fabric_status(self) -> dict:
        """The fabric between the daemons, as `smddp status` shows it: which, why, and its counters."""
        described, counters = self.plane.fabric()
        return {
            "name": self.fabric.fabric,
            "provider": self.fabric.provider,
            "library": self.fabric.library,
            "why": self.fabric.why,
            "describe": described,
            **counters,
        }

    def device_counts(self) -> list[dict[str, int | str]]:
        """Each local worker's copies between its devices and smddp's memory, as its engine counts
        them in its channel, and where its device all-reduces are summed (node_reduce; only workers
        that made a copy or took the GPU step): shown, never trusted."""
        return [
            {
                "rank": c.rank,
                "d2h_bytes": c.d2h_bytes,
                "h2d_bytes": c.h2d_bytes,
                "d2h_copies": c.d2h_copies,
                "h2d_copies": c.h2d_copies,
                "node_reduce": NODE_REDUCE_LABELS[c.node_reduce],
            }
            for c in self.plane.device_counts()
            if c.d2h_copies or c.h2d_copies or c.node_reduce >= 2
        ]

    def local_report(self) -> dict:
        """What `smddp status` shows for this daemon (JSON-ready)."""
        self.count_plane()
        now = time.monotonic()
        with self._lock:
            ops = self._in_flight(now)
            workers = [w for w in self.workers if w is not None]
            stalled = [r for r in ops if r["age_s"] > self.cfg.stall_warning_s]
            oldest_info = ops[0] if ops else None
            local_q, server_q = self.plane.queued_tasks()
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
            "front_ends": self._front_ends(),
            "devices": self.device_counts(),
            "node": self.node,
            "host": d.host,
            "pid": os.getpid(),
            "address": f"{d.tcp_host}:{d.tcp_port}",
            "uptime_s": now - self._started,
            "state": state,
            "reduce_kernel": self.reduce_kernel,
            "fabric": self._fabric_status(),
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
                    "send_queue": self._plane_queued.get(j, 0),
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

    def _in_flight(self, now: float) -> list[dict]:
        """The collectives in flight and not done, oldest first: seq, what, age_s, waiting_for (lock held)."""
        ranks = self.job.ranks_of(self.node)
        rows = [
            {
                "seq": w.seq,
                "what": w.what,
                "age_s": w.age_s,
                "waiting_for": [self.job.describe_rank(ranks[i]) for i in w.late]
                + [self.job.describe_node(j) for j in w.late_nodes],
            }
            for w in self.plane.waiting()
        ]
        return sorted(rows, key=lambda r: -r["age_s"])

    def _inspect_stalls(self, now: float) -> None:
        """Warn about collectives that waited longer than the stall warning time, naming who is late."""
        limit = self.cfg.stall_warning_s
        with self._lock:
            rows = self._in_flight(now)
            late = [
                r for r in rows if r["age_s"] > limit and now - self._stall_warned.get(r["seq"], 0.0) > limit
            ]
            # Only the collectives still in flight are remembered: the others finished.
            self._stall_warned = {
                r["seq"]: self._stall_warned[r["seq"]] for r in rows if r["seq"] in self._stall_warned
            }
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
        self._enforce_stall_limit()

    def _enforce_stall_limit(self) -> None:
        """Fail the job when a collective has waited past --stall-timeout for ranks that never
        submitted it, naming them and what everyone else waits in.

        The daemon of a late rank fails it (it can tell whether the rank is stopped or gone: then the
        cause is the infrastructure's, else the script's, e.g. a deadlocked data loader); a daemon
        that sees only a late node waits two heartbeat timeouts more for that node's own verdict.
        """
        limit = self.cfg.stall_timeout_s
        if limit <= 0:
            return
        ranks = self.job.ranks_of(self.node)
        with self._lock:
            waiting = self.plane.waiting()
            pids = [w.pid if w is not None else None for w in self.workers]
        for stalled in sorted(waiting, key=lambda w: -w.age_s):
            seq, age, what, late, late_nodes = (
                stalled.seq,
                stalled.age_s,
                stalled.what,
                stalled.late,
                stalled.late_nodes,
            )
            if not (late or late_nodes) or age <= limit:
                continue
            if not late and age <= limit + 2 * self.cfg.heartbeat_timeout_s:
                continue
            who = [self.job.describe_rank(ranks[i]) for i in late] + [
                self.job.describe_node(j) for j in late_nodes
            ]
            fates = [f"{self.job.describe_rank(ranks[i])} is {_run_state(pids[i])}" for i in late]
            infra = any(not _running(pids[i]) for i in late)
            self.fail(
                f"{self.me}: collective #{seq} {what} waited {age:.0f}s, past the stall limit "
                f"(--stall-timeout {limit:g}), for {', '.join(who)}, which never submitted it"
                + (f" ({'; '.join(fates)})" if fates else ""),
                CollectiveStallError,
                infra=infra,
            )
            return

    def write_timeline(self) -> None:
        if not self.cfg.timeline_dir:
            return
        self.count_plane()  # the engine's traces of the last collectives
        path = os.path.join(self.cfg.timeline_dir, f"daemon-n{self.node}.json")
        with open(path, "w") as f:
            json.dump(self.timeline, f)

    # ------------------------------------------------------------------ peers

    def _heartbeat_loop(self) -> None:
        """Every quarter of the heartbeat timeout, tell every local worker that we are alive (on its
        socket; the engine's links to the peers beat on their own)."""
        beat = Heartbeat(self.node).header().encode()
        period = self.cfg.heartbeat_timeout_s / 4
        while not self._finished.wait(period):
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
        self._adopt_peer(self.peers[j], conn)

    def _serve_peer_accepted(self, conn: Connection, hello: hs.Hello) -> None:
        if hello.role != Role.DAEMON or not (self.node < hello.rank < self.nnodes):
            raise AuthenticationError(f"daemon {hello.rank} should not connect to {self.me}")
        peer = self.peers[hello.rank]
        if peer.connected.is_set():
            raise AuthenticationError(f"{self.job.describe_node(hello.rank)} connected twice")
        conn.peer = self.job.describe_node(hello.rank)
        self._adopt_peer(peer, conn)

    def _adopt_peer(self, peer: PeerLink, conn: Connection) -> None:
        """Hand an authenticated peer link to the engine's plane, which reads and writes it from now on."""
        with self._lock:
            peer.conn = conn
            failed = self._failure_frame
            self.plane.add_peer(peer.node, conn.sock.detach())
        if failed is not None:
            # The job failed before this peer came: it hears why first, and fails its own ranks.
            self._to_peer(peer, failed[:HEADER_SIZE], failed[HEADER_SIZE:])
        peer.connected.set()
        log.info("%s: connected to %s", self.me, conn.peer)

    def _to_peer(self, peer: PeerLink, header: bytes, body: bytes | None = None) -> None:
        """Queue a control frame to a peer behind everything queued to it before."""
        self.plane.send_control(peer.node, header, body or b"")

    def _on_peer_control(self, peer: PeerLink, t: MsgType, seq: int, aux: int, body: bytes) -> None:
        """A peer's STATUS, REPORT, ERROR or BYE (whole), as the plane read it."""
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
            self.fail(why, kind, exit_status=exit_status_of(aux), infra=infra_of(aux))
        elif t is MsgType.BYE:
            # (The engine's table heard it first: a collective it leaves unfinished failed there.)
            peer.said_bye = True
            self._maybe_finish()

    def _maybe_finish(self) -> None:
        """After the last local BYE: say BYE to every peer (behind everything queued to it); finish
        when every peer has said it too."""
        with self._lock:
            if not self.plane.all_ranks_gone():
                return
            if self._bye_sent_at is None:
                self._bye_sent_at = time.monotonic()
                # Queued under the lock: a peer's BYE handled meanwhile on another thread would
                # otherwise finish the daemon, whose teardown flushes only what is queued, before
                # ours is, and close the links without it (the peer then lost contact with us).
                for p in self.peers.values():
                    self._to_peer(p, Bye(self.node).header().encode())
            done = all(p.said_bye for p in self.peers.values())
        if done:
            self._finished.set()


def _tell(conn: Connection, frame: bytes) -> None:
    """Send a failure's ERROR frame (2 s at most); a connection that has gone needs no telling."""
    try:
        conn.send([frame], timeout=2.0)
    except SmddpError:
        pass


def _proc_state(pid: int) -> str | None:
    """The state letter /proc gives a process (R, S, T, Z...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _run_state(pid: int | None) -> str:
    """A local rank's process state, for a stall: running (or sleeping), stopped, or gone."""
    if pid is None:
        return "not connected"
    state = _proc_state(pid)
    if state is None:
        return "gone"
    if state in ("T", "t"):
        return "stopped (SIGSTOP or a debugger)"
    if state in ("Z", "X"):
        return "gone"
    return "running (it is busy elsewhere: its own code, a data loader, a deadlock)"


def _running(pid: int | None) -> bool:
    """Whether a late rank is alive and scheduled: then its lateness is its script's, else the infrastructure's."""
    return _run_state(pid).startswith("running")


def _process_fate(pid: int) -> str:
    """How a local process that hung up is doing: gone (or a zombie) means it died.

    A killed process closes its sockets before it becomes a zombie, so give it a moment to finish.
    """
    deadline = time.monotonic() + 0.3
    while True:
        state = _proc_state(pid)
        if state is None:
            return "died (its process is gone)"
        if state in ("Z", "X"):
            return "died (its process exited or was killed)"
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if state == "T":
        return "was stopped (SIGSTOP) and closed its connection"
    return "closed its connection without shutting down"
