"""Joining a job under torchrun (or any env:// launcher): the node's first worker starts its daemon and relays the daemons' bootstrap through the store."""

# No mpirun on this path. Every worker reads its place from torch's environment (RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK); rank 0 picks a fresh job id, which every rank learns
# through the store torch hands the backend under a nonce of its own (torch elastic keeps that store
# across restarts: agree_job_id), so every attempt is a new job and everything of it lives under its
# id in the store. The first worker of each node starts that node's smddp-daemon as its child, tied to it
# by PR_SET_PDEATHSIG, and relays the daemons' bootstrap collectives through the store
# (transport/relay.py). It starts the daemon before it knows the job's id, and tells it the id first
# thing over their socket pair: at `import smddp.torch` (EarlyDaemon), so that the daemon's own
# start-up runs while the script goes on to its first smddp group, or else as that group begins.
# Once its daemon has written the job description, it says so under "node/N" in the store; the
# node's other workers wait for that word (or the error that stopped the daemon) and then join
# exactly as under smddp-launch, through the daemon's private directory.

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from smddp import settings
from smddp.errors import BootstrapError, ConfigError, SmddpError
from smddp.proto.handshake import JOB_ID_SIZE, is_job_hex
from smddp.transport.bootstrap import default_socket_dir, job_dir, read_job
from smddp.transport.relay import KVStore, LineConn, StoreRelay

#: The keys this module uses in the store, under the group's own prefix.
PREFIX = "smddp/"
#: How long a node's first worker waits at its exit for its daemon to end (the daemon waits for the
#: node's other workers and for its peers' BYE, or lingers 30 s after a failure for them to leave).
DAEMON_EXIT_WAIT_S = 60.0


@dataclass(frozen=True)
class ElasticPlace:
    """Where torchrun (or another env:// launcher) put this worker."""

    rank: int
    size: int
    node: int
    nnodes: int
    local_rank: int
    local_size: int
    restart_count: int

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int, size: int) -> ElasticPlace:
        """torch's variables, checked: ranks must be contiguous per node with the same count on each
        node (what torchrun does with one --nproc-per-node), as smddp's node layout needs."""
        missing = [n for n in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if not env.get(n)]
        if missing:
            raise BootstrapError(
                f"{' and '.join(missing)} not set: start the workers with torchrun (or smddp-launch), "
                "or set them as torchrun does"
            )
        try:
            local_rank, local_size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
            node = int(env["GROUP_RANK"]) if env.get("GROUP_RANK") else rank // max(local_size, 1)
            restart = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
        except ValueError as e:
            raise BootstrapError(f"a malformed torch launcher variable: {e}") from None
        if local_size < 1 or size % local_size or not 0 <= local_rank < local_size:
            raise BootstrapError(
                f"rank {rank}: smddp needs the same number of workers on every node, but this node has "
                f"LOCAL_WORLD_SIZE={local_size} of WORLD_SIZE={size} (LOCAL_RANK={local_rank})"
            )
        nnodes = size // local_size
        if rank != node * local_size + local_rank or not 0 <= node < nnodes:
            raise BootstrapError(
                f"rank {rank} is local rank {local_rank} of node {node} with {local_size} workers per node: "
                "smddp needs ranks contiguous per node (rank = node x LOCAL_WORLD_SIZE + LOCAL_RANK), "
                "as torchrun assigns them with one --nproc-per-node for every node"
            )
        return cls(rank, size, node, nnodes, local_rank, local_size, restart)

    def worker_env(self, job_hex: str) -> dict[str, str]:
        """The SMDDP_ placement variables smddp-launch would have set (Client.connect reads them)."""
        return {
            "SMDDP_JOB_ID": job_hex,
            "SMDDP_RANK": str(self.rank),
            "SMDDP_NODE": str(self.node),
            "SMDDP_LOCAL_RANK": str(self.local_rank),
            "SMDDP_LOCAL_SIZE": str(self.local_size),
            "SMDDP_NNODES": str(self.nnodes),
            "SMDDP_RESTART_COUNT": str(self.restart_count),
        }


def _get(store: KVStore, key: str, timeout: float, what: str) -> str:
    try:
        store.wait([key], timedelta(seconds=timeout))
        return store.get(key).decode()
    except Exception as e:  # torch's store raises DistStoreError / RuntimeError of its own
        raise BootstrapError(f"{what} within {timeout:g}s: {e}") from None


class DaemonChild:
    """The node's smddp-daemon, started by the node's first worker and ended with it. It is started
    without its job's id, which `bootstrap` tells it first (so it may be started ahead of the job)."""

    def __init__(self, place: ElasticPlace, env: Mapping[str, str]) -> None:
        from smddp.launcher.mpirun import daemon_command

        self.place = place
        self.job_hex = ""  # until bootstrap
        mine, theirs = socket.socketpair()
        child_env = {**env, **place.worker_env("")}
        # Only the smddp-launch job's variables would mislead a daemon started here; its id comes later.
        for name in ("SMDDP_LEDGER", "SMDDP_JOB_ID"):
            child_env.pop(name, None)
        argv = [
            *daemon_command(),
            *("--workers-per-node", str(place.local_size)),
            *("--rendezvous-fd", str(theirs.fileno())),
        ]
        try:
            self.proc = subprocess.Popen(
                argv,
                env=child_env,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except OSError as e:
            mine.close()
            raise BootstrapError(f"cannot start the smddp-daemon ({argv[0]}): {e}") from None
        finally:
            theirs.close()
        self.conn = LineConn(mine, f"the smddp-daemon of node {place.node} (pid {self.proc.pid})")
        # Tied to this worker: the daemon asks the kernel for SIGTERM when we die (smddp.daemon.run),
        # and until it has, its end of the pair closing with us ends its bootstrap.
        # After a clean end of the script (and smddp's own shutdown, registered later, so run
        # earlier), give the daemon the time to say BYE to its peers before this process goes and
        # the kernel ends it.
        atexit.register(self.wait_exit, DAEMON_EXIT_WAIT_S)

    def describe(self) -> str:
        try:
            code = self.proc.wait(2.0)  # it closed its end: it is ending, or has ended
        except subprocess.TimeoutExpired:
            return "stopped answering"
        return f"exited with status {code}" if code >= 0 else f"was killed by signal {-code}"

    def bootstrap(self, store: KVStore, job_hex: str, timeout: float) -> None:
        """Give the daemon its job, relay the daemons' bootstrap, then wait for the job description it writes."""
        self.job_hex = job_hex
        relay = StoreRelay(
            store, f"{PREFIX}{job_hex}/boot/", self.place.node, self.place.nnodes, timeout, job=job_hex
        )
        try:
            relay.serve(self.conn, self.describe)
        finally:
            self.conn.close()
        directory = job_dir(default_socket_dir(), self.job_hex, self.place.node)
        deadline = time.monotonic() + timeout
        while read_job(directory) is None:
            if self.proc.poll() is not None:
                raise BootstrapError(f"the smddp-daemon of node {self.place.node} {self.describe()}")
            if time.monotonic() > deadline:
                raise BootstrapError(
                    f"the smddp-daemon of node {self.place.node} wrote no job description within {timeout:g}s"
                )
            time.sleep(0.01)

    def wait_exit(self, timeout: float) -> None:
        """Wait (at most `timeout` s) for the daemon to end, then end it; its directory goes with it."""
        if not self.job_hex:
            # Never given a job: it waits for one on the pair, and ends as soon as the pair closes.
            self.conn.close()
            timeout = min(timeout, 5.0)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # its SIGTERM handler removes the job's directory
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.job_hex:
            shutil.rmtree(job_dir(default_socket_dir(), self.job_hex, self.place.node), ignore_errors=True)


def _daemon_settings(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What a daemon started with environment `env` was started with: smddp's variables."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith("SMDDP_")))


def _torchrun_place(env: Mapping[str, str]) -> ElasticPlace | None:
    """This worker's place under torchrun (or another env:// launcher); None under smddp-launch,
    without a launcher, or with variables join_through_store will refuse by name."""
    if env.get("SMDDP_JOB_ID") and env.get("SMDDP_RANK"):
        return None
    try:
        return ElasticPlace.from_env(env, int(env.get("RANK", "")), int(env.get("WORLD_SIZE", "")))
    except (BootstrapError, ValueError):
        return None


class EarlyDaemon:
    """The daemon the node's first worker starts at `import smddp.torch` (start), before any smddp group
    exists, so that its start-up (its interpreter and imports: most of a second) runs while the script
    goes on. The first smddp group takes it (take) if this worker's place and smddp's variables are
    still those it was started with; else it is told to end (it has no job yet: it just exits), and
    the group starts a fresh one. One per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: DaemonChild | None = None
        self._started_with: tuple[tuple[str, str], ...] = ()

    def start(self, env: Mapping[str, str]) -> None:
        """Start the daemon now if this is a node's first worker under torchrun and the setting allows."""
        place = _torchrun_place(env)
        if place is None or place.local_rank != 0:
            return
        try:
            if not settings.from_env(settings.WORKER, env)["daemon_at_import"]:
                return
        except ConfigError:
            return  # a malformed variable: the first smddp group names it
        with self._lock:
            if self._child is not None:
                return
            with contextlib.suppress(BootstrapError):  # the first smddp group tries again and says why
                self._child = DaemonChild(place, env)
                self._started_with = _daemon_settings(env)

    def take(self, place: ElasticPlace, env: Mapping[str, str]) -> DaemonChild | None:
        """The early daemon, if it was started for `place` with the smddp variables of `env` and is alive."""
        with self._lock:
            child, self._child = self._child, None
        if child is None:
            return None
        if child.place == place and self._started_with == _daemon_settings(env) and child.proc.poll() is None:
            return child
        child.wait_exit(5.0)
        return None


#: The process's early daemon (`import smddp.torch` calls start_early_daemon).
_early = EarlyDaemon()


def start_early_daemon(env: Mapping[str, str] | None = None) -> None:
    """Under torchrun, on a node's first worker: start the node's daemon now (EarlyDaemon)."""
    _early.start(os.environ if env is None else env)


def agree_job_id(store: KVStore, rank: int, size: int, timeout: float) -> str:
    """A fresh job id of rank 0's on every rank (collective), never one of an earlier attempt.

    torch elastic keeps one store for every restart of a run (and its restart counts may differ
    between nodes), so a key an earlier attempt wrote may still be there: reading "the job id" could
    give the last attempt's. Instead each rank asks under a nonce of its own, which no earlier attempt
    can have answered; rank 0 answers whatever it finds asked (an earlier attempt's question too,
    harmlessly) until each rank has confirmed under the new id, which no earlier attempt can have
    written either. Everything else of the job lives under that id.
    """
    deadline = time.monotonic() + timeout
    if rank != 0:
        nonce = secrets.token_hex(16)
        store.set(f"{PREFIX}ask/{rank}", nonce.encode())
        job_hex = _get(
            store, f"{PREFIX}answer/{rank}/{nonce}", timeout, f"rank {rank}: rank 0 gave no smddp job id"
        )
        if not is_job_hex(job_hex):
            raise BootstrapError(f"rank {rank}: the store holds a malformed smddp job id {job_hex[:40]!r}")
        store.set(f"{PREFIX}{job_hex}/joined/{rank}", b"1")
        return job_hex
    job_hex = secrets.token_hex(JOB_ID_SIZE)
    answered: dict[int, bytes] = {}
    pending = set(range(1, size))
    pause = 0.001
    try:
        while pending:
            for r in sorted(pending):
                if store.check([f"{PREFIX}{job_hex}/joined/{r}"]):
                    pending.discard(r)
                elif store.check([f"{PREFIX}ask/{r}"]):
                    asked = store.get(f"{PREFIX}ask/{r}")
                    if answered.get(r) != asked:
                        store.set(f"{PREFIX}answer/{r}/{asked.decode(errors='replace')}", job_hex.encode())
                        answered[r] = asked
            if pending and time.monotonic() > deadline:
                late = ", ".join(map(str, sorted(pending)[:16]))
                raise BootstrapError(
                    f"rank 0: rank(s) {late} did not join the smddp job within {timeout:g}s "
                    "(SMDDP_JOIN_TIMEOUT_S, or the group's timeout if shorter)"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
    except BootstrapError:
        raise
    except Exception as e:  # torch's store raises its own errors
        raise BootstrapError(f"rank 0: the store failed while agreeing on the smddp job id: {e}") from None
    return job_hex


def join_through_store(
    store: KVStore, rank: int, size: int, timeout: float, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Collective over every rank of the job: start and bootstrap the daemons through `store`.

    Returns the SMDDP_ placement variables to join with (smddp.init's `env`). Raises BootstrapError
    naming the cause on every rank when a daemon cannot start, and ConfigError for a layout smddp
    cannot run."""
    environ = os.environ if env is None else env
    place = ElasticPlace.from_env(environ, rank, size)
    daemon: DaemonChild | None = None
    error: SmddpError | None = None
    if place.local_rank == 0:
        # Started before the job's id is agreed (or at import): its start-up overlaps the agreement.
        try:
            daemon = _early.take(place, environ) or DaemonChild(place, environ)
        except SmddpError as e:
            error = e  # said under the node's key once there is a job to say it in
    job_hex = agree_job_id(store, rank, size, timeout)
    node_key = f"{PREFIX}{job_hex}/node/{place.node}"
    if place.local_rank == 0:
        try:
            if daemon is None:
                assert error is not None
                raise error
            daemon.bootstrap(store, job_hex, timeout)
        except SmddpError as e:
            store.set(node_key, json.dumps({"error": str(e)}).encode())
            if daemon is not None:
                daemon.wait_exit(5.0)
            raise
        store.set(node_key, json.dumps({"ok": daemon.proc.pid}).encode())
    else:
        raw = _get(
            store, node_key, timeout, f"rank {rank}: the first worker of node {place.node} started no daemon"
        )
        try:
            word = json.loads(raw)
        except ValueError:
            word = None
        if not isinstance(word, dict) or not ("ok" in word or "error" in word):
            raise BootstrapError(
                f"rank {rank}: the store holds a malformed word for node {place.node}: {raw[:80]!r}"
            )
        if "error" in word:
            raise BootstrapError(f"rank {rank}: {word['error']}")
    return {**environ, **place.worker_env(job_hex)}


def check_launcher(env: Mapping[str, str]) -> bool:
    """Whether this worker runs under smddp-launch (True) or must join through the store (False)."""
    if env.get("SMDDP_JOB_ID") and env.get("SMDDP_RANK"):
        return True
    if env.get("LOCAL_RANK") is None:
        raise ConfigError(
            "the smddp backend needs a launcher: smddp-launch -np W -- python SCRIPT, or "
            "torchrun --nproc-per-node G SCRIPT (or one that sets torch's env:// variables)"
        )
    return False
