"""A daemon's clean end: its BYE is queued to every peer before anything can finish it and close the links."""

from __future__ import annotations

import threading

from smddp.daemon.node import NodeDaemon, PeerLink
from smddp.proto.frames import MsgType
from smddp.proto.messages import Bye


class HeldPlane:
    """The engine's plane as _maybe_finish meets it: every local rank gone; the first control frame's
    queueing held until `go` is set (a thread descheduled there)."""

    def __init__(self) -> None:
        self.queued: list[tuple[int, bytes]] = []
        self.entered = threading.Event()
        self.go = threading.Event()

    def all_ranks_gone(self) -> bool:
        return True

    def send_control(self, node: int, header: bytes, body: bytes) -> str:
        self.entered.set()
        assert self.go.wait(10)
        self.queued.append((node, header))
        return ""


class Finished(threading.Event):
    """The daemon's `_finished`, noting what was queued at the moment it was set: the teardown that
    follows flushes that much and then closes every link."""

    def __init__(self, plane: HeldPlane) -> None:
        super().__init__()
        self.plane = plane
        self.queued_then: list[tuple[int, bytes]] | None = None

    def set(self) -> None:
        if self.queued_then is None:  # the first set is the one the main loop wakes on
            self.queued_then = list(self.plane.queued)
        super().set()


def test_a_peers_bye_handled_meanwhile_does_not_finish_before_ours_is_queued() -> None:
    """The CI flake of stop 50 (1 in about 200 runs of a two-node job): the thread that handles
    the last local BYE decided to say BYE, and before it queued the frames the plane's event thread
    handled the peers' BYEs, finished, flushed nothing and closed the links; the peer, which never got
    our BYE, failed the job with "lost contact: node 0 closed the connection", an infrastructure cause,
    and smddp-launch restarted a job whose script had failed by itself."""
    plane = HeldPlane()
    d = NodeDaemon.__new__(NodeDaemon)  # only what _maybe_finish and a peer's BYE use
    d.node = 0
    d._lock = threading.Lock()
    d.plane = plane  # type: ignore[assignment]
    d._bye_sent_at = None
    d.peers = {1: PeerLink(1), 2: PeerLink(2)}
    d._finished = Finished(plane)

    ours = threading.Thread(target=d._maybe_finish)  # the last local rank's BYE
    ours.start()
    assert plane.entered.wait(10)

    def peers_byes() -> None:  # the plane's event thread
        for j in (1, 2):
            d._on_peer_control(d.peers[j], MsgType.BYE, 0, 0, b"")

    theirs = threading.Thread(target=peers_byes)
    theirs.start()
    theirs.join(0.5)  # long enough for the old order to finish here
    plane.go.set()
    ours.join(10)
    theirs.join(10)

    assert d._finished.is_set()
    bye = Bye(0).header().encode()
    assert d._finished.queued_then == [(1, bye), (2, bye)]
