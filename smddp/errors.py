"""The one hierarchy of errors that smddp raises; every layer translates into these."""

from __future__ import annotations


class SmddpError(Exception):
    """Base of every error smddp raises on purpose."""


class ConfigError(SmddpError, ValueError):
    """A configuration value (flag, environment variable) is invalid."""


class BootstrapError(SmddpError):
    """The job could not be set up: MPI bootstrap, roles, node layout."""


class BootstrapCancelled(BootstrapError):
    """A daemon started ahead of its job (under torchrun, at `import smddp.torch`) was never given one:
    the worker that started it ended, or chose to start another. Not a failure: the daemon just ends."""


class ProtocolError(SmddpError):
    """A frame on the wire broke the protocol (bad magic, version, field out of bounds)."""


class AuthenticationError(SmddpError):
    """A peer failed the handshake: wrong job, wrong secret, wrong user."""


class InvalidArgumentError(SmddpError, ValueError):
    """A public call got an argument it cannot take; nothing was sent."""


class UnsupportedBufferError(InvalidArgumentError, TypeError):
    """A buffer is of a type, dtype or layout smddp does not handle; nothing was sent."""


class NotInitializedError(SmddpError, RuntimeError):
    """A call was made before smddp.init() or after smddp.shutdown()."""


class TransportError(SmddpError, ConnectionError):
    """A connection ended, broke or went silent. Whether that fails the job is for the layer above to
    say: a peer's end of stream after its BYE is the normal end, before it a PeerLostError."""


class CollectiveError(SmddpError, RuntimeError):
    """The job has FAILED; every pending and later collective raises this with the cause."""

    #: The exit status of the rank whose end failed the job, when that was the cause and its status
    #: is known (its launcher wrapper reported it); smddp-launch's wrappers then end every failed rank
    #: with it, so the job's exit status is the cause's, not a consequence's.
    exit_status: int | None = None
    #: Whether the cause is the infrastructure's (a process killed by a signal, a lost or silent
    #: daemon, peer, link or node) rather than the script's own; smddp-launch restarts the job for
    #: such a cause under --max-restarts (docs/reliability.md).
    infra: bool = False


def fresh(err: SmddpError) -> SmddpError:
    """A new instance of `err` to raise again (its own traceback), keeping what it carries."""
    again = type(err)(str(err))
    if isinstance(err, CollectiveError) and isinstance(again, CollectiveError):
        again.exit_status = err.exit_status
        again.infra = err.infra
    return again


class CollectiveMismatchError(CollectiveError):
    """Ranks issued different collectives at the same sequence number."""


class PeerLostError(CollectiveError):
    """A worker, a daemon or a link went away in the middle of the job."""


class CollectiveStallError(CollectiveError):
    """A collective waited past the stall limit (--stall-timeout) for ranks that never submitted it."""


class CollectiveTimeoutError(SmddpError, TimeoutError):
    """A blocking call ran past its timeout; the job itself is still usable.

    Every message says "Timed out" as gloo's does ("Timed out waiting 1000ms for ..."), which is what
    torch's own callers look for in a timed-out collective's error (its test suite matches
    " (Timed out|closed|timeout) "): `waiting` words a collective's; any other is prefixed."""

    PREFIX = "smddp: Timed out"

    def __init__(self, message: str = "", *args: object) -> None:
        if not message.startswith(self.PREFIX):
            message = f"{self.PREFIX} - {message}"
        super().__init__(message, *args)

    @classmethod
    def waiting(cls, seconds: float, what: str) -> CollectiveTimeoutError:
        """The error of a wait of `seconds` for collective `what` that is still in flight."""
        return cls(f"{cls.PREFIX} waiting {seconds * 1000:g}ms for {what}; it is still in flight")


class DeviceError(SmddpError, RuntimeError):
    """A device (GPU) runtime call failed: a copy, an event, a stream, pinning host memory."""


class GraphCaptureError(DeviceError):
    """A device collective was issued on a stream that is capturing a CUDA graph: smddp's copies are
    waited for by the host (the daemons sum on the host), which no capture may contain."""


class DeviceUnavailableError(DeviceError):
    """A device buffer arrived but no device runtime can serve it (CuPy missing, no GPU, wrong runtime)."""


class BackendUnavailableError(SmddpError, RuntimeError):
    """The C++ torch backend cannot be loaded or built here (the text says why and what to install)."""
