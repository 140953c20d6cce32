"""A client with no daemon process behind it: its connection's other end is the test's (a socketpair)."""

from __future__ import annotations

import socket

from smddp.client.session import Client, ClientConfig
from smddp.proto.frames import Role
from smddp.transport.bootstrap import Endpoint, Job, Membership, WorkerInfo
from smddp.transport.conn import Connection


def lonely_client(**config: object) -> tuple[Client, socket.socket]:
    """Rank 0 of a one-rank job (`config` overriding the client's settings), and the daemon's end of
    its connection, on which the client has already sent its CHANNEL (the rings:
    smddp_rigs._engine_testing.DaemonChannel reads and answers them)."""
    job = Job(
        job_id=b"j" * 16,
        secret=b"s" * 32,
        nnodes=1,
        local_size=1,
        daemons=(Endpoint(0, "host", 1, "127.0.0.1", 1, "/nonexistent"),),
        workers=(WorkerInfo(0, 0, 0, "host"),),
    )
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    cfg = ClientConfig(timeout_s=5.0, arena_bytes=1 << 20, heartbeat_timeout_s=60.0, **config)  # type: ignore[arg-type]
    return Client(cfg, Membership(job, Role.WORKER, 0, 0), Connection(ours, "the daemon")), theirs
