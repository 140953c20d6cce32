"""A failed job on the wire: the ERROR frame's "Name: reason" text, written and read in one place."""

from __future__ import annotations

from smddp.errors import (
    AuthenticationError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveStallError,
    PeerLostError,
    ProtocolError,
    SmddpError,
    TransportError,
)
from smddp.proto.frames import error_frame

# The classes an ERROR frame may name; anything else reads as a CollectiveError.
_BY_NAME: dict[str, type[SmddpError]] = {
    cls.__name__: cls
    for cls in (CollectiveError, CollectiveMismatchError, CollectiveStallError, PeerLostError, ProtocolError)
}


def wire_name(kind: type[SmddpError]) -> str:
    """The class a worker raises for a failed job: always a CollectiveError, the most specific one.

    A connection that ended or a stranger at the door (transport, authentication) is a lost peer.
    """
    for cls in (CollectiveMismatchError, CollectiveStallError, PeerLostError, CollectiveError):
        if issubclass(kind, cls):
            return cls.__name__
    if issubclass(kind, (AuthenticationError, TransportError)):
        return PeerLostError.__name__
    return CollectiveError.__name__


def failure_text(kind: type[SmddpError], reason: str) -> str:
    return f"{wire_name(kind)}: {reason}"


# An ERROR frame's `aux`: the cause's exit status + 1 in the low 16 bits (0: none), and this bit when
# the cause is the infrastructure (a process killed by a signal, a lost or silent daemon, peer, link
# or node) rather than the script (its own exit or exception, a collective mismatch, a bad frame from
# one of its ranks). smddp-launch restarts the first kind under --max-restarts (docs/reliability.md).
INFRA_BIT = 1 << 16


def failure_frame(
    kind: type[SmddpError],
    reason: str,
    sender: int = 0,
    exit_status: int | None = None,
    infra: bool = False,
) -> bytes:
    """The ERROR frame that tells a worker or a peer why the job failed.

    `exit_status`: the exit status of the rank whose end failed the job, when that is the cause and
    its status is known; it travels in `aux` as status + 1 (0: none), so that every rank's wrapper
    can end with the cause's status rather than its own consequence. `infra`: whether the cause is
    the infrastructure's (INFRA_BIT), so that every daemon reports the same cause to smddp-launch.
    """
    aux = 0 if exit_status is None else min(max(exit_status, 0), 255) + 1
    return error_frame(failure_text(kind, reason), sender=sender, aux=aux | (INFRA_BIT if infra else 0))


def exit_status_of(aux: int) -> int | None:
    """The cause's exit status an ERROR frame carries in `aux`, or None."""
    status = aux & 0xFFFF
    return status - 1 if 1 <= status <= 256 else None


def infra_of(aux: int) -> bool:
    """Whether an ERROR frame's `aux` says the cause is the infrastructure's."""
    return bool(aux & INFRA_BIT)


def infra_status(exit_status: int | None) -> bool:
    """Whether a rank's end is the infrastructure's doing: killed by a signal (128 + n), or gone
    without any status reported (its wrapper or node went with it); an exit status of its own is not."""
    return exit_status is None or exit_status > 128


def read_failure(text: str) -> tuple[type[SmddpError], str]:
    """An ERROR frame's text as (class, reason); text in no known form is a CollectiveError's reason."""
    name, sep, reason = text.partition(": ")
    cls = _BY_NAME.get(name) if sep else None
    if cls is None:
        return CollectiveError, text
    return cls, reason or text
