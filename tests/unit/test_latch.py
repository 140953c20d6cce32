"""Latch: set() takes no lock, and no waiter misses it (the flag and the event each see the other)."""

from __future__ import annotations

import sys
import threading
import time

from smddp.client.session import Latch


def test_every_waiter_of_a_latch_set_meanwhile_returns_at_once() -> None:
    """Waiters racing one set(): each returns True, none by running out its timeout (a set() that
    read no event while a waiter was making one would leave that waiter asleep for the whole wait)."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads swap between nearly every two bytecodes: the races happen
    try:
        _race_set_against_waiters()
    finally:
        sys.setswitchinterval(switch)


#: Each waiter's timeout. A missed set() leaves its waiter asleep for all of it (its wait then finds
#: the flag set and says True): a wait that took half of it was not woken; a woken thread on a loaded
#: host is late by milliseconds, not seconds.
WAIT_S = 10.0


def _race_set_against_waiters() -> None:
    for i in range(400):
        latch = Latch()
        got: list[bool] = []
        took: list[float] = []
        start = threading.Barrier(4)

        def waiter(
            latch: Latch = latch,
            got: list[bool] = got,
            took: list[float] = took,
            start: threading.Barrier = start,
        ) -> None:
            start.wait()
            t0 = time.monotonic()
            got.append(latch.wait(WAIT_S))
            took.append(time.monotonic() - t0)

        threads = [threading.Thread(target=waiter) for _ in range(3)]
        for th in threads:
            th.start()
        start.wait()
        if i % 2:
            time.sleep(0.001)  # the waiters are asleep on the latch's event by now
        latch.set()
        for th in threads:
            th.join()
        assert got == [True, True, True]
        assert max(took) < WAIT_S / 2, (
            f"a waiter slept {max(took):.1f} s of its {WAIT_S:g} s: it missed the set()"
        )


def test_a_latch_not_set_times_out_and_a_set_one_needs_no_event() -> None:
    latch = Latch()
    assert latch.wait(0.05) is False and not latch.is_set()
    latch.set()
    assert latch.is_set() and latch.wait(0.0) is True
    fresh = Latch()
    fresh.set()
    assert fresh.wait() is True and fresh._event is None  # set before anyone blocked: no Event made
