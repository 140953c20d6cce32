"""What the daemon and the client share below the protocol: framed sockets, shared memory, bootstrap."""
