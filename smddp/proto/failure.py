"""A failed job on the wire: the ERROR frame's "Name: reason" text, written and read in one place."""

from __future__ import annotations

from smddp.errors import (
    AuthenticationError,
    CollectiveError,
    CollectiveMismatchError,
    PeerLostError,
    ProtocolError,
    SmddpError,
    TransportError,
)
from smddp.proto.frames import error_frame

# The classes an ERROR frame may name; anything else reads as a CollectiveError.
_BY_NAME: dict[str, type[SmddpError]] = {
    cls.__name__: cls for cls in (CollectiveError, CollectiveMismatchError, PeerLostError, ProtocolError)
}


def wire_name(kind: type[SmddpError]) -> str:
    """The class a worker raises for a failed job: always a CollectiveError, the most specific one.

    A connection that ended or a stranger at the door (transport, authentication) is a lost peer.
    """
    for cls in (CollectiveMismatchError, PeerLostError, CollectiveError):
        if issubclass(kind, cls):
            return cls.__name__
    if issubclass(kind, (AuthenticationError, TransportError)):
        return PeerLostError.__name__
    return CollectiveError.__name__


def failure_text(kind: type[SmddpError], reason: str) -> str:
    return f"{wire_name(kind)}: {reason}"


def failure_frame(kind: type[SmddpError], reason: str, sender: int = 0) -> bytes:
    """The ERROR frame that tells a worker or a peer why the job failed."""
    return error_frame(failure_text(kind, reason), sender=sender)


def read_failure(text: str) -> tuple[type[SmddpError], str]:
    """An ERROR frame's text as (class, reason); text in no known form is a CollectiveError's reason."""
    name, sep, reason = text.partition(": ")
    cls = _BY_NAME.get(name) if sep else None
    if cls is None:
        return CollectiveError, text
    return cls, reason or text
