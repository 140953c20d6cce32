"""The worker side of smddp: connection, arena, handles; never imports the daemon."""

from smddp.client.session import Client, ClientConfig, Handle

__all__ = ["Client", "ClientConfig", "Handle"]
