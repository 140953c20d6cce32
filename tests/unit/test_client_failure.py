"""The client under a daemon that hangs up: errors, never a deadlock (no processes, a socketpair)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from smddp.client.collectives import allreduce_async
from smddp.errors import PeerLostError
from smddp.transport.conn import Connection
from tests.unit.lonely import lonely_client


@pytest.mark.timeout(30)  # the bug this guards against was a deadlock
def test_submit_after_the_daemon_hung_up_raises_instead_of_deadlocking():
    client, daemon_end = lonely_client()
    # The daemon took the CHANNEL, then went: the side socket's end that came with it and its
    # connection close. The first ATTACH's fd cannot go (that alone fails nothing: the unix socket is
    # the daemon's liveness), and the reader sees the connection's end: every call must fail with
    # PeerLostError, none deadlock.
    _, fds = Connection(daemon_end, "the worker").recv_header(timeout=5.0)
    assert len(fds) == 2
    for fd in fds:
        os.close(fd)
    daemon_end.close()
    outcome: list[BaseException | str] = []

    def submit() -> None:
        try:
            for _ in range(3):  # the first send may still land in the socket buffer
                allreduce_async(client, np.ones(1000, np.float32)).wait(timeout=5)
            outcome.append("no error")
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=submit, daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "submit() deadlocked after the daemon hung up"
    assert len(outcome) == 1 and isinstance(outcome[0], PeerLostError), outcome
    with pytest.raises(PeerLostError):  # and every later call says the same
        allreduce_async(client, np.ones(4, np.float32))
    client.shutdown(timeout=1)
    daemon_end.close()
