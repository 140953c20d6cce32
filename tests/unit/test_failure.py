"""The ERROR frame's text: what the daemon writes is what the client and a peer read back."""

from __future__ import annotations

import pytest

from smddp.errors import (
    AuthenticationError,
    CollectiveError,
    CollectiveMismatchError,
    ConfigError,
    PeerLostError,
    ProtocolError,
)
from smddp.proto.failure import failure_frame, failure_text, read_failure, wire_name
from smddp.proto.frames import HEADER_SIZE, MsgType, decode_header
from smddp.transport.conn import ConnectionClosed


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        (CollectiveMismatchError, CollectiveMismatchError),
        (PeerLostError, PeerLostError),
        (CollectiveError, CollectiveError),
        (ConnectionClosed, PeerLostError),  # a connection that ended mid-job is a lost peer
        (AuthenticationError, PeerLostError),
        (ProtocolError, CollectiveError),
        (ConfigError, CollectiveError),
    ],
)
def test_every_cause_reads_back_as_a_collective_error(kind, named):
    assert wire_name(kind) == named.__name__
    cls, reason = read_failure(failure_text(kind, "node 1: gone: really"))
    assert cls is named and reason == "node 1: gone: really"
    assert issubclass(cls, CollectiveError) or cls is ProtocolError


def test_frame_and_unknown_text():
    frame = failure_frame(PeerLostError, "rank 3 exited", sender=2)
    h = decode_header(frame[:HEADER_SIZE])
    assert (h.type, h.sender) == (MsgType.ERROR, 2)
    assert read_failure(frame[HEADER_SIZE:].decode()) == (PeerLostError, "rank 3 exited")
    assert read_failure("Whatever: x") == (CollectiveError, "Whatever: x")
    assert read_failure("no name here") == (CollectiveError, "no name here")


@pytest.mark.parametrize("status", [None, 0, 1, 3, 137, 255, 300, -5])
def test_the_causes_exit_status_travels_in_aux(status):
    """aux = status + 1 (0: none), clamped to a shell status; old readers ignore it."""
    from smddp.proto.failure import exit_status_of

    frame = failure_frame(PeerLostError, "rank 1 died", sender=2, exit_status=status)
    h = decode_header(frame[:HEADER_SIZE])
    want = None if status is None else min(max(status, 0), 255)
    assert exit_status_of(h.aux) == want
    assert read_failure(frame[HEADER_SIZE:].decode()) == (PeerLostError, "rank 1 died")
    assert exit_status_of(0) is None and exit_status_of(257) is None


def test_a_raised_again_error_keeps_the_causes_status():
    from smddp.errors import fresh

    err = PeerLostError("rank 1 died")
    err.exit_status = 3
    again = fresh(err)
    assert again is not err and type(again) is PeerLostError and again.exit_status == 3
    assert str(again) == "rank 1 died" and fresh(ProtocolError("x")).args == ("x",)


@pytest.mark.parametrize("status", [None, 1, 137])
@pytest.mark.parametrize("infra", [False, True])
def test_the_causes_kind_travels_in_aux_beside_its_status(status, infra):
    """INFRA_BIT says the cause is the infrastructure's; the status reads the same either way."""
    from smddp.proto.failure import INFRA_BIT, exit_status_of, infra_of

    frame = failure_frame(PeerLostError, "node 1 silent", sender=0, exit_status=status, infra=infra)
    h = decode_header(frame[:HEADER_SIZE])
    assert infra_of(h.aux) is infra and bool(h.aux & INFRA_BIT) is infra
    assert exit_status_of(h.aux) == status


def test_which_ends_are_the_infrastructures():
    """A rank killed by a signal, or gone with no status at all, is; an exit status of its own is not."""
    from smddp.proto.failure import infra_status

    assert infra_status(None) and infra_status(137) and infra_status(143)
    assert not infra_status(0) and not infra_status(1) and not infra_status(128)


def test_a_raised_again_error_keeps_its_cause():
    from smddp.errors import fresh

    err = PeerLostError("rank 1: lost the node daemon")
    err.infra = True
    assert fresh(err).infra and not fresh(PeerLostError("x")).infra
