"""The mutual challenge/hello/welcome handshake, run over bytes with no sockets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from smddp.errors import AuthenticationError, ProtocolError
from smddp.proto import HEADER_SIZE, Header, MsgType, Role, decode_header, encode_header
from smddp.proto import handshake as hs
from smddp.proto.frames import error_frame

SECRET = bytes(range(32))
JOB = b"job-0123456789ab"
assert len(JOB) == hs.JOB_ID_SIZE


def split(wire: bytes) -> tuple[Header, bytes]:
    h = decode_header(wire[:HEADER_SIZE])
    body = wire[HEADER_SIZE:]
    assert len(body) == h.length
    return h, body


def flip(b: bytes, i: int) -> bytes:
    return b[:i] + bytes([b[i] ^ 0x01]) + b[i + 1 :]


class Exchange:
    """One handshake, with every message kept so a test can tamper with any of them."""

    def __init__(self, role=Role.WORKER, rank=5, client_secret=SECRET, client_job=JOB):
        self.role, self.rank = role, rank
        self.client_secret, self.client_job = client_secret, client_job
        self.server_nonce = hs.new_nonce()
        self.client_nonce = hs.new_nonce()
        self.challenge = hs.challenge(JOB, self.server_nonce, sender=0)
        h, body = split(self.challenge)
        job, snonce = hs.parse_challenge(h, body)
        assert (job, snonce) == (JOB, self.server_nonce)
        self.hello = hs.hello(client_secret, client_job, role, rank, snonce, self.client_nonce)

    def server_verify(self, hello_wire: bytes | None = None) -> hs.Hello:
        h, body = split(self.hello if hello_wire is None else hello_wire)
        msg = hs.parse_hello(h, body)
        hs.verify_hello(SECRET, JOB, self.server_nonce, msg)
        return msg

    def client_verify(self, welcome_wire: bytes, secret: bytes = SECRET) -> None:
        h, body = split(welcome_wire)
        hs.verify_welcome(secret, JOB, self.server_nonce, self.client_nonce, self.role, self.rank, h, body)


def test_nonces_are_fresh():
    a, b = hs.new_nonce(), hs.new_nonce()
    assert len(a) == len(b) == hs.NONCE_SIZE
    assert a != b


@pytest.mark.parametrize(
    "role,rank", [(Role.WORKER, 0), (Role.WORKER, 7), (Role.DAEMON, 3), (Role.CONTROL, 2**32 - 1)]
)
def test_full_exchange(role, rank):
    ex = Exchange(role=role, rank=rank)
    msg = ex.server_verify()
    assert msg.role is role and msg.rank == rank
    assert msg.job_id == JOB and msg.nonce == ex.client_nonce
    assert len(msg.mac) == hs.MAC_SIZE
    w = hs.welcome(SECRET, JOB, ex.server_nonce, msg, sender=9)
    h, _ = split(w)
    assert h.type is MsgType.WELCOME and h.sender == 9
    ex.client_verify(w)


def test_wrong_secret():
    ex = Exchange(client_secret=bytes(32))
    with pytest.raises(AuthenticationError, match="secret"):
        ex.server_verify()


def test_wrong_job_id():
    ex = Exchange(client_job=b"another-job-id!!")
    with pytest.raises(AuthenticationError, match="another job"):
        ex.server_verify()


def test_hello_for_another_challenge_is_refused():
    """A HELLO answers one server nonce; replayed against a fresh challenge it must fail."""
    ex = Exchange()
    ex.server_verify()
    ex.server_nonce = hs.new_nonce()
    with pytest.raises(AuthenticationError):
        ex.server_verify()


@pytest.mark.parametrize("where", ["job", "nonce", "mac-first", "mac-last"])
def test_tampered_hello_body(where):
    ex = Exchange()
    start = {
        "job": HEADER_SIZE,
        "nonce": HEADER_SIZE + hs.JOB_ID_SIZE + 3,
        "mac-first": HEADER_SIZE + hs.JOB_ID_SIZE + hs.NONCE_SIZE,
        "mac-last": len(ex.hello) - 1,
    }[where]
    with pytest.raises(AuthenticationError):
        ex.server_verify(flip(ex.hello, start))


def _reheader(wire: bytes, **changes) -> bytes:
    h, body = split(wire)
    return encode_header(replace(h, **changes)) + body


@pytest.mark.parametrize("rank", [4, 6, 0, 5 + 2**16])
def test_tampered_rank(rank):
    ex = Exchange(rank=5)
    with pytest.raises(AuthenticationError):
        ex.server_verify(_reheader(ex.hello, sender=rank))


@pytest.mark.parametrize("role", [Role.DAEMON, Role.CONTROL])
def test_tampered_role(role):
    ex = Exchange(role=Role.WORKER)
    with pytest.raises(AuthenticationError):
        ex.server_verify(_reheader(ex.hello, aux=int(role)))


def test_unknown_role_is_a_protocol_error():
    ex = Exchange()
    with pytest.raises(ProtocolError, match="role"):
        ex.server_verify(_reheader(ex.hello, aux=99))


def test_welcome_wrong_secret():
    ex = Exchange()
    msg = ex.server_verify()
    forged = hs.welcome(bytes(32), JOB, ex.server_nonce, msg, sender=0)
    with pytest.raises(AuthenticationError):
        ex.client_verify(forged)
    good = hs.welcome(SECRET, JOB, ex.server_nonce, msg, sender=0)
    with pytest.raises(AuthenticationError):
        ex.client_verify(good, secret=bytes(32))


def test_welcome_bound_to_the_client():
    """A WELCOME made for another client (rank or nonce) does not verify."""
    ex = Exchange(rank=5)
    msg = ex.server_verify()
    for other in (replace(msg, rank=6), replace(msg, nonce=hs.new_nonce()), replace(msg, role=Role.DAEMON)):
        w = hs.welcome(SECRET, JOB, ex.server_nonce, other, sender=0)
        with pytest.raises(AuthenticationError):
            ex.client_verify(w)
    # and the client's MAC can not be reflected back as the server's
    h = Header(MsgType.WELCOME, length=hs.MAC_SIZE)
    with pytest.raises(AuthenticationError):
        hs.verify_welcome(SECRET, JOB, ex.server_nonce, ex.client_nonce, ex.role, ex.rank, h, msg.mac)


def test_tampered_welcome_mac():
    ex = Exchange()
    msg = ex.server_verify()
    w = hs.welcome(SECRET, JOB, ex.server_nonce, msg, sender=0)
    with pytest.raises(AuthenticationError):
        ex.client_verify(flip(w, HEADER_SIZE + 10))


def test_error_frame_during_handshake_is_authentication_error():
    h, body = split(error_frame("go away"))
    with pytest.raises(AuthenticationError, match="go away"):
        hs.parse_challenge(h, body)
    with pytest.raises(AuthenticationError, match="go away"):
        hs.parse_hello(h, body)


def test_wrong_message_or_size_is_protocol_error():
    ex = Exchange()
    h, body = split(ex.hello)
    with pytest.raises(ProtocolError):
        hs.parse_challenge(h, body)
    hc, bc = split(ex.challenge)
    with pytest.raises(ProtocolError):
        hs.parse_hello(hc, bc)
    with pytest.raises(ProtocolError):
        hs.parse_hello(h, body[:-1])
    with pytest.raises(ProtocolError):
        hs.parse_challenge(hc, bc + b"x")
