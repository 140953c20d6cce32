"""The mutual challenge-response handshake that proves both ends hold the job's secret."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

from smddp.errors import AuthenticationError, ProtocolError
from smddp.proto.frames import Header, MsgType, Role, encode_header

JOB_ID_SIZE = 16
NONCE_SIZE = 32
MAC_SIZE = 32
SECRET_SIZE = 32


def is_job_hex(text: str) -> bool:
    """Whether `text` spells a job id: JOB_ID_SIZE bytes as lowercase hex digits."""
    return len(text) == 2 * JOB_ID_SIZE and all(c in "0123456789abcdef" for c in text)


_CHALLENGE = struct.Struct(f"<{JOB_ID_SIZE}s{NONCE_SIZE}s")
_HELLO = struct.Struct(f"<{JOB_ID_SIZE}s{NONCE_SIZE}s{MAC_SIZE}s")
_WELCOME = struct.Struct(f"<{MAC_SIZE}s")
HELLO_SIZE = _HELLO.size
CHALLENGE_SIZE = _CHALLENGE.size
WELCOME_SIZE = _WELCOME.size


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"|" + b"|".join(parts), hashlib.sha256).digest()


def _ident(role: Role, rank: int) -> bytes:
    return struct.pack("<BI", int(role), rank)


# -- server side (the one that accepted the connection) speaks first -------------------------


def challenge(job_id: bytes, nonce: bytes, sender: int) -> bytes:
    """CHALLENGE: the server's job id and a fresh nonce."""
    body = _CHALLENGE.pack(job_id, nonce)
    return encode_header(Header(MsgType.CHALLENGE, sender=sender, length=len(body))) + body


def parse_challenge(h: Header, body: bytes) -> tuple[bytes, bytes]:
    _expect(h, MsgType.CHALLENGE, _CHALLENGE.size, body)
    job_id, nonce = _CHALLENGE.unpack(body)
    return job_id, nonce


@dataclass(frozen=True)
class Hello:
    """What a client claims: its role and rank, proven by a MAC over both nonces."""

    role: Role
    rank: int
    job_id: bytes
    nonce: bytes
    mac: bytes


def hello(secret: bytes, job_id: bytes, role: Role, rank: int, server_nonce: bytes, nonce: bytes) -> bytes:
    """HELLO: the client's role, rank, nonce, and proof that it holds the secret."""
    mac = _mac(secret, b"client", server_nonce, nonce, _ident(role, rank), job_id)
    body = _HELLO.pack(job_id, nonce, mac)
    return encode_header(Header(MsgType.HELLO, sender=rank, aux=int(role), length=len(body))) + body


def parse_hello(h: Header, body: bytes) -> Hello:
    _expect(h, MsgType.HELLO, _HELLO.size, body)
    try:
        role = Role(h.aux)
    except ValueError:
        raise ProtocolError(f"HELLO: unknown role {h.aux}") from None
    job_id, nonce, mac = _HELLO.unpack(body)
    return Hello(role=role, rank=h.sender, job_id=job_id, nonce=nonce, mac=mac)


def verify_hello(secret: bytes, job_id: bytes, server_nonce: bytes, msg: Hello) -> None:
    """Raise AuthenticationError unless the client proved the job's secret for this exact exchange."""
    if not hmac.compare_digest(msg.job_id, job_id):
        raise AuthenticationError("peer belongs to another job")
    want = _mac(secret, b"client", server_nonce, msg.nonce, _ident(msg.role, msg.rank), job_id)
    if not hmac.compare_digest(want, msg.mac):
        raise AuthenticationError("peer does not hold the job secret")


def welcome(secret: bytes, job_id: bytes, server_nonce: bytes, client: Hello, sender: int) -> bytes:
    """WELCOME: the server's own proof, so the client knows it reached the real daemon."""
    mac = _mac(secret, b"server", client.nonce, server_nonce, _ident(client.role, client.rank), job_id)
    body = _WELCOME.pack(mac)
    return encode_header(Header(MsgType.WELCOME, sender=sender, length=len(body))) + body


def verify_welcome(
    secret: bytes,
    job_id: bytes,
    server_nonce: bytes,
    nonce: bytes,
    role: Role,
    rank: int,
    h: Header,
    body: bytes,
) -> None:
    _expect(h, MsgType.WELCOME, _WELCOME.size, body)
    (mac,) = _WELCOME.unpack(body)
    want = _mac(secret, b"server", nonce, server_nonce, _ident(role, rank), job_id)
    if not hmac.compare_digest(want, mac):
        raise AuthenticationError("daemon failed to prove the job secret")


def _expect(h: Header, t: MsgType, size: int, body: bytes) -> None:
    if h.type is MsgType.ERROR:
        raise AuthenticationError(f"peer refused the handshake: {body.decode('utf-8', 'replace')}")
    if h.type is not t:
        raise ProtocolError(f"handshake: expected {t.name}, got {h.type.name}")
    if len(body) != size:
        raise ProtocolError(f"handshake: {t.name} body must be {size} bytes, got {len(body)}")
