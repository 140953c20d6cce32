"""Joining a job through torch's store: under torchrun (or any env:// launcher) or none (mp.spawn, file://, tcp://), the node's first worker starts its daemon and relays the daemons' bootstrap through the store."""

# No mpirun on this path. Every rank tells rank 0 of itself through the store torch hands the backend
# (its host, and the launcher's LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK where one set them); rank 0
# picks a fresh job id, which every rank learns under a nonce of its own (torch elastic keeps that
# store across restarts: agree_job), and places every rank: the launcher's nodes, checked, or
# without a launcher the ranks on one host as one node (place_ranks). Everything of a job lives under
# its id in the store. The first worker of each node starts that node's smddp-daemon as its child,
# tied to it by PR_SET_PDEATHSIG, and relays the daemons' bootstrap collectives through the store
# (transport/relay.py). Under a launcher it starts the daemon before it knows the job's id, and tells
# it the id first thing over their socket pair: at `import smddp.torch` (EarlyDaemon), so that the
# daemon's own start-up runs while the script goes on to its first smddp group, or else as that group
# begins; without one it starts the daemon once the ranks are placed. Once its daemon has written the
# job description, it says so under "node/N" in the store; the node's other workers wait for that
# word (or the error that stopped the daemon) and then join exactly as under smddp-launch, through
# the daemon's private directory.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

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


def _get_raw(store: KVStore, key: str, timeout: float, what: str) -> bytes:
    try:
        store.wait([key], timedelta(seconds=timeout))
        return store.get(key)
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
    if under_smddp_launch(env):
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


#: The launcher's variables a rank's record carries where they are set, so that every rank checks
#: every rank's against what the store says.
LAUNCHER_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
#: How long a rank waits, past its own deadline, for rank 0's word on the job (rank 0 may have started
#: later, and says why the job cannot start once its own deadline passes).
TABLE_GRACE_S = 10.0


def under_smddp_launch(env: Mapping[str, str]) -> bool:
    """Whether this worker was placed by smddp-launch (else it joins through torch's store)."""
    return bool(env.get("SMDDP_JOB_ID") and env.get("SMDDP_RANK"))


def host_identity(env: Mapping[str, str]) -> str:
    """What ranks compare to find their node: SMDDP_HOST_ID where set, else this host's name, the
    kernel's boot id and the network and mount namespaces this process runs in. Ranks alike in all of
    these reach one daemon's socket directory and loopback; a container or network namespace of its
    own is a node of its own."""
    given = str(settings.from_env(settings.WORKER, env)["host_id"])
    if given:
        return given
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        parts.append(f.read().strip())
    for ns in ("net", "mnt"):
        with contextlib.suppress(OSError):
            parts.append(f"{ns}:{os.stat(f'/proc/self/ns/{ns}').st_ino}")
    return "/".join(parts)


def rank_record(env: Mapping[str, str], size: int) -> dict[str, Any]:
    """What a rank tells the others of itself (every rank's place is computed from every rank's)."""
    return {
        "world": size,
        "host": host_identity(env),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "env": {n: env[n] for n in LAUNCHER_VARS if env.get(n)},
    }


def _ranks(ranks: Sequence[int]) -> str:
    """Ranks as runs: 0-3, 6, 8-9."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:16]) + (
        ", ..." if len(runs) > 16 else ""
    )


def place_ranks(records: Sequence[Mapping[str, Any]], size: int) -> list[ElasticPlace]:
    """Every rank's place from every rank's record (rank_record), the same on every rank.

    Where a launcher set LOCAL_RANK (for every rank, or it is an error) its nodes are taken, and
    checked against the store: no two ranks claim one local rank, and the ranks of a node share a host.
    Without one, the ranks on one host form a node, in rank order. Raises BootstrapError naming the
    ranks of whatever smddp cannot run."""

    def who(r: int) -> str:
        return f"rank {r} ({records[r]['hostname']}, pid {records[r]['pid']})"

    odd = [r for r, rec in enumerate(records) if rec["world"] != size]
    if odd:
        said = ", ".join(f"{who(r)} {records[r]['world']}" for r in odd[:8])
        raise BootstrapError(
            f"the ranks disagree on the world size: rank 0 says {size}, {said}: every rank must pass "
            "the same world_size"
        )
    given = [r for r, rec in enumerate(records) if "LOCAL_RANK" in rec["env"]]
    if not given:
        return _places_by_host(records, size, who)
    if len(given) != size:
        unset = [r for r in range(size) if r not in set(given)]
        raise BootstrapError(
            f"LOCAL_RANK is set for rank(s) {_ranks(given)} but not for rank(s) {_ranks(unset)}: a launcher "
            "sets it for every rank; without one leave it unset, and the ranks find their nodes through the store"
        )
    claimed: dict[tuple[str, str, str], int] = {}
    for r, rec in enumerate(records):
        env = rec["env"]
        key = (rec["host"], env.get("GROUP_RANK", ""), env["LOCAL_RANK"])
        if key in claimed:
            raise BootstrapError(
                f"{who(claimed[key])} and {who(r)} both claim local rank {env['LOCAL_RANK']} of their node "
                "(LOCAL_RANK): each rank of a node needs a local rank of its own"
            )
        claimed[key] = r
    places = [ElasticPlace.from_env(rec["env"], r, size) for r, rec in enumerate(records)]
    sizes = {p.local_size for p in places}
    if len(sizes) > 1:
        raise BootstrapError(
            "the ranks disagree on LOCAL_WORLD_SIZE ("
            + ", ".join(f"rank {p.rank}: {p.local_size}" for p in places[:8])
            + "): smddp needs the same number of workers on every node"
        )
    host_of: dict[int, int] = {}
    for p in places:
        first = host_of.setdefault(p.node, p.rank)
        if records[first]["host"] != records[p.rank]["host"]:
            raise BootstrapError(
                f"{who(first)} and {who(p.rank)} are on different hosts, yet their launcher put both on "
                f"node {p.node} (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK): the ranks of a node share its "
                "daemon, so they must share a host"
            )
    return places


def _places_by_host(
    records: Sequence[Mapping[str, Any]], size: int, who: Callable[[int], str]
) -> list[ElasticPlace]:
    """Without a launcher: the ranks on one host form a node, nodes in the order of their first rank."""
    hosts: dict[str, list[int]] = {}
    for r, rec in enumerate(records):
        hosts.setdefault(rec["host"], []).append(r)
    nodes = list(hosts.values())
    per = len(nodes[0])
    if any(len(n) != per for n in nodes):
        counts = "; ".join(f"{len(n)} on {records[n[0]]['hostname']} (ranks {_ranks(n)})" for n in nodes[:8])
        raise BootstrapError(f"smddp needs the same number of ranks on every host, and this job has {counts}")
    for i, n in enumerate(nodes):
        if n != list(range(i * per, (i + 1) * per)):
            raise BootstrapError(
                f"smddp needs the ranks of each host numbered consecutively (rank = node x ranks per host + "
                f"local rank), and {who(n[0])}'s host has ranks {_ranks(n)}"
            )
    restart = int(records[0]["env"].get("TORCHELASTIC_RESTART_COUNT") or 0)
    return [ElasticPlace(r, size, r // per, len(nodes), r % per, per, restart) for r in range(size)]


def _word(raw: bytes, what: str) -> dict[str, Any]:
    try:
        word = json.loads(raw)
    except ValueError:
        word = None
    if not isinstance(word, dict):
        raise BootstrapError(f"the store holds a malformed {what}: {raw[:80]!r}")
    return word


def agree_job(
    store: KVStore, rank: int, size: int, timeout: float, record: Mapping[str, Any]
) -> tuple[str, list[ElasticPlace]]:
    """A fresh job id of rank 0's, and every rank's place, on every rank (collective); never an
    earlier attempt's.

    torch elastic keeps one store for every restart of a run (and its restart counts may differ
    between nodes), so a key an earlier attempt wrote may still be there: reading "the job id" could
    give the last attempt's. Instead each rank asks under a nonce of its own, which no earlier attempt
    can have answered; rank 0 answers whatever it finds asked (an earlier attempt's question too,
    harmlessly) until each rank has joined under the new id with its record (rank_record), which no
    earlier attempt can have written either. Rank 0 then places every rank (place_ranks) and writes
    the records, or why the job cannot start, as the job's table; every rank places itself from it.
    Everything else of the job lives under that id.
    """
    deadline = time.monotonic() + timeout
    try:
        if rank != 0:
            job_hex = _ask_job_id(store, rank, size, timeout, deadline)
            store.set(f"{PREFIX}{job_hex}/joined/{rank}", json.dumps(record).encode())
            left = max(deadline - time.monotonic(), 0.0) + TABLE_GRACE_S
            table = _word(
                _get_raw(store, f"{PREFIX}{job_hex}/table", left, f"rank {rank}: rank 0 placed no ranks"),
                "smddp job table",
            )
            if "error" in table:
                raise BootstrapError(f"rank {rank}: {table['error']}")
        else:
            job_hex, table = _answer_job_id(store, size, timeout, deadline, record)
        records = table.get("records")
        if not isinstance(records, list) or len(records) != size:
            raise BootstrapError(f"rank {rank}: the store holds a malformed smddp job table")
        return job_hex, place_ranks(records, size)
    except BootstrapError:
        raise
    except Exception as e:  # torch's store raises its own errors
        raise BootstrapError(f"rank {rank}: the store failed while starting the smddp job: {e}") from None


def _ask_job_id(store: KVStore, rank: int, size: int, timeout: float, deadline: float) -> str:
    """Rank `rank`'s side of agree_job: ask rank 0 for the job id (and keep asking in our own name)."""
    nonce = secrets.token_hex(16)
    ask = f"{PREFIX}ask/{rank}"
    mine = json.dumps({"nonce": nonce, "world": size}).encode()
    store.set(ask, mine)
    answer = f"{PREFIX}answer/{rank}/{nonce}"
    pause, look = 0.001, 0.0
    while not store.check([answer]):
        now = time.monotonic()
        if now > deadline:
            raise BootstrapError(
                f"rank {rank}: rank 0 gave no smddp job id within {timeout:g}s (is rank 0 running, and does "
                f"it reach the same store? does every rank pass the same world_size? this rank's is {size})"
            )
        if now >= look:
            # No earlier attempt writes after us: another value is another live process of this rank.
            if store.get(ask) != mine:
                raise BootstrapError(
                    f"rank {rank}: another process asked for the smddp job as rank {rank} through the same "
                    "store: every process needs a rank of its own"
                )
            look = now + 0.2
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    word = _word(store.get(answer), "answer from rank 0")
    if "error" in word:
        raise BootstrapError(f"rank {rank}: {word['error']}")
    job_hex = str(word.get("job", ""))
    if not is_job_hex(job_hex):
        raise BootstrapError(f"rank {rank}: the store holds a malformed smddp job id {job_hex[:40]!r}")
    return job_hex


def _answer_job_id(
    store: KVStore, size: int, timeout: float, deadline: float, record: Mapping[str, Any]
) -> tuple[str, dict[str, Any]]:
    """Rank 0's side of agree_job: answer every rank, collect their records, write the job's table."""
    job_hex = secrets.token_hex(JOB_ID_SIZE)
    records: dict[int, Any] = {0: dict(record)}
    answered: dict[int, bytes] = {}
    pending = set(range(1, size))
    refusal = ""  # once set, what every rank that asks from then on is answered, and the table says
    pause = 0.001
    while pending:
        for r in sorted(pending):
            joined = f"{PREFIX}{job_hex}/joined/{r}"
            if store.check([joined]):
                records[r] = _word(store.get(joined), f"record of rank {r}")
                pending.discard(r)
            elif store.check([f"{PREFIX}ask/{r}"]):
                asked = store.get(f"{PREFIX}ask/{r}")
                if answered.get(r) == asked:
                    continue
                answered[r] = asked
                try:
                    question = json.loads(asked)
                    nonce, world = str(question["nonce"]), int(question["world"])
                except (ValueError, KeyError, TypeError):
                    continue  # not a question of this version of smddp's (nor of this attempt's)
                if world != size and not refusal:
                    refusal = (
                        f"rank {r} has a world of {world} ranks and rank 0 one of {size}: every rank must "
                        "pass the same world_size"
                    )
                word = {"error": refusal} if refusal else {"job": job_hex}
                store.set(f"{PREFIX}answer/{r}/{nonce}", json.dumps(word).encode())
                if refusal:
                    pending.discard(r)  # told: it will not join
        if pending and time.monotonic() > deadline:
            refusal = refusal or (
                f"rank(s) {_ranks(sorted(pending))} did not join the smddp job within {timeout:g}s "
                "(SMDDP_JOIN_TIMEOUT_S, or the group's timeout if shorter; do they reach the same store?)"
            )
            break
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    table: dict[str, Any] = {"error": refusal}
    if not refusal:
        ordered = [records[r] for r in range(size)]
        try:
            place_ranks(ordered, size)
            table = {"records": ordered}
        except BootstrapError as e:
            table = {"error": str(e)}
    store.set(f"{PREFIX}{job_hex}/table", json.dumps(table).encode())
    if "error" in table:
        raise BootstrapError(f"rank 0: {table['error']}")
    return job_hex, table


def join_through_store(
    store: KVStore, rank: int, size: int, timeout: float, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Collective over every rank of the job: place the ranks, start and bootstrap the daemons through
    `store`, under torchrun or any other launcher (it set LOCAL_RANK) or none (mp.spawn, a file:// or
    tcp:// init_method, a store passed in).

    Returns the SMDDP_ placement variables to join with (smddp.init's `env`). Raises BootstrapError
    naming the cause on every rank when the ranks cannot be placed or a daemon cannot start."""
    environ = os.environ if env is None else env
    record = rank_record(environ, size)
    daemon: DaemonChild | None = None
    error: SmddpError | None = None
    # Under a launcher a node's first worker knows its place at once: its daemon is started before the
    # job's id is agreed (or at import), so that its start-up overlaps the agreement. Its variables are
    # checked with every rank's in agree_job, which says what is wrong on every rank.
    guess = _torchrun_place(environ)
    if guess is not None and guess.local_rank == 0:
        try:
            daemon = _early.take(guess, environ) or DaemonChild(guess, environ)
        except SmddpError as e:
            error = e  # said under the node's key once there is a job to say it in
    try:
        job_hex, places = agree_job(store, rank, size, timeout, record)
    except BootstrapError:
        if daemon is not None:
            daemon.wait_exit(5.0)
        raise
    place = places[rank]
    if daemon is not None and daemon.place != place:  # the same rule on the same variables: never
        daemon.wait_exit(5.0)
        daemon = None
    if place.local_rank == 0 and daemon is None and error is None:
        try:
            daemon = DaemonChild(place, environ)
        except SmddpError as e:
            error = e
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
        word = _word(
            _get_raw(
                store,
                node_key,
                timeout,
                f"rank {rank}: the first worker of node {place.node} started no daemon",
            ),
            f"word for node {place.node}",
        )
        if not ("ok" in word or "error" in word):
            raise BootstrapError(
                f"rank {rank}: the store holds a malformed word for node {place.node}: {word!r:.80}"
            )
        if "error" in word:
            raise BootstrapError(f"rank {rank}: {word['error']}")
    return {**environ, **place.worker_env(job_hex)}
