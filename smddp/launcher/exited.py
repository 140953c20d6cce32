"""EXITED: the launcher's wrapper tells a daemon that its worker ended without joining the job."""

from __future__ import annotations

import socket
import time

from smddp.errors import BootstrapError
from smddp.proto.frames import Role
from smddp.proto.messages import Bye, Exited
from smddp.transport.auth import client_handshake
from smddp.transport.bootstrap import default_socket_dir, job_dir, wait_for_job
from smddp.transport.conn import Connection


def report_exited(
    job_hex: str, node: int, rank: int, status: int, timeout: float, torn_down: bool = False
) -> None:
    """Wait (at most `timeout` s) for node `node`'s daemon, then say that `rank` ended with `status`
    (`torn_down`: because its wrapper was told to end; the handshake then gets 2 s, as the daemon may
    be going down with the job).

    The wrapper runs as the job's user on the daemon's host, so it reads the job's secret where
    the worker would have, and proves it in the handshake like any control client.
    """
    deadline = time.monotonic() + timeout
    job = wait_for_job(job_dir(default_socket_dir(), job_hex, node), timeout, f"rank {rank}'s wrapper", node)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        sock.connect(job.daemons[node].socket_path)
    except OSError as e:
        sock.close()
        raise BootstrapError(f"cannot reach the daemon of node {node}: {e}") from None
    conn = Connection(sock, f"the daemon of node {node}")
    try:
        client_handshake(conn, job.secret, job.job_id, Role.CONTROL, rank, 2.0 if torn_down else 10.0)
        conn.send(
            [
                Exited(rank, min(max(status, 0), 255), torn_down).header().encode(),
                Bye(rank).header().encode(),
            ],
            timeout=5.0,
        )
    finally:
        conn.close()
