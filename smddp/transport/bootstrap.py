"""Job bootstrap over MPI: roles, node membership, daemon endpoints and the job secret; then MPI steps aside."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from smddp.errors import BootstrapError, SmddpError
from smddp.proto.frames import Role
from smddp.proto.handshake import JOB_ID_SIZE, SECRET_SIZE


@dataclass(frozen=True)
class Endpoint:
    """Where daemon `node` listens: TCP for the other daemons, a unix socket for its workers."""

    node: int
    world_rank: int
    host: str
    pid: int
    tcp_host: str
    tcp_port: int
    socket_path: str


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    node: int
    local_rank: int
    world_rank: int
    host: str
    pid: int


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

    def describe_rank(self, rank: int) -> str:
        w = self.workers[rank]
        return f"rank {rank} (node {w.node}, {w.host}, pid {w.pid})"


@dataclass(frozen=True)
class Membership:
    """What bootstrap tells one process: the job and its own place in it."""

    job: Job
    role: Role
    node: int
    rank: int  # worker rank, or -1 for a daemon


def _assign(everyone: list[tuple[int, str, int, int]]) -> tuple[list[tuple[int, int]], int, int]:
    """Map world ranks to (node, local index); every process computes the same answer."""
    hosts: dict[int, tuple[list[int], list[int]]] = {}
    for world_rank, (role, _host, host_key, _pid) in enumerate(everyone):
        daemons, workers = hosts.setdefault(host_key, ([], []))
        (daemons if role == Role.DAEMON else workers).append(world_rank)
    if not any(d for d, _ in hosts.values()):
        raise BootstrapError("no smddp-daemon in this job: start it with smddp-launch -np W -- COMMAND")
    place: list[tuple[int, int]] = [(-1, -1)] * len(everyone)
    node = 0
    local_size = -1
    for host_key in sorted(hosts):
        daemons, workers = hosts[host_key]
        host = everyone[host_key][1]
        if not daemons:
            raise BootstrapError(f"host {host} runs {len(workers)} workers but no smddp-daemon")
        if len(workers) % len(daemons):
            raise BootstrapError(
                f"host {host}: {len(workers)} workers cannot be split evenly among {len(daemons)} daemons"
            )
        per = len(workers) // len(daemons)
        if local_size not in (-1, per):
            raise BootstrapError(
                f"every node must run the same number of workers ({local_size} vs {per} on {host})"
            )
        local_size = per
        for d, wr in enumerate(sorted(daemons)):
            place[wr] = (node + d, -1)
        for i, wr in enumerate(sorted(workers)):
            place[wr] = (node + i // per, i % per)
        node += len(daemons)
    if local_size <= 0:
        raise BootstrapError("the job has no workers")
    return place, node, local_size


# open_endpoint(node, job_id_hex, single_host) -> (tcp_host, tcp_port, socket_path)
OpenEndpoint = Callable[[int, str, bool], tuple[str, int, str]]


def bootstrap(
    role: Role, open_endpoint: OpenEndpoint | None = None, job_id_hex: str = "", finalize: bool = True
) -> Membership:
    """Collective over MPI.COMM_WORLD: every daemon and worker of the job must call it.

    A daemon passes `open_endpoint`, called once its node is known. Errors are agreed collectively, so every process raises the same BootstrapError.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    host_key = shared.allreduce(comm.rank, op=MPI.MIN)
    shared.Free()
    me = (int(role), socket.gethostname(), host_key, os.getpid())
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

    place, nnodes, local_size = _assign(everyone)  # same on every process, so errors are too
    node, local = place[comm.rank]

    mine: tuple[str, int, str] | str | None = None
    if role == Role.DAEMON:
        assert open_endpoint is not None
        try:
            mine = open_endpoint(node, job_id.hex(), len({e[2] for e in everyone}) == 1)
        except (OSError, SmddpError) as e:
            mine = f"daemon of node {node} on {socket.gethostname()} could not listen: {e}"
    published = comm.allgather(mine)
    failures = [p for p in published if isinstance(p, str)]
    if failures:
        raise BootstrapError("; ".join(failures))

    daemons: list[Endpoint | None] = [None] * nnodes
    workers: list[WorkerInfo] = []
    for world_rank, (r, host, _key, pid) in enumerate(everyone):
        n, loc = place[world_rank]
        if r == Role.DAEMON:
            ep = published[world_rank]
            assert isinstance(ep, tuple)
            daemons[n] = Endpoint(n, world_rank, host, pid, ep[0], ep[1], ep[2])
        else:
            workers.append(WorkerInfo(n * local_size + loc, n, loc, world_rank, host, pid))
    workers.sort(key=lambda w: w.rank)
    if finalize and not MPI.Is_finalized():
        # MPI is out of the data path from here on. Finalizing now, together, means no process later
        # blocks in MPI_Finalize at exit waiting for a peer that died, and mpirun sees a failing
        # rank's exit status at once and tears the job down.
        MPI.Finalize()
    job = Job(job_id, secret, nnodes, local_size, tuple(d for d in daemons if d is not None), tuple(workers))
    rank = node * local_size + local if role == Role.WORKER else -1
    return Membership(job, role, node, rank)
