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
