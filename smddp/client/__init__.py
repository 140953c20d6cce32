"""The worker side of smddp: connection, arena, handles; never imports the daemon."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smddp.client.session import Client, ClientConfig, Handle

__all__ = ["Client", "ClientConfig", "Handle"]


def __getattr__(name: str) -> Any:
    """The session's names, imported on first use (numpy with them): the package `smddp` imports this
    one, and the daemon and the launcher, which hold no client, then start without them."""
    if name in __all__:
        from smddp.client import session

        return getattr(session, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
