"""The connecting side of the handshake, shared by workers, dialing daemons and `smddp status`."""

from __future__ import annotations

import os

from smddp.errors import AuthenticationError
from smddp.proto import handshake as hs
from smddp.proto.frames import Role
from smddp.transport.conn import Connection


def client_handshake(
    conn: Connection, secret: bytes, job_id: bytes, role: Role, rank: int, timeout: float
) -> None:
    """Answer the server's CHALLENGE with our HELLO and check its WELCOME: both sides hold the secret."""
    h, body, fds = conn.recv_frame(timeout=timeout, max_length=hs.CHALLENGE_SIZE)
    for fd in fds:
        os.close(fd)
    their_job, server_nonce = hs.parse_challenge(h, body)
    if their_job != job_id:
        raise AuthenticationError(f"{conn.peer} belongs to another job")
    nonce = hs.new_nonce()
    conn.send([hs.hello(secret, job_id, role, rank, server_nonce, nonce)], timeout=timeout)
    h, body, _ = conn.recv_frame(timeout=timeout, max_length=hs.WELCOME_SIZE)
    hs.verify_welcome(secret, job_id, server_nonce, nonce, role, rank, h, body)
