"""Job bootstrap: the daemons over a collective of their own (MPI, or a relay through torch's store); workers from the job description their daemon writes."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from smddp.errors import BootstrapError, SmddpError
from smddp.proto.frames import Role
from smddp.proto.handshake import JOB_ID_SIZE, SECRET_SIZE


@dataclass(frozen=True)
class Endpoint:
    """Where daemon `node` listens: TCP for the other daemons, a unix socket for its workers."""

    node: int
    host: str
    pid: int
    tcp_host: str
    tcp_port: int
    socket_path: str


@dataclass(frozen=True)
class WorkerInfo:
    """A rank's place. Its pid is known to its own daemon alone, once it connects (SO_PEERCRED)."""

    rank: int
    node: int
    local_rank: int
    host: str


@dataclass(frozen=True)
class Job:
    """Everything every process knows about the job after bootstrap; identical on all of them."""

    job_id: bytes
    secret: bytes = field(repr=False)
    nnodes: int
    local_size: int
    daemons: tuple[Endpoint, ...]
    workers: tuple[WorkerInfo, ...]

    def __repr__(self) -> str:  # the secret must never reach a log line
        return f"Job(id={self.job_id.hex()}, nodes={self.nnodes}, local_size={self.local_size})"

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def job_hex(self) -> str:
        return self.job_id.hex()

    def ranks_of(self, node: int) -> range:
        return range(node * self.local_size, (node + 1) * self.local_size)

    def describe_node(self, node: int) -> str:
        d = self.daemons[node]
        r = self.ranks_of(node)
        ranks = f"rank {r.start}" if len(r) == 1 else f"ranks {r.start}-{r.stop - 1}"
        return f"node {node} ({d.host}, {ranks})"

    def describe_rank(self, rank: int, pid: int = 0) -> str:
        w = self.workers[rank]
        return f"rank {rank} (node {w.node}, {w.host}" + (f", pid {pid})" if pid else ")")


@dataclass(frozen=True)
class Membership:
    """What bootstrap tells one process: the job and its own place in it."""

    job: Job
    role: Role
    node: int
    rank: int  # worker rank, or -1 for a daemon


def _place_daemons(everyone: list[tuple[str, int]]) -> None:
    """Check the daemons' world: at most one daemon per host, unless every daemon is on one host
    (--local-nodes simulates nodes there). Every daemon computes the same answer."""
    hosts = [h for h, _ in everyone]
    if len(set(hosts)) not in (1, len(hosts)):
        doubled = sorted({h for h in hosts if hosts.count(h) > 1})
        raise BootstrapError(
            f"{', '.join(doubled)} run several smddp-daemons in a job of several hosts: one daemon per host"
        )


class DaemonComm(Protocol):
    """The daemons' collective for bootstrap, over JSON values: MPI's world under smddp-launch
    (`MpiComm`), a relay through the workers' key-value store under torchrun (transport/relay.py)."""

    rank: int
    size: int

    def allgather(self, value: Any) -> list[Any]: ...

    def bcast(self, value: Any, root: int) -> Any: ...

    def close(self) -> None:
        """The bootstrap is over: nothing more is exchanged this way."""

    def abort(self, why: str) -> None:
        """The bootstrap failed here with `why` (said to whoever else should know)."""


class MpiComm:
    """The daemons' own MPI world (smddp-launch starts them with mpirun; node = MPI rank).

    The workers run in a world of their own (a separate mpirun), so that a script using MPI itself
    sees workers only, and a worker that never joins cannot hold the daemons in MPI.
    """

    def __init__(self) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = MPI.COMM_WORLD
        self.rank = int(self._comm.rank)
        self.size = int(self._comm.size)

    def allgather(self, value: Any) -> list[Any]:
        return list(self._comm.allgather(value))

    def bcast(self, value: Any, root: int) -> Any:
        return self._comm.bcast(value, root=root)

    def abort(self, why: str) -> None:
        pass  # the daemon's exit status is mpirun's word, and its log line says why

    def close(self) -> None:
        if not self._mpi.Is_finalized():
            # MPI is out of the data path from here on. Finalizing now, together, means no daemon later
            # blocks in MPI_Finalize at exit waiting for a peer that died, and mpirun sees a failing
            # daemon's exit status at once and tears the daemons down.
            self._mpi.Finalize()


# open_endpoint(node, job_id_hex, single_host) -> (tcp_host, tcp_port, socket_path)
OpenEndpoint = Callable[[int, str, bool], tuple[str, int, str]]

#: A secret file holds at least this many bytes: the job's secret is derived from it (and a short
#: one could be guessed from the fingerprint the daemons compare at bootstrap).
SECRET_FILE_MIN_BYTES = 32


def read_secret_file(path: str) -> bytes:
    """The contents of a user's secret file (--secret-file), refused unless only its owner, this
    user, can read it and it holds at least SECRET_FILE_MIN_BYTES bytes (as ssh treats a key)."""
    # Symbolic links are followed (a Kubernetes Secret's files are links into its ..data directory):
    # what counts is the file read, whose owner and mode fstat gives.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise BootstrapError(f"cannot read the secret file {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise BootstrapError(
                f"the secret file {path} must be a regular file of uid {os.getuid()} that only its owner "
                f"can read (chmod 600; it is mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})"
            )
        data = f.read(1 << 16)
    if len(data) < SECRET_FILE_MIN_BYTES:
        raise BootstrapError(
            f"the secret file {path} holds {len(data)} bytes; at least {SECRET_FILE_MIN_BYTES} are needed "
            "(head -c 32 /dev/urandom > FILE)"
        )
    return data


def job_secret(user_secret: bytes, job_id: bytes) -> bytes:
    """The job's secret from a user's secret file: a different one per job (SHA-256, domain-separated)."""
    return hashlib.sha256(b"smddp job secret\0" + job_id + user_secret).digest()


def _fingerprint(secret: bytes) -> str:
    """What the daemons compare to see they derived the same secret (says nothing usable about it)."""
    return hashlib.sha256(b"smddp secret fingerprint\0" + secret).hexdigest()[:16]


def _endpoint(value: Any, node: int) -> tuple[str, int, str, str]:
    """A published endpoint, checked: it may come through an unauthenticated store (torchrun's)."""
    if isinstance(value, list) and len(value) == 4:
        host, port, path, fp = value
        if (
            isinstance(host, str)
            and isinstance(port, int)
            and 0 < port < 65536
            and isinstance(path, str)
            and isinstance(fp, str)
        ):
            return host, port, path, fp
    raise BootstrapError(f"node {node}'s daemon published a malformed endpoint: {value!r:.200}")


def bootstrap_daemons(
    comm: DaemonComm,
    open_endpoint: OpenEndpoint,
    local_size: int,
    job_id_hex: str = "",
    user_secret: bytes | None = None,
) -> Membership:
    """Collective over the daemons' `comm` (one daemon per node, node = its rank there).

    Workers find their node's daemon through the job description it writes (`job_description`,
    `join_job`). Errors are agreed collectively, so every daemon raises the same BootstrapError.
    With `user_secret` (--secret-file, the same file on every node) the job's secret is derived from
    it and never sent; otherwise daemon 0 makes one and sends it over `comm`.
    """
    try:
        me = _bootstrap(comm, open_endpoint, local_size, job_id_hex, user_secret)
    except BootstrapError as e:
        comm.abort(str(e))
        raise
    comm.close()
    return me


def _bootstrap(
    comm: DaemonComm,
    open_endpoint: OpenEndpoint,
    local_size: int,
    job_id_hex: str,
    user_secret: bytes | None,
) -> Membership:
    if local_size < 1:
        raise BootstrapError(f"every node needs at least one worker (got {local_size})")
    everyone_raw = comm.allgather([socket.gethostname(), os.getpid()])
    try:
        everyone = [(str(h), int(p)) for h, p in everyone_raw]
    except (TypeError, ValueError):
        raise BootstrapError(f"a daemon published a malformed identity: {everyone_raw!r:.200}") from None

    keys: list[str] | str = ""
    if comm.rank == 0:
        try:
            job_id = bytes.fromhex(job_id_hex) if job_id_hex else secrets.token_bytes(JOB_ID_SIZE)
            if len(job_id) != JOB_ID_SIZE:
                raise ValueError
            made = "" if user_secret is not None else secrets.token_bytes(SECRET_SIZE).hex()
            keys = [job_id.hex(), made]
        except ValueError:
            keys = f"SMDDP_JOB_ID must be {JOB_ID_SIZE * 2} hex digits"
    keys = comm.bcast(keys, 0)
    if isinstance(keys, str):
        raise BootstrapError(keys)
    try:
        job_id, secret = bytes.fromhex(keys[0]), bytes.fromhex(keys[1])
        if len(job_id) != JOB_ID_SIZE or len(secret) not in (0, SECRET_SIZE):
            raise ValueError
    except (TypeError, ValueError, IndexError):
        raise BootstrapError(f"daemon 0 sent a malformed job id or secret: {keys!r:.80}") from None
    _place_daemons(everyone)  # the same on every daemon, so the error is too
    node = comm.rank

    # From here a problem of one daemon is published in the allgather instead of raised, so that
    # every daemon raises the same error rather than some waiting for the others.
    mine: list[Any] | str
    if user_secret is not None:
        secret = job_secret(user_secret, job_id)
    if not secret:
        mine = f"node {node} has no --secret-file but node 0 has one: give every node the same"
    else:
        try:
            host, port, path = open_endpoint(node, job_id.hex(), len({h for h, _ in everyone}) == 1)
            mine = [host, port, path, _fingerprint(secret)]
        except (OSError, SmddpError) as e:
            mine = f"daemon of node {node} on {socket.gethostname()} could not listen: {e}"
    published = comm.allgather(mine)
    failures = [p for p in published if isinstance(p, str)]
    if failures:
        raise BootstrapError("; ".join(failures))
    endpoints = [_endpoint(ep, n) for n, ep in enumerate(published)]
    differ = [n for n, ep in enumerate(endpoints) if ep[3] != endpoints[0][3]]
    if differ:
        raise BootstrapError(
            f"the job's secret differs between node 0 and node(s) {', '.join(map(str, differ))}: "
            "give every node the same --secret-file (or none)"
        )
    daemons = tuple(
        Endpoint(n, host, pid, ep[0], ep[1], ep[2])
        for n, ((host, pid), ep) in enumerate(zip(everyone, endpoints, strict=True))
    )
    return Membership(make_job(job_id, secret, local_size, daemons), Role.DAEMON, node, -1)


def make_job(job_id: bytes, secret: bytes, local_size: int, daemons: tuple[Endpoint, ...]) -> Job:
    """The job of `daemons`, each with `local_size` workers: ranks are contiguous per node."""
    workers = tuple(
        WorkerInfo(n * local_size + i, n, i, d.host) for n, d in enumerate(daemons) for i in range(local_size)
    )
    return Job(job_id, secret, len(daemons), local_size, daemons, workers)


# -- how a worker finds its daemon: the job description in the daemon's private directory --------

JOB_FILE = "job.json"
SECRET_FILE = "secret"


def default_socket_dir() -> str:
    """Per-user parent of the jobs' private socket directories (the same for a node's daemon and workers)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"smddp-{os.getuid()}")


def job_dir(socket_dir: str, job_hex: str, node: int) -> str:
    """The private (0700) directory of node `node`'s daemon: its unix socket, secret and job.json."""
    return os.path.join(socket_dir, f"job-{job_hex}-n{node}")


def job_dirs(socket_dir: str, job_hex: str) -> list[str]:
    """The directories of job `job_hex`'s daemons that exist under `socket_dir` (named by job_dir)."""
    try:
        names = os.listdir(socket_dir)
    except OSError:
        return []
    found = []
    for name in sorted(names):
        job, sep, node = name.removeprefix("job-").rpartition("-n")
        if name.startswith("job-") and sep and job == job_hex and node.isdigit():
            found.append(os.path.join(socket_dir, name))
    return found


def job_description(job: Job, node: int) -> dict:
    """What job.json holds: enough for `smddp status` and for a worker to join (never the secret)."""
    d = job.daemons[node]
    return {
        "job": job.job_hex,
        "node": node,
        "nnodes": job.nnodes,
        "local_size": job.local_size,
        "host": d.host,
        "pid": d.pid,
        "started": time.time(),
        "socket": d.socket_path,
        "daemons": [[e.host, e.pid, e.tcp_host, e.tcp_port, e.socket_path] for e in job.daemons],
    }


def job_from_description(info: dict, secret: bytes) -> Job:
    """The inverse of `job_description` (plus the secret, kept in a file of its own)."""
    try:
        daemons = tuple(
            Endpoint(n, str(h), int(p), str(th), int(tp), str(sp))
            for n, (h, p, th, tp, sp) in enumerate(info["daemons"])
        )
        job = make_job(bytes.fromhex(info["job"]), secret, int(info["local_size"]), daemons)
    except (KeyError, TypeError, ValueError) as e:
        raise BootstrapError(f"the daemon's job description is malformed: {e!r}") from None
    if len(secret) != SECRET_SIZE or len(job.job_id) != JOB_ID_SIZE or job.nnodes != int(info["nnodes"]):
        raise BootstrapError("the daemon's job description is malformed")
    return job


def read_job(directory: str) -> Job | None:
    """The job a daemon described in `directory`, or None while it has not yet written it.

    job.json is written last and renamed into place, so once it is there the secret is too.
    """
    try:
        with open(os.path.join(directory, JOB_FILE)) as f:
            info = json.load(f)
        with open(os.path.join(directory, SECRET_FILE), "rb") as f:
            secret = f.read()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise BootstrapError(f"cannot read the job description in {directory}: {e}") from None
    return job_from_description(info, secret)


#: The variables that say where smddp-launch (or, under torchrun, the backend) put a worker.
PLACEMENT_VARS = (
    "SMDDP_JOB_ID",
    "SMDDP_RANK",
    "SMDDP_NODE",
    "SMDDP_LOCAL_RANK",
    "SMDDP_LOCAL_SIZE",
    "SMDDP_NNODES",
)


@dataclass(frozen=True)
class Placement:
    """Where smddp-launch put one worker (exported to it as SMDDP_RANK, SMDDP_NODE, ...)."""

    job_hex: str
    rank: int
    node: int
    local_rank: int
    local_size: int
    nnodes: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Placement:
        missing = [n for n in PLACEMENT_VARS if not env.get(n)]
        if missing:
            raise BootstrapError(
                f"{', '.join(missing)} not set: start the workers with smddp-launch -np W -- COMMAND, "
                "or under torchrun join with torch.distributed.init_process_group('smddp'), which starts "
                "smddp through torch's store"
            )
        try:
            p = cls(
                env["SMDDP_JOB_ID"],
                int(env["SMDDP_RANK"]),
                int(env["SMDDP_NODE"]),
                int(env["SMDDP_LOCAL_RANK"]),
                int(env["SMDDP_LOCAL_SIZE"]),
                int(env["SMDDP_NNODES"]),
            )
        except ValueError as e:
            raise BootstrapError(f"a malformed SMDDP_ variable: {e}") from None
        if not (0 <= p.local_rank < p.local_size and 0 <= p.node < p.nnodes):
            raise BootstrapError(f"inconsistent smddp placement {p}")
        if p.rank != p.node * p.local_size + p.local_rank:
            raise BootstrapError(f"inconsistent smddp placement {p}")
        return p


def wait_for_job(directory: str, timeout: float, who: str, node: int) -> Job:
    """The job described in `directory`, once its daemon has written it (polled, at most `timeout` s)."""
    deadline = time.monotonic() + timeout
    while True:
        job = read_job(directory)
        if job is not None:
            return job
        if time.monotonic() > deadline:
            raise BootstrapError(
                f"{who}: the smddp-daemon of node {node} did not start within {timeout:g}s "
                f"(nothing in {directory}); see the daemons' log lines above"
            )
        time.sleep(0.02)


def join_job(place: Placement, directory: str, timeout: float) -> Membership:
    """A worker's bootstrap: wait (at most `timeout` s) for its node's daemon to describe the job
    in `directory` (`job_dir`).

    No MPI: the workers' own world is the user's. Only processes of the job's user can read the
    description (0600 files in a 0700 directory), and the daemon still checks the secret's proof.
    """
    job = wait_for_job(directory, timeout, f"rank {place.rank}", place.node)
    if job.nnodes != place.nnodes or job.local_size != place.local_size:
        raise BootstrapError(
            f"rank {place.rank}: the daemons run {job.nnodes} nodes x {job.local_size} workers, but this "
            f"worker was started for {place.nnodes} x {place.local_size}"
        )
    return Membership(job, Role.WORKER, place.node, place.rank)
