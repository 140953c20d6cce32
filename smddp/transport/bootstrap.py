"""Job bootstrap: the daemons over their own MPI world (endpoints, the job secret); workers from the job description their daemon writes."""

from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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


# open_endpoint(node, job_id_hex, single_host) -> (tcp_host, tcp_port, socket_path)
OpenEndpoint = Callable[[int, str, bool], tuple[str, int, str]]


def bootstrap_daemons(open_endpoint: OpenEndpoint, local_size: int, job_id_hex: str = "") -> Membership:
    """Collective over the daemons' own MPI world (one daemon per node, node = MPI rank).

    The workers run in a world of their own (a separate mpirun), so that a script using MPI itself
    sees workers only, and a worker that never joins cannot hold the daemons in MPI. Workers find
    their node's daemon through the job description it writes (`job_description`, `join_job`).
    Errors are agreed collectively, so every daemon raises the same BootstrapError.
    """
    from mpi4py import MPI

    if local_size < 1:
        raise BootstrapError(f"every node needs at least one worker (got {local_size})")
    comm = MPI.COMM_WORLD
    me = (socket.gethostname(), os.getpid())
    everyone = comm.allgather(me)

    if comm.rank == 0:
        try:
            job_id = bytes.fromhex(job_id_hex) if job_id_hex else secrets.token_bytes(JOB_ID_SIZE)
            if len(job_id) != JOB_ID_SIZE:
                raise ValueError
            keys: tuple[bytes, bytes] | str = (job_id, secrets.token_bytes(SECRET_SIZE))
        except ValueError:
            keys = f"SMDDP_JOB_ID must be {JOB_ID_SIZE * 2} hex digits"
    else:
        keys = ""
    keys = comm.bcast(keys, root=0)
    if isinstance(keys, str):
        raise BootstrapError(keys)
    job_id, secret = keys
    _place_daemons(everyone)  # the same on every daemon, so the error is too
    node = comm.rank

    mine: tuple[str, int, str] | str
    try:
        mine = open_endpoint(node, job_id.hex(), len({h for h, _ in everyone}) == 1)
    except (OSError, SmddpError) as e:
        mine = f"daemon of node {node} on {socket.gethostname()} could not listen: {e}"
    published = comm.allgather(mine)
    failures = [p for p in published if isinstance(p, str)]
    if failures:
        raise BootstrapError("; ".join(failures))
    daemons = []
    for n, ((host, pid), ep) in enumerate(zip(everyone, published, strict=True)):
        assert isinstance(ep, tuple)
        daemons.append(Endpoint(n, host, pid, ep[0], ep[1], ep[2]))
    if not MPI.Is_finalized():
        # MPI is out of the data path from here on. Finalizing now, together, means no daemon later
        # blocks in MPI_Finalize at exit waiting for a peer that died, and mpirun sees a failing
        # daemon's exit status at once and tears the daemons down.
        MPI.Finalize()
    return Membership(make_job(job_id, secret, local_size, tuple(daemons)), Role.DAEMON, node, -1)


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
        names = (
            "SMDDP_JOB_ID",
            "SMDDP_RANK",
            "SMDDP_NODE",
            "SMDDP_LOCAL_RANK",
            "SMDDP_LOCAL_SIZE",
            "SMDDP_NNODES",
        )
        missing = [n for n in names if not env.get(n)]
        if missing:
            raise BootstrapError(
                f"{', '.join(missing)} not set: start the workers with smddp-launch -np W -- COMMAND"
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
