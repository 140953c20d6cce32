"""The blocking host all-reduce's fast path (Client.allreduce_now: the engine's WorkerChannel start and
finish) against a scripted daemon on the client's real rings: the result in place, the RELEASE held,
general collectives beside it, a timeout that becomes a handle, and a DONE that lies."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from smddp import _engine
from smddp.client import collectives
from smddp.client.collectives import allreduce_async
from smddp.client.device.runtime import STREAM_LEGACY
from smddp.client.session import NO_DATA, Client, EngineHandle
from smddp.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    NotInitializedError,
    ProtocolError,
    SmddpError,
)
from smddp.proto.dtypes import DType, Kind, ReduceOp
from smddp.proto.frames import SUBMIT_WINDOW, Header, MsgType, decode_header
from smddp.proto.messages import Submit
from tests.conftest import REPO
from tests.unit.lonely import lonely_client
from tests.unit.test_client_release import RESULTS, ScriptedDaemon, sent, until_submits


@pytest.fixture
def pair():
    client, theirs = lonely_client()
    daemon = ScriptedDaemon(theirs)
    yield client, daemon
    try:
        client.shutdown(timeout=2)
    except SmddpError:
        pass  # the tests that make the client fail leave it failed
    daemon.close()


class Call:
    """A blocking call on its own thread (the daemon's answers come from the test's thread)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # handed to the test
            self.error = e

    def join(self, timeout: float = 5.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the blocking call did not return"
        if self.error is not None:
            raise self.error
        return self.result


def fast(client: Client, buf: np.ndarray, timeout: float = 5.0) -> Call:
    return Call(lambda: collectives.allreduce(client, buf, ReduceOp.SUM, timeout))


def test_fast_result_lands_in_place_and_its_release_rides_with_the_next_submit(pair):
    client, daemon = pair
    buf = np.zeros(1024, np.float32)
    call = fast(client, buf)
    frames = until_submits(daemon, 1)
    s = frames[-1]
    assert (s.seq, s.kind, s.dtype, s.count, s.op) == (1, Kind.ALLREDUCE, DType.FLOAT32, 1024, ReduceOp.SUM)
    daemon.done(s, 3.0)
    assert call.join() is buf
    assert np.array_equal(buf, np.full(1024, 3.0, np.float32))
    assert not daemon.pending(), "a 4 KiB result's RELEASE went out on its own"
    assert client._arena.in_use == 0, "the input slot was not given back"
    call = fast(client, buf)
    frames = until_submits(daemon, 1)
    assert sent(frames) == [(MsgType.RELEASE, 1), (MsgType.SUBMIT, 2)]
    daemon.done(frames[-1], 5.0)
    call.join()
    assert np.array_equal(buf, np.full(1024, 5.0, np.float32))
    assert client._handles == {}


@pytest.mark.parametrize("first", ["general", "fast"])
def test_fast_and_general_collectives_take_each_others_done(pair, first):
    """A general collective in flight (nobody waits for it: the DONE thread's) and a fast one after
    it: whichever DONE comes first, each reaches its own collective."""
    client, daemon = pair
    general = allreduce_async(client, np.zeros(256, np.float32))
    buf = np.zeros(512, np.float32)
    call = fast(client, buf)
    s1, s2 = [f for f in until_submits(daemon, 2) if f.type is MsgType.SUBMIT]
    assert (s1.seq, s2.seq) == (1, 2)
    order = [(s1, 1.0), (s2, 2.0)] if first == "general" else [(s2, 2.0), (s1, 1.0)]
    for s, v in order:
        daemon.done(s, v)
        time.sleep(0.05)  # the other side's taker is on the ring when the next comes
    call.join()
    assert np.array_equal(buf, np.full(512, 2.0, np.float32))
    assert np.array_equal(general.wait(timeout=5), np.full(256, 1.0, np.float32))


@pytest.mark.parametrize("way", ["fast", "general"])
def test_a_blocking_call_that_timed_out_never_writes_the_callers_buffer(pair, way):
    """A blocking call not in time raises, and its collective goes on (the other ranks need it) as an
    asynchronous one of the engine's (collected: the DONE thread's), whose late result is dropped: once
    its DONE is taken (it leaves the client's table, its memory goes back) the caller's buffer holds
    what it held, and no DONE reached Python. `general`: a Handle waited for by collectives.waited (a
    blocking broadcast's, all-gather's, or one in pieces), not the engine's one pass."""
    client, daemon = pair
    python = general_way(client)
    buf = np.zeros(1024, np.float32)
    with pytest.raises(CollectiveTimeoutError, match=r"Timed out waiting 200ms for collective #1 "):
        if way == "fast":
            collectives.allreduce(client, buf, ReduceOp.SUM, 0.2)
        else:
            collectives.waited(client, lambda: allreduce_async(client, buf), 0.2)
    assert list(client._handles) == [1], "the collective left in flight is not tracked"
    assert isinstance(client._handles[1], EngineHandle) and client._channel.blocking() == []
    daemon.done(until_submits(daemon, 1)[-1], 7.0)
    deadline = time.monotonic() + 5
    while client._handles:
        assert time.monotonic() < deadline, "the late DONEs were never taken"
        time.sleep(0.01)
    while client._arena.in_use:
        assert time.monotonic() < deadline, "the dropped results' memory did not go back"
        time.sleep(0.01)
    assert np.array_equal(buf, np.zeros(1024, np.float32)), "a collective that timed out wrote the buffer"
    assert python == [], "the parked collective's DONE reached Python"


def test_fast_done_that_came_before_adopt_is_not_lost(pair):
    """The DONE arrives while the timed-out call hands its collective over: adopt() returns it."""
    client, daemon = pair
    buf = np.zeros(64, np.float32)
    s = None

    def answer() -> None:
        nonlocal s
        s = until_submits(daemon, 1)[-1]
        time.sleep(0.1)  # just before the call's 0.1 s run out
        daemon.done(s, 9.0)

    t = threading.Thread(target=answer)
    t.start()
    returned = True
    try:
        collectives.allreduce(client, buf, ReduceOp.SUM, 0.1)
    except CollectiveTimeoutError:
        returned = False  # then its result is dropped: it must not land, but its DONE must be taken
    t.join()
    deadline = time.monotonic() + 5
    while client._handles or client._arena.in_use:
        assert time.monotonic() < deadline, "the DONE was lost between the fast path and its handle"
        time.sleep(0.01)
    assert np.array_equal(buf, np.full(64, 9.0 if returned else 0.0, np.float32)), returned
    # The client is healthy: the next collective goes through.
    call = fast(client, buf)
    daemon.done(until_submits(daemon, 1)[-1], 1.0)
    call.join()
    assert client._failure is None


@pytest.mark.parametrize(
    "lie, match",
    [
        (dict(count=1023), "does not match what this rank submitted"),
        (dict(dtype=DType.INT32), "does not match what this rank submitted"),
        (dict(offset=RESULTS - 64), "out of bounds|outside"),
        (dict(shard=5), "names result segment 5, which was never sent"),
    ],
)
def test_a_done_that_lies_fails_the_client_naming_why(pair, lie, match):
    client, daemon = pair
    buf = np.zeros(1024, np.float32)
    call = fast(client, buf, timeout=0.5)
    s = until_submits(daemon, 1)[-1]
    fields: dict[str, Any] = dict(
        seq=s.seq, shard=0, offset=0, count=s.count, dtype=s.dtype, op=s.op, kind=s.kind
    )
    fields.update(lie)
    daemon.rings.push(Header(MsgType.DONE, **fields).encode(), 5.0)
    with pytest.raises(CollectiveError, match=match):
        call.join()
    assert client._failure is not None
    with pytest.raises(CollectiveError):
        collectives.allreduce(client, buf, ReduceOp.SUM, 1.0)


@pytest.mark.parametrize("waited", [True, False])
@pytest.mark.parametrize(
    "lie, match",
    [
        (dict(count=1023), "does not match what this rank submitted"),
        (dict(offset=RESULTS - 64), "out of bounds|outside"),
        (dict(shard=5), "names result segment 5, which was never sent"),
    ],
)
def test_a_done_that_lies_about_a_device_collective_fails_the_client_naming_why(pair, lie, match, waited):
    """The engine checks a device collective's DONE as it does a host one's, whether its wait or the DONE
    thread (collected) takes it: nothing is copied to the device from a range it refused."""
    from smddp_rigs.standin import StandinRuntime

    client, daemon = pair
    rt = StandinRuntime()
    client._start_device(rt)
    x = rt.asarray(np.zeros(1024, np.float32))
    h = allreduce_async(client, x, ReduceOp.SUM)
    if not waited:
        h.add_done_callback(lambda _h: None)
    s = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT][-1]
    fields: dict[str, Any] = dict(
        seq=s.seq, shard=0, offset=0, count=s.count, dtype=s.dtype, op=s.op, kind=s.kind
    )
    fields.update(lie)
    daemon.rings.push(Header(MsgType.DONE, **fields).encode(), 5.0)
    with pytest.raises(CollectiveError, match=match):
        h.wait(5.0)
    assert client._failure is not None and h.finished
    assert rt.stats["h2d"] == 0, "a result the engine refused was copied to the device"
    rt.close()


def test_shutdown_waits_for_a_fast_call_and_names_it_unfinished(pair):
    client, daemon = pair
    call = fast(client, np.zeros(16, np.float32), timeout=5.0)
    until_submits(daemon, 1)
    with pytest.raises(CollectiveTimeoutError, match=r"collectives \[1\] unfinished"):
        client.shutdown(timeout=0.3)
    with pytest.raises(SmddpError):
        call.join()


def test_an_async_all_reduce_is_the_engines_and_its_wait_completes_it_there(pair):
    """allreduce_async of host memory: started by the engine (an EngineHandle); wait() takes its DONE,
    copies the result out and holds its RELEASE in the engine, as the blocking call does."""
    client, daemon = pair
    buf = np.zeros(1024, np.float32)
    h = allreduce_async(client, buf)
    assert isinstance(h, EngineHandle)
    s = until_submits(daemon, 1)[-1]
    assert (s.seq, s.kind, s.dtype, s.count, s.op) == (1, Kind.ALLREDUCE, DType.FLOAT32, 1024, ReduceOp.SUM)
    waited = Call(lambda: h.wait(timeout=5))
    time.sleep(0.05)  # the waiter is in the engine's finish when the DONE comes
    daemon.done(s, 4.0)
    assert waited.join() is buf and h.done()
    assert np.array_equal(buf, np.full(1024, 4.0, np.float32))
    assert client._handles == {} and client._arena.in_use == 0
    assert not daemon.pending(), "a 4 KiB result's RELEASE went out on its own"
    h2 = allreduce_async(client, buf)
    frames = until_submits(daemon, 1)
    assert sent(frames) == [(MsgType.RELEASE, 1), (MsgType.SUBMIT, 2)]
    daemon.done(frames[-1], 6.0)
    assert h2.wait(timeout=5) is buf
    assert np.array_equal(buf, np.full(1024, 6.0, np.float32))


def general_way(client: Client) -> list[int]:
    """The sequence numbers of the DONEs that reach the client's Python from now on, rather than being
    completed (or located, for a device collective) by the engine (Client._taken)."""
    seen: list[int] = []
    taken = client._taken

    def spy(raw: bytes | int | tuple[int, int, int, int]) -> None:
        if isinstance(raw, bytes):
            seen.append(decode_header(raw).seq)
        taken(raw)

    client._taken = spy  # type: ignore[method-assign]
    return seen


def test_an_async_all_reduce_nobody_waits_for_is_completed_by_the_engine(pair):
    """No wait: the client's DONE thread takes its DONE, and the engine completes it there (the
    result copied, the RELEASE held); Python only frees the slot and runs the callbacks. A wait()
    after that returns at once."""
    client, daemon = pair
    python = general_way(client)
    buf = np.zeros(256, np.float32)
    h = allreduce_async(client, buf)
    seen = threading.Event()
    h.add_done_callback(lambda _h: seen.set())
    daemon.done(until_submits(daemon, 1)[-1], 2.0)
    assert seen.wait(5), "the callback of an unwaited engine collective never ran"
    assert np.array_equal(buf, np.full(256, 2.0, np.float32))
    assert h.wait(timeout=0.0) is buf
    assert client._handles == {} and client._arena.in_use == 0
    assert python == [], "the DONE was completed in Python, not by the engine"
    assert not daemon.pending(), "a small result's RELEASE went out on its own"


def test_a_collected_done_that_lies_fails_the_client_naming_why(pair):
    """The engine checks a collected collective's DONE as its own finish does: a wrong count fails
    the client, naming why, and nothing is copied."""
    client, daemon = pair
    buf = np.zeros(64, np.float32)
    h = allreduce_async(client, buf)
    h.add_done_callback(lambda _h: None)
    s = until_submits(daemon, 1)[-1]
    lie = Header(MsgType.DONE, seq=s.seq, shard=0, offset=0, count=63, dtype=s.dtype, op=s.op, kind=s.kind)
    daemon.rings.push(lie.encode(), 5.0)
    with pytest.raises(CollectiveError, match="does not match what this rank submitted"):
        h.wait(timeout=5)
    assert np.array_equal(buf, np.zeros(64, np.float32))


def test_an_async_wait_that_times_out_can_wait_again(pair):
    client, daemon = pair
    buf = np.zeros(64, np.float32)
    h = allreduce_async(client, buf)
    with pytest.raises(CollectiveTimeoutError, match=r"collective #1 .*still in flight"):
        h.wait(timeout=0.1)
    waited = Call(lambda: h.wait(timeout=5))
    time.sleep(0.05)
    daemon.done(until_submits(daemon, 1)[-1], 3.0)
    assert waited.join() is buf
    assert np.array_equal(buf, np.full(64, 3.0, np.float32)) and client._failure is None


def test_two_threads_waiting_for_one_async_all_reduce_both_get_it(pair):
    client, daemon = pair
    buf = np.zeros(64, np.float32)
    h = allreduce_async(client, buf)
    calls = [Call(lambda: h.wait(timeout=5)) for _ in range(2)]
    time.sleep(0.05)
    daemon.done(until_submits(daemon, 1)[-1], 8.0)
    assert all(c.join() is buf for c in calls)
    assert np.array_equal(buf, np.full(64, 8.0, np.float32))
    assert client._failure is None and client._handles == {} and client._arena.in_use == 0


def test_a_parked_async_done_goes_to_a_callback_added_later(pair):
    """Nobody waits and no callback yet: a taker that meets its DONE parks it (nothing was woken for
    it); a callback added then gets it through the DONE thread."""
    client, daemon = pair
    parked = np.zeros(128, np.float32)
    h = allreduce_async(client, parked)
    buf = np.zeros(64, np.float32)
    call = fast(client, buf)  # a blocking call's taker meets the first DONE and parks it
    s1, s2 = [f for f in until_submits(daemon, 2) if f.type is MsgType.SUBMIT]
    daemon.done(s1, 5.0)
    time.sleep(0.05)
    daemon.done(s2, 6.0)
    call.join()
    # (Looked at without done(): a poll collects it, as the callback below does.)
    assert not h.finished and np.array_equal(parked, np.zeros(128, np.float32))
    python = general_way(client)
    seen = threading.Event()
    h.add_done_callback(lambda _h: seen.set())
    assert seen.wait(5), "the parked DONE never reached the callback"
    assert np.array_equal(parked, np.full(128, 5.0, np.float32)) and client._handles == {}
    assert python == [], "the parked DONE was completed in Python, not by the engine"


def test_shutdown_collects_an_async_all_reduce_nobody_waited_for(pair):
    client, daemon = pair
    buf = np.zeros(32, np.float32)
    allreduce_async(client, buf)
    daemon.done(until_submits(daemon, 1)[-1], 2.0)
    client.shutdown(timeout=5)  # no "unfinished": its own wait took the DONE
    assert np.array_equal(buf, np.full(32, 2.0, np.float32))


def test_an_async_all_reduce_that_is_only_polled_completes(pair):
    """done() polled in a loop, never a wait or a callback: the DONE thread completes it."""
    client, daemon = pair
    buf = np.zeros(32, np.float32)
    h = allreduce_async(client, buf)
    assert not h.done()
    daemon.done(until_submits(daemon, 1)[-1], 4.0)
    deadline = time.monotonic() + 5
    while not h.done():
        assert time.monotonic() < deadline, "a polled engine collective never completed"
        time.sleep(0.005)
    assert np.array_equal(buf, np.full(32, 4.0, np.float32))


def test_a_blocking_barrier_is_the_engines_no_data_no_handle(pair):
    """smddp.barrier's SUBMIT (kind BARRIER, no segment, count 0) leaves from the engine's fast path,
    whose DONE completes it on the calling thread; its 0-byte RELEASE rides with the next SUBMIT;
    nothing was allocated, and no Handle was made for it."""
    client, daemon = pair
    call = Call(lambda: collectives.barrier(client, 5.0))
    s = until_submits(daemon, 1)[-1]
    assert (s.seq, s.kind, s.dtype, s.count, s.shard, s.offset) == (
        1,
        Kind.BARRIER,
        DType.UINT8,
        0,
        2**32 - 1,
        0,
    )
    assert s.op is None  # as the general way's barrier encodes it: the same fingerprint
    assert client._handles == {}, "the engine's barrier made a Handle"
    daemon.done(s, 0.0)
    assert call.join() is None
    assert client._arena.in_use == 0 and not daemon.pending()
    buf = np.zeros(8, np.float32)
    call = fast(client, buf)
    frames = until_submits(daemon, 1)
    assert sent(frames) == [(MsgType.RELEASE, 1), (MsgType.SUBMIT, 2)]
    daemon.done(frames[-1], 1.0)
    call.join()


def test_a_barrier_not_in_time_becomes_a_handle_and_completes_later(pair):
    """A barrier whose DONE is late raises CollectiveTimeoutError; it stays in flight, the engine's
    (nothing freed: it had no slot), and its DONE, when it comes, completes it there."""
    client, daemon = pair
    python = general_way(client)
    call = Call(lambda: collectives.barrier(client, 0.2))
    s = until_submits(daemon, 1)[-1]
    with pytest.raises(CollectiveTimeoutError, match="still in flight"):
        call.join()
    handle = client._handles[s.seq]
    assert isinstance(handle, EngineHandle)
    assert handle.kind is Kind.BARRIER and handle._slot is None
    daemon.done(s, 0.0)
    assert handle.wait(5.0) is None
    assert client._arena.in_use == 0 and python == []


@pytest.mark.parametrize("kind", ["allgather", "reduce_scatter", "broadcast", "barrier"])
def test_every_host_collective_is_the_engines_and_its_wait_completes_it_there(pair, kind):
    """Not only the all-reduce: an all-gather, a reduce-scatter, a broadcast and a barrier of host
    memory are started by the engine (EngineHandle) with the general way's SUBMIT, and wait() takes
    the DONE, copies what the kind takes back, frees the slot and holds the RELEASE in the engine."""
    client, daemon = pair
    src = np.arange(1, 65, dtype=np.float32)
    out = np.zeros(64, np.float32)
    call = {
        "allgather": lambda: collectives.allgather_async(client, src, out),
        "reduce_scatter": lambda: collectives.reduce_scatter_async(client, src, ReduceOp.SUM, out),
        "broadcast": lambda: collectives.broadcast_async(client, src, 0),
        "barrier": lambda: collectives.barrier_async(client),
    }[kind]
    h = call()
    assert isinstance(h, EngineHandle)
    s = until_submits(daemon, 1)[-1]
    want_kind = {"allgather": Kind.ALLGATHER, "reduce_scatter": Kind.REDUCE_SCATTER}.get(kind)
    want_kind = want_kind or (Kind.BROADCAST if kind == "broadcast" else Kind.BARRIER)
    assert (s.seq, s.kind, s.count) == (1, want_kind, 0 if kind == "barrier" else 64)
    assert (s.shard == 2**32 - 1) == (kind == "barrier"), "data where none goes, or none where it does"
    assert client._handles == {} and client._channel.live() == [h]  # on the channel's table only
    waited = Call(lambda: h.wait(timeout=5))
    time.sleep(0.05)  # the waiter is in the engine's finish when the DONE comes
    daemon.done(s, 9.0)
    got = waited.join()
    if kind in ("allgather", "reduce_scatter"):
        assert got is out and np.array_equal(out, np.full(64, 9.0, np.float32))
    elif kind == "broadcast":  # the root takes nothing back: its buffer is what it sent
        assert got is src and np.array_equal(src, np.arange(1, 65, dtype=np.float32))
    assert h.done() and client._handles == {} and client._arena.in_use == 0
    assert not daemon.pending(), "a small result's RELEASE went out on its own"


def test_a_broadcast_to_another_rank_sends_nothing_and_takes_the_result(pair):
    """A rank that is not the root: no slot and no data on its SUBMIT (aux names the root), and the
    root's data lands in its buffer through the engine. (A one-rank job has no other rank: the engine
    is asked directly, as collectives.broadcast_async asks it on a rank that is not the root.)"""
    client, daemon = pair
    buf = np.zeros(32, np.float32)
    h = client.start_async(
        Kind.BROADCAST,
        NO_DATA,
        DType.FLOAT32,
        32,
        None,
        0,
        buf,
        0,
        buf.nbytes,
        None,
        buf,
        None,
    )
    assert h is not None and h._slot is None
    s = until_submits(daemon, 1)[-1]
    assert (s.kind, s.count, s.shard, s.aux) == (Kind.BROADCAST, 32, 2**32 - 1, 0)
    daemon.done(s, 3.0)
    assert h.wait(timeout=5) is buf and np.array_equal(buf, np.full(32, 3.0, np.float32))
    assert client._arena.in_use == 0


def test_an_unwaited_engine_all_gather_is_completed_into_its_output_by_the_engine(pair):
    """A callback, never a wait: the DONE thread's pop completes the all-gather in the engine, into
    its output (its Delivery), with no Python per DONE."""
    client, daemon = pair
    python = general_way(client)
    src = np.ones(16, np.int32)
    out = np.zeros(16, np.int32)
    h = collectives.allgather_async(client, src, out)
    seen = threading.Event()
    h.add_done_callback(lambda _h: seen.set())
    daemon.done(until_submits(daemon, 1)[-1], 5.0)
    assert seen.wait(5), "the callback of an unwaited engine all-gather never ran"
    assert np.array_equal(out, np.full(16, 5, np.int32)) and h.wait(timeout=0.0) is out
    assert client._handles == {} and client._arena.in_use == 0 and python == []


def test_a_delivery_outside_its_result_is_refused_before_anything_is_started(pair):
    """The engine checks where a result goes against the result's size before it takes a slot,
    copies or pushes anything."""
    client, daemon = pair
    dst = np.zeros(8, np.uint8)
    with pytest.raises(ProtocolError, match="outside its result"):
        client._channel.begin(
            Kind.ALLREDUCE, np.ones(8, np.uint8), 8, DType.UINT8, ReduceOp.SUM, 0, dst, 4, 8, None, dst, None
        )
    assert np.array_equal(dst, np.zeros(8, np.uint8))
    assert client._arena.in_use == 0 and not daemon.pending()


def test_the_in_place_all_reduce_start_refuses_a_buffer_its_count_does_not_fill(pair):
    """begin_allreduce writes the result back over its source: a count that does not match the
    buffer (which would copy past its end or leave part of it stale), a tuple of parts, a read-only
    buffer and None are refused before anything is started, the buffer untouched."""
    client, daemon = pair
    ch = client._channel
    buf = np.arange(8, dtype=np.float32)
    for count in (7, 9):
        with pytest.raises(ValueError, match=f"holds 32 bytes, not {count} elements"):
            ch.begin_allreduce(buf, DType.FLOAT32, count, ReduceOp.SUM, buf, buf)
    with pytest.raises(TypeError, match="one buffer"):
        ch.begin_allreduce((buf, buf), DType.FLOAT32, 16, ReduceOp.SUM, buf, buf)
    ro = np.arange(8, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        ch.begin_allreduce(ro, DType.FLOAT32, 8, ReduceOp.SUM, ro, ro)
    with pytest.raises(TypeError):
        ch.begin_allreduce(buf, DType.FLOAT32, 8, ReduceOp.SUM, None, buf)
    assert np.array_equal(buf, np.arange(8, dtype=np.float32))
    assert client._arena.in_use == 0 and not daemon.pending()


def test_the_in_place_all_reduce_start_is_the_engines_record(pair):
    """Client.start_allreduce: the record's kind, dtype and count are its SUBMIT's, its result lands
    in place, and wait() returns what it was given."""
    client, daemon = pair
    buf = np.full(16, 3, np.int32)
    h = client.start_allreduce(buf, DType.INT32, 16, ReduceOp.SUM, "mine", buf)
    assert isinstance(h, EngineHandle)
    assert (h.kind, h.dtype, h.count) == (Kind.ALLREDUCE, DType.INT32, 16)
    submit = until_submits(daemon, 1)[-1]
    assert (submit.kind, submit.dtype, submit.count) == (Kind.ALLREDUCE, DType.INT32, 16)
    daemon.done(submit, 7.0)
    assert h.wait(timeout=5.0) == "mine"
    assert np.array_equal(buf, np.full(16, 7, np.int32))


@pytest.mark.parametrize("kind", ["allreduce", "broadcast"])
def test_a_fused_buffers_parts_go_through_the_engine_unpacked(pair, kind):
    """allreduce_parts_async and broadcast_parts_async: the parts are copied into one slot by the
    engine, one after another (no packing copy in Python), and the result lands in a new array."""
    client, daemon = pair
    python = general_way(client)
    parts = [np.full(3, 1.0, np.float32), np.full(5, 2.0, np.float32)]
    call = collectives.allreduce_parts_async if kind == "allreduce" else collectives.broadcast_parts_async
    h = call(client, parts)
    assert isinstance(h, EngineHandle)
    s = until_submits(daemon, 1)[-1]
    assert s.count == 8 and s.shard != 2**32 - 1
    daemon.done(s, 4.0)
    got = h.wait(timeout=5)
    assert np.array_equal(got, np.full(8, 4.0, np.float32))
    assert all(
        np.array_equal(p, np.full(p.size, v, np.float32)) for p, v in zip(parts, (1.0, 2.0), strict=True)
    )
    assert client._handles == {} and client._arena.in_use == 0 and python == []


def test_sources_that_are_not_the_submits_count_are_refused(pair):
    """The engine copies what a rank sends (one buffer, or a fused buffer's parts) only when it is
    the SUBMIT's count of its dtype: nothing is taken from the arena, copied or pushed otherwise,
    and no sequence number is used up."""
    client, daemon = pair
    with pytest.raises(ProtocolError, match=r"data \(8 bytes\) is not its count of its dtype"):
        client._channel.begin(
            Kind.ALLREDUCE, (np.zeros(2, np.float32),), 4, DType.FLOAT32, ReduceOp.SUM, 0,
            np.zeros(4, np.float32), 0, 16, None, None, None,
        )  # fmt: skip
    assert client._arena.in_use == 0
    # The next collective is #1: none was used up.
    call = Call(lambda: client.allreduce_now(np.ones(4, np.float32), DType.FLOAT32, 4, ReduceOp.SUM, 5.0))
    s = until_submits(daemon, 1)[-1]
    assert s.seq == 1
    daemon.done(s, 2.0)
    assert call.join() is True


def test_an_address_takes_the_same_path_and_its_result_lands_there(pair):
    """allreduce_now of an address (the torch backend passes a tensor's data_ptr(), whose numpy view
    costs more than the call): the same SUBMIT, the result copied to that memory, the slot freed."""
    client, daemon = pair
    buf = np.zeros(256, np.float32)
    call = Call(lambda: client.allreduce_now(buf.ctypes.data, DType.FLOAT32, 256, ReduceOp.SUM, 5.0))
    s = until_submits(daemon, 1)[-1]
    assert (s.kind, s.dtype, s.count) == (Kind.ALLREDUCE, DType.FLOAT32, 256)
    daemon.done(s, 6.0)
    assert call.join() is True
    assert np.array_equal(buf, np.full(256, 6.0, np.float32)) and client._arena.in_use == 0


def test_an_address_not_in_time_is_dropped_not_written(pair):
    """A timed-out call on an address (a torch tensor's data_ptr()) becomes the engine's asynchronous
    collective like any other, with no destination: its DONE is taken and its memory given back, and
    the address is never written (the caller was told it failed, and may have freed it)."""
    client, daemon = pair
    buf = np.zeros(64, np.float32)
    call = Call(lambda: client.allreduce_now(buf.ctypes.data, DType.FLOAT32, 64, ReduceOp.SUM, 0.2))
    s = until_submits(daemon, 1)[-1]
    with pytest.raises(CollectiveTimeoutError, match="still in flight"):
        call.join()
    handle = client._handles[s.seq]  # (taken before its DONE: the DONE thread may complete it at once)
    daemon.done(s, 2.0)
    assert handle.wait(5.0) is None  # nobody's result
    assert np.array_equal(buf, np.zeros(64, np.float32)) and client._arena.in_use == 0


def test_an_address_the_engine_cannot_use_is_refused_before_anything_is_sent(pair):
    client, daemon = pair
    for addr, count in ((0, 4), (np.zeros(4, np.float32).ctypes.data, 0)):
        with pytest.raises(ValueError, match="non-zero address, count and dtype"):
            client.allreduce_now(addr, DType.FLOAT32, count, ReduceOp.SUM, 1.0)
    assert client._arena.in_use == 0
    # Nothing was sent, not even a sequence number: the next all-reduce is #1.
    buf = np.zeros(4, np.float32)
    call = fast(client, buf)
    s = until_submits(daemon, 1)[-1]
    assert s.seq == 1
    daemon.done(s, 1.0)
    call.join()


class Owner:
    """What owns an address's memory (a torch tensor, for the backend): here a holder of an array."""

    def __init__(self, n: int) -> None:
        self.buf = np.zeros(n, np.float32)


def at(client: Client, owner: Owner) -> EngineHandle:
    """allreduce_async_at of `owner`'s memory by its address (no numpy view of it is made)."""
    buf = owner.buf
    h = collectives.allreduce_async_at(
        client, buf.ctypes.data, DType.FLOAT32, buf.size, ReduceOp.SUM, owner, "the result"
    )
    assert isinstance(h, EngineHandle)
    return h


def test_an_async_all_reduce_of_an_address_is_waited_for_in_the_engine_with_no_view(pair):
    """allreduce_async_at (the torch backend's dist.all_reduce(t, async_op=True) of one CPU tensor):
    the same SUBMIT as a buffer's, the result copied to the address by the engine, no view made."""
    client, daemon = pair
    owner = Owner(512)
    h = at(client, owner)
    s = until_submits(daemon, 1)[-1]
    assert (s.kind, s.dtype, s.count, s.op) == (Kind.ALLREDUCE, DType.FLOAT32, 512, ReduceOp.SUM)
    waited = Call(lambda: h.wait(timeout=5))
    time.sleep(0.05)
    daemon.done(s, 3.0)
    assert waited.join() == "the result"
    assert np.array_equal(owner.buf, np.full(512, 3.0, np.float32))
    assert client._handles == {} and client._arena.in_use == 0


def test_an_async_all_reduce_of_an_address_nobody_waits_for_is_completed_by_the_engine(pair):
    """Collected (a callback, nobody waits): the DONE thread's pop completes it into the address, and
    the channel keeps the address's owner alive until then, whatever the caller drops."""
    client, daemon = pair
    python = general_way(client)
    owner = Owner(256)
    h = at(client, owner)
    seen = threading.Event()
    before = sys.getrefcount(owner)
    h.add_done_callback(lambda _h: seen.set())
    assert sys.getrefcount(owner) == before + 1, "the channel does not keep the address's owner"
    buf = owner.buf
    del owner
    daemon.done(until_submits(daemon, 1)[-1], 5.0)
    assert seen.wait(5), "the callback of an unwaited engine collective never ran"
    assert np.array_equal(buf, np.full(256, 5.0, np.float32))
    assert python == [], "the DONE was completed in Python, not by the engine"
    assert client._handles == {} and client._arena.in_use == 0


def test_an_address_destination_is_refused_without_its_owner(pair):
    """The engine cannot check an address: begin() takes one as a destination only with the object
    that owns it, and not a zero address or count; nothing starts."""
    client, daemon = pair
    buf = np.zeros(8, np.float32)
    for addr, count, owner, why in (
        (buf.ctypes.data, 8, None, "the object that owns it"),
        (0, 8, buf, "non-zero address, count and dtype"),
        (buf.ctypes.data, 0, buf, "non-zero address, count and dtype"),
    ):
        with pytest.raises(ValueError, match=why):
            client._channel.begin(
                int(Kind.ALLREDUCE), NO_DATA, count, int(DType.FLOAT32), 0, 0, addr, 0, 32, owner, None, None
            )
    assert client._arena.in_use == 0 and not daemon.pending()


def reserved_barrier(client: Client) -> EngineHandle:
    """A barrier reserved as a device collective's is (Client.submit): the engine's record, with its
    way back through the engine's device path (nothing to copy; its RELEASE once its DONE is taken),
    its SUBMIT to go with give()."""
    from smddp_rigs.standin import StandinRuntime

    if client._device_engine is None:
        client._start_device(StandinRuntime())
    assert client._device_engine is not None
    record = client._channel.reserve_record(
        Kind.BARRIER, 0, DType.UINT8, 0, 0, None, 0, None, None, EngineHandle
    )  # fmt: skip
    client._device_engine.deliver_to(record, 0, STREAM_LEGACY, None, [], None)
    return record


def test_fast_calls_after_a_reserved_submit_go_at_once_within_the_window(pair):
    """Sequence numbers are the channel's, handed out in call order; SUBMITs go on the ring as they are
    given, out of order, within the window the daemon takes them in (SUBMIT_WINDOW, docs/protocol.md):
    while a reserved SUBMIT is not on the ring yet (a device copy-in still running), later fast
    calls go and complete at once, up to the window's end; the first past it waits in the channel
    (its slot and copy-in taken, nothing pushed) and follows the reserved one when that is given."""
    client, daemon = pair
    python = general_way(client)
    reserved = reserved_barrier(client)
    assert reserved.seq == 1
    a = np.ones(4, np.float32)
    waited = allreduce_async(client, a)
    assert isinstance(waited, EngineHandle) and waited.seq == 2
    b = np.ones(8, np.float32)
    call = fast(client, b)
    s2, s3 = [f for f in until_submits(daemon, 2) if f.type is MsgType.SUBMIT]
    assert [(s.seq, s.kind, s.count) for s in (s2, s3)] == [(2, Kind.ALLREDUCE, 4), (3, Kind.ALLREDUCE, 8)]
    daemon.done(s3, 3.0)
    daemon.done(s2, 2.0)
    call.join()
    assert waited.wait(5.0) is a
    assert np.array_equal(a, np.full(4, 2.0, np.float32)) and np.array_equal(b, np.full(8, 3.0, np.float32))
    # Up to the window's far end (#SUBMIT_WINDOW), each goes as it starts.
    for seq in range(4, SUBMIT_WINDOW + 1):
        h = allreduce_async(client, np.ones(4, np.float32))
        (s,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
        assert s.seq == seq == h.seq
        daemon.done(s, 1.0)
        h.wait(5.0)
    past = np.ones(4, np.float32)
    beyond = allreduce_async(client, past)  # (its start pushes at once, or not at all)
    assert beyond.seq == SUBMIT_WINDOW + 1
    assert not daemon.pending(), "a SUBMIT past the window went on the ring"
    reserved.give(1.0)
    s1, last = [f for f in until_submits(daemon, 2) if f.type is MsgType.SUBMIT]
    assert (s1.seq, s1.kind, last.seq) == (1, Kind.BARRIER, SUBMIT_WINDOW + 1)
    daemon.done(last, 5.0)
    daemon.done(s1, 0.0)
    assert beyond.wait(5.0) is past and np.array_equal(past, np.full(4, 5.0, np.float32))
    reserved.wait(5.0)
    assert python == []


def test_no_fast_call_starts_once_starts_are_closed(pair):
    """Shutdown closes the fast path's starts before its BYE, so that no SUBMIT can follow the BYE:
    after that, start and run start nothing (the general way's open check then refuses the call)."""
    client, daemon = pair
    client._channel.close_starts()
    buf = np.ones(4, np.float32)
    begin = (Kind.ALLREDUCE, buf, 4, DType.FLOAT32, ReduceOp.SUM, 0, buf, 0, buf.nbytes, None, buf, None)
    assert client._channel.begin(*begin) is None
    assert client._channel.run(Kind.ALLREDUCE, buf, 4, DType.FLOAT32, ReduceOp.SUM, 1.0) is _engine.RAN_CLOSED
    assert client._arena.in_use == 0 and not daemon.pending()


def test_a_blocking_call_the_job_failure_ends_leaves_nothing_for_shutdown(pair):
    """A blocking fast call waiting when the job fails (here the client's failure, as the reader thread
    records a daemon's ERROR) raises that failure and leaves the engine's table of blocking calls
    empty: shutdown then names nothing unfinished (it raised "unfinished" for it once)."""
    client, daemon = pair
    call = fast(client, np.zeros(16, np.float32), timeout=5.0)
    until_submits(daemon, 1)
    client._fail(CollectiveError("rank 1 failed the job"))
    with pytest.raises(CollectiveError, match="rank 1 failed the job"):
        call.join()
    assert client._channel.blocking() == []
    client.shutdown(timeout=1.0)


def test_an_asynchronous_collectives_record_in_a_cycle_is_collected(pair):
    """The engine's record of an asynchronous collective (`_engine.Started`) holds its destination's
    owner; once done, a cycle through it (the owner holding the handle) is the garbage collector's
    to break: nothing leaks."""
    client, daemon = pair
    owner = Owner(64)
    h = at(client, owner)
    daemon.done(until_submits(daemon, 1)[-1], 2.0)
    assert h.wait(timeout=5) == "the result"
    owner.handle = h  # type: ignore[attr-defined]  # owner -> handle -> its record -> owner
    gone = weakref.ref(owner)
    del owner, h
    gc.collect()
    assert gone() is None, "a finished collective's record kept its destination's owner alive"


def test_an_async_wait_that_gets_its_result_runs_no_python(pair, monkeypatch):
    """The handle is the engine's record (EngineHandle subclasses _engine.Started): a wait that
    completes it returns its result from the engine, without the handle's Python (_settle, which only
    what does not end in the result reaches), and leaves it on no table."""
    client, daemon = pair
    settled: list[Any] = []
    settle = EngineHandle._settle

    def spy(self: EngineHandle, end: Any, t: float, waited: float, stream: Any) -> Any:
        settled.append(end)
        return settle(self, end, t, waited, stream)

    monkeypatch.setattr(EngineHandle, "_settle", spy)
    buf = np.zeros(64, np.float32)
    h = allreduce_async(client, buf)
    assert client._channel.live() == [h] and not h.finished
    daemon.done(until_submits(daemon, 1)[-1], 2.0)
    assert h.wait(5.0) is buf and np.array_equal(buf, np.full(64, 2.0, np.float32))
    assert h.finished and h.done() and h.wait(0.0) is buf and h.synchronize(0.0) is buf
    assert settled == [], "a wait that got its result went through Python"
    assert client._channel.live() == [] and client._handles == {} and client._arena.in_use == 0
    # Not in time: the handle's Python says so, and the collective stays in flight for a later wait.
    h2 = allreduce_async(client, buf)
    with pytest.raises(
        CollectiveTimeoutError, match=r"collective #2 \(allreduce, float32, count=64\).*still in flight"
    ):
        h2.wait(timeout=0.05)
    assert settled == [False] and not h2.finished and client._channel.live() == [h2]
    daemon.done(until_submits(daemon, 1)[-1], 3.0)
    assert h2.wait(timeout=5) is buf and np.array_equal(buf, np.full(64, 3.0, np.float32))


def test_the_jobs_failure_ends_an_unwaited_async_collectives_wait_at_once(pair):
    """An asynchronous collective nobody waited for or collected is on no table of the client's:
    the failure reaches it through the channel's abort. done() says True and wait() raises the
    failure at once, not after its timeout."""
    client, daemon = pair
    buf = np.zeros(16, np.float32)
    h = allreduce_async(client, buf)
    until_submits(daemon, 1)
    client._fail(CollectiveError("rank 1 failed the job"))
    assert h.done() and h.finished and client._channel.live() == []  # (shutdown names nothing unfinished)
    # The failure ends the wait: one that ran out its 30 s would raise CollectiveTimeoutError instead.
    with pytest.raises(CollectiveError, match="rank 1 failed the job"):
        h.wait(timeout=30)
    # A callback added now runs at once, and sees the failure.
    errors: list[BaseException] = []

    def cb(handle: Any) -> None:
        try:
            handle.wait(0)
        except SmddpError as e:
            errors.append(e)

    h.add_done_callback(cb)
    assert len(errors) == 1 and "rank 1 failed the job" in str(errors[0])
    client.shutdown(timeout=1.0)  # a failed job's collectives are not "unfinished"


def test_shutdown_waits_for_an_async_collective_nobody_waited_for(pair):
    """Shutdown finds the engine's unwaited collectives on the channel's live table: one whose DONE
    comes is completed (its result in place), one whose DONE never comes is named unfinished."""
    client, daemon = pair
    buf = np.zeros(32, np.float32)
    allreduce_async(client, buf)  # (the handle dropped at once)
    s = until_submits(daemon, 1)[-1]
    daemon.done(s, 4.0)
    assert len(client._channel.live()) == 1
    allreduce_async(client, np.zeros(8, np.float32))
    until_submits(daemon, 1)
    with pytest.raises(CollectiveTimeoutError, match=r"collectives \[2\] unfinished"):
        client.shutdown(timeout=0.5)
    assert np.array_equal(buf, np.full(32, 4.0, np.float32)), "shutdown did not complete the first"


def test_two_waiters_and_a_callback_of_one_async_collective_all_see_it_complete(pair):
    """Two threads wait for one collective while a third adds a callback (collecting it): whichever
    completes it, both waits return its result and the callback runs exactly once."""
    client, daemon = pair
    for i in range(20):
        buf = np.zeros(16, np.float32)
        h = allreduce_async(client, buf)
        s = until_submits(daemon, 1)[-1]
        w1, w2 = Call(lambda h=h: h.wait(5.0)), Call(lambda h=h: h.wait(5.0))
        ran: list[int] = []
        adder = Call(lambda h=h, ran=ran: h.add_done_callback(lambda _h: ran.append(1)))
        if i % 2:
            time.sleep(0.01)  # (half the rounds: the waiters are asleep in the engine when the DONE comes)
        daemon.done(s, float(i))
        assert w1.join() is buf and w2.join() is buf and adder.join() is None
        deadline = time.monotonic() + 5
        while not ran and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ran == [1], f"round {i}: the callback ran {len(ran)} times"
        assert np.array_equal(buf, np.full(16, float(i), np.float32))
    assert client._handles == {} and client._channel.live() == [] and client._arena.in_use == 0


def test_a_client_shut_down_is_freed_without_the_garbage_collector():
    """The channel holds its client (what bind() gave, and the records of its live table) while the
    client holds the channel; shutdown lets go of that, so a client that is done with is freed at once
    with its segments and sockets, not whenever the garbage collector next runs (an fd count taken in
    between would see them go)."""
    client, theirs = lonely_client()
    daemon = ScriptedDaemon(theirs)
    buf = np.zeros(16, np.float32)
    waited = allreduce_async(client, buf)
    daemon.done(until_submits(daemon, 1)[-1], 1.0)
    waited.wait(5.0)
    collected = allreduce_async(client, buf)
    collected.add_done_callback(lambda _h: None)
    daemon.done(until_submits(daemon, 1)[-1], 2.0)
    collected.wait(5.0)
    allreduce_async(client, buf)  # never done: still on the live table at shutdown
    until_submits(daemon, 1)
    with pytest.raises(CollectiveTimeoutError, match="unfinished"):
        client.shutdown(timeout=0.2)
    daemon.close()
    del waited, collected
    gone = weakref.ref(client)
    gc.disable()
    try:
        del client
        assert gone() is None, "a client that was shut down is left for the garbage collector"
    finally:
        gc.enable()


def test_a_timeline_keeps_the_engines_path_and_notes_every_phase(tmp_path):
    """With a timeline on, every host collective still runs in the engine (no DONE reaches Python),
    and each leaves its three phases in the rank's part of the timeline, in order: a blocking call,
    an asynchronous one waited for, one completed by the DONE thread (callbacks), and a blocking one
    parked by its timeout and completed by the engine later."""
    client, theirs = lonely_client(timeline_dir=str(tmp_path))
    daemon = ScriptedDaemon(theirs)
    python = general_way(client)
    try:
        blocking = np.zeros(256, np.float32)
        call = fast(client, blocking)
        daemon.done(until_submits(daemon, 1)[-1], 1.0)
        call.join()
        waited = allreduce_async(client, np.zeros(64, np.float32))
        assert isinstance(waited, EngineHandle), "a timeline sent the asynchronous call the general way"
        daemon.done(until_submits(daemon, 1)[-1], 2.0)
        waited.wait(5.0)
        collected = allreduce_async(client, np.zeros(32, np.float32))
        seen = threading.Event()
        collected.add_done_callback(lambda _h: seen.set())
        daemon.done(until_submits(daemon, 1)[-1], 3.0)
        assert seen.wait(5.0)
        assert python == [], "a timeline sent a DONE to Python"
        parked = np.zeros(16, np.float32)
        with pytest.raises(CollectiveTimeoutError):
            collectives.allreduce(client, parked, ReduceOp.SUM, 0.2)
        daemon.done(until_submits(daemon, 1)[-1], 4.0)
        deadline = time.monotonic() + 5
        while client._handles:
            assert time.monotonic() < deadline, "the parked collective never completed"
            time.sleep(0.01)
        assert python == [], "the parked collective's DONE reached Python"
        assert np.array_equal(parked, np.zeros(16, np.float32)), "its caller was told it failed: dropped"
        client.shutdown(timeout=2)
    finally:
        daemon.close()
    events = json.loads((tmp_path / "rank0.json").read_text())
    phases: dict[int, dict[str, dict]] = {}
    for e in events:
        assert e["pid"] == "rank 0" and e["ph"] == "X" and e["dur"] >= 0
        phases.setdefault(e["args"]["seq"], {})[e["cat"]] = e
    assert sorted(phases) == [1, 2, 3, 4]
    for seq, count in ((1, 256), (2, 64), (3, 32), (4, 16)):
        got = phases[seq]
        assert sorted(got) == ["copy in", "copy out", "in flight"], (seq, sorted(got))
        assert got["copy in"]["args"]["what"] == f"allreduce(float32, count={count})"
        a, b, c = got["copy in"], got["in flight"], got["copy out"]
        # One after another (the spans are rounded to microseconds apart from each other).
        assert abs(a["ts"] + a["dur"] - b["ts"]) < 1 and abs(b["ts"] + b["dur"] - c["ts"]) < 1, (seq, a, b, c)
    assert phases[4]["in flight"]["dur"] >= 0.15e6, "the parked collective's flight did not span its timeout"
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)


def test_reserved_submits_go_on_the_ring_as_they_are_given(pair):
    """A device collective's SUBMIT is given once its copy-in is complete, whenever that is: the channel
    puts it on the ring then, in whatever order they are given (within the daemon's window), and a
    call started meanwhile goes at once, without waiting for the reserved one before it."""
    client, daemon = pair
    python = general_way(client)
    first, second = reserved_barrier(client), reserved_barrier(client)
    assert (first.seq, second.seq) == (1, 2)
    second.give(1.0)
    a = np.ones(4, np.float32)
    waited = allreduce_async(client, a)
    assert isinstance(waited, EngineHandle) and waited.seq == 3
    s2, s3 = [f for f in until_submits(daemon, 2) if f.type is MsgType.SUBMIT]
    assert [(s.seq, s.kind) for s in (s2, s3)] == [(2, Kind.BARRIER), (3, Kind.ALLREDUCE)]
    daemon.done(s3, 2.0)
    assert waited.wait(5.0) is a and np.array_equal(a, np.full(4, 2.0, np.float32))
    with pytest.raises(ProtocolError, match="given already"):
        second.give(1.0)
    first.give(1.0)
    (s1,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    assert (s1.seq, s1.kind) == (1, Kind.BARRIER)
    assert python == []


def test_device_submits_go_as_their_copy_ins_land_the_other_way_round(pair):
    """Two device collectives on two devices of the stand-in: the first's copy-in waits behind a slow
    kernel on its device (its SUBMIT the engine's device watch gives once it lands: no thread of the
    client's), the second's (a blocking call, whose own wait gives its SUBMIT) is done at once. The
    second's SUBMIT goes first and completes while the first's copy-in is still held (it waits for
    nothing before it: the daemon takes SUBMITs within its window in any order); the first's goes
    once its copy-in lands, and both results reach their devices."""
    from smddp_rigs.standin import StandinRuntime

    client, daemon = pair
    rt = StandinRuntime(devices=2)
    client._start_device(rt)
    gave: list[int] = []
    give = client._give_locked

    def spy(handle: Any) -> Any:
        gave.append(handle.seq)
        return give(handle)

    client._give_locked = spy  # type: ignore[method-assign]
    slow = rt.new_stream(0)
    x0 = rt.asarray(np.ones(64, np.float32), device=0)
    x1 = rt.asarray(np.ones(32, np.float32), device=1)
    gate = rt.hold(slow, device=0)  # a slow kernel ahead of the first's copy-in, until let go below
    first = allreduce_async(client, x0, ReduceOp.SUM, stream=slow)
    assert client._device_engine is not None and client._device_engine.pending() == 1, (
        "the engine does not watch its copy-in"
    )
    mine = {t.name for t in threading.enumerate() if t.name.startswith("smddp-")}
    assert mine <= {"smddp-client-done", "smddp-client-reader"}, (
        f"a thread of the client's holds a device SUBMIT: {mine}"
    )
    second = Call(lambda: collectives.allreduce(client, x1, ReduceOp.SUM, 5.0))
    deadline = time.monotonic() + 5
    while 2 not in gave:
        assert time.monotonic() < deadline, "the blocking call did not give its SUBMIT"
        time.sleep(0.002)
    (s2,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    assert (s2.seq, s2.count) == (2, 32)
    daemon.done(s2, 2.0)
    second.join()  # complete while the first's copy-in is still held
    (r2,) = daemon.frames(1)  # its RELEASE, once its copy back has landed
    assert (r2.type, r2.seq) == (MsgType.RELEASE, 2)
    assert client._device_engine.pending() == 1 and not daemon.pending(), (
        "the first went before its copy landed"
    )
    gate.set()
    (s1,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    assert (s1.seq, s1.count) == (1, 64)
    daemon.done(s1, 3.0)
    first.synchronize(5.0)
    assert np.array_equal(x0.get(), np.full(64, 3.0, np.float32))
    assert np.array_equal(x1.get(), np.full(32, 2.0, np.float32))
    client.shutdown(timeout=2)
    rt.close()


@pytest.mark.parametrize("slow", ["pinning", "pageable copy"])
def test_a_slow_copy_in_holds_up_no_other_collectives_completion(pair, slow, caplog):
    """The engine pins a new input segment (cuMemHostRegister touches every page) and, where it
    cannot be pinned, copies into pageable memory, which blocks until the producer's kernels are
    done. Neither runs under the client's lock (nor with the GIL held): while one is stuck there,
    another collective's DONE is completed by the DONE thread (which takes the lock) and its
    callback runs; the stuck one then goes on, its SUBMIT given and its result exact."""
    from smddp_rigs.standin import StandinRuntime

    client, daemon = pair
    rt = StandinRuntime()
    client._start_device(rt)
    # A host collective only a callback waits for: the DONE thread completes it, under the lock.
    a = np.ones(16, np.float32)
    ha = allreduce_async(client, a, ReduceOp.SUM)
    ran = threading.Event()
    ha.add_done_callback(lambda _h: ran.set())
    (sa,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    producer = rt.new_stream(0)
    gate = rt.hold(producer)  # the producer's kernel: a pageable copy-in blocks until it ends
    x = rt.asarray(np.ones(64, np.float32))
    with rt.registrations("held" if slow == "pinning" else "refused") as waiting:
        started = Call(lambda: allreduce_async(client, x, ReduceOp.SUM, stream=producer))
        deadline = time.monotonic() + 10
        if slow == "pinning":
            while waiting() == 0:
                assert time.monotonic() < deadline, "the device collective never came to pin its segment"
                time.sleep(0.002)
        else:
            while rt.stats["pageable"] == 0 and started.result is None and started.error is None:
                assert time.monotonic() < deadline, "the device collective never came to copy"
                time.sleep(0.002)
        daemon.done(sa, 6.0)
        assert ran.wait(10), f"another collective's completion waited behind a {slow} under the lock"
        assert started.result is None and started.error is None, "the copy-in was not stuck as the test meant"
    gate.set()
    started.join()
    hx = started.result
    (sx,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    daemon.done(sx, 2.0)
    hx.synchronize(5.0)
    assert np.array_equal(x.get(), np.full(64, 2.0, np.float32))
    assert np.array_equal(a, np.full(16, 6.0, np.float32))
    if slow == "pageable copy":
        assert rt.stats["pageable"] >= 1
    client.shutdown(timeout=2)
    if slow == "pageable copy":  # (the engine's note, logged by whichever thread reaped it)
        said = [r.getMessage() for r in caplog.records]
        assert any(
            "could not page-lock input segment" in m and "CUDA_ERROR_NOT_PERMITTED" in m for m in said
        ), said
    assert rt.driver_registered() == {}, "a segment the engine page-locked was left registered"
    rt.close()


def test_a_copy_in_the_engine_enqueues_is_polled_with_its_deadline_kept(pair):
    """A blocking call waits for its copy-in itself (CopyIn.wait, GIL released): a copy held behind
    the producer's kernel is not reported landed, the wait returns at its deadline, and once the
    kernel ends it lands and the wait says so; the engine counts it pending until then."""
    from smddp_rigs.standin import StandinRuntime

    client, _daemon = pair
    rt = StandinRuntime()
    client._start_device(rt)
    engine = client._device_path()
    producer = rt.new_stream(0)
    x = rt.asarray(np.full(64, 3.0, np.float32))
    slot, _fresh = client._arena.alloc(256)
    gate = rt.hold(producer)
    copy = engine.copy_in(client._arena.native, slot.segment, slot.offset, 256, 0, x.ptr, producer, None)
    assert not copy.done() and engine.pending() == 1
    assert not copy.wait(0.05), "a copy held behind a kernel was seen landed"  # (and it returned)
    gate.set()
    assert copy.wait(10.0) and copy.done() and engine.pending() == 0
    assert np.array_equal(client._arena.view(slot).view(np.float32), np.full(64, 3.0, np.float32))
    size = client._arena.segment(slot.segment).array.nbytes
    with pytest.raises(ValueError, match="outside its segment"):
        engine.copy_in(client._arena.native, slot.segment, size - 128, 256, 0, x.ptr, producer, None)
    client._arena.free(slot)
    client.shutdown(timeout=2)
    # A CopyIn in a reference cycle with its engine, collected: the engine outlives the copy's end
    # (which destroys its event through the engine's driver), whatever order the collector picks.
    cycle: list[Any] = [copy, engine]
    cycle.append(cycle)
    client._device_engine = None
    del copy, engine, cycle
    gc.collect()
    rt.close()


def test_a_copy_in_that_fails_on_the_device_fails_the_client_naming_it(pair):
    """The engine's device watch gives a held SUBMIT once its copy-in lands; a copy-in that fails on
    the device (the producer's kernel faulted: the copy stream that waited for it fails too) is never
    given: the engine keeps the failure, the client's DONE thread fails the job with it, and the
    collective's wait raises it, naming the collective and the driver's error, in bounded time."""
    from smddp_rigs.standin import StandinRuntime

    client, daemon = pair
    rt = StandinRuntime()
    client._start_device(rt)
    producer = rt.new_stream()
    x = rt.asarray(np.ones(64, np.float32))
    gate = rt.hold(producer)

    def fault(v: np.ndarray) -> None:
        raise ValueError("kernel fault")

    rt.launch(producer, fault, x)
    h = allreduce_async(client, x, ReduceOp.SUM, stream=producer)
    assert client._device_engine is not None and client._device_engine.pending() == 1
    gate.set()
    with pytest.raises(
        CollectiveError, match=r"the copy-in of collective #1 failed: cuEventQuery: CUDA_ERROR_UNKNOWN"
    ):
        h.wait(30.0)
    assert not daemon.pending(), "a failed copy-in's SUBMIT went"
    rt.close()


def test_a_device_results_release_waits_for_its_copy_back_and_its_buffer_is_held_until_then(pair):
    """The engine enqueues a device result's copy back when its DONE is taken, and RELEASEs the result
    slot only once that copy has landed (its device watch): until then the daemon may not reuse a slot
    the copy still reads, and the destination stays alive though its caller let go of it. The copy
    back is held behind a kernel on its lane here, so the order is the test's, not the clock's."""
    from smddp_rigs.standin import StandinRuntime

    client, daemon = pair
    rt = StandinRuntime()
    client._start_device(rt)
    x = rt.asarray(np.ones(64, np.float32))
    h = allreduce_async(client, x, ReduceOp.SUM)
    io, engine = client._device, client._device_engine
    assert io is not None and engine is not None
    gate = rt.hold(io.lane(0).h2d)  # the copy back, on its lane, waits behind this
    (s,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    daemon.done(s, 3.0)
    h.wait(5.0)  # its copy back is enqueued, not landed
    assert not h.done(), "the copy back landed through a held lane"
    assert not daemon.pending(), "a device result was RELEASEd before its copy back landed"
    held = weakref.ref(x)
    del x, h
    gc.collect()
    assert held() is not None, "the destination of a copy still running was let go"
    gate.set()
    (r,) = daemon.frames(1)
    assert (r.type, r.seq) == (MsgType.RELEASE, s.seq)
    deadline = time.monotonic() + 10
    while (
        held() is not None
    ):  # let go of once landed (the engine's reap, on the next call or the DONE thread)
        assert time.monotonic() < deadline, "the destination was never let go"
        engine.reap()
        gc.collect()
        time.sleep(0.01)
    client.shutdown(timeout=2)
    rt.close()


@pytest.mark.parametrize("where", ["on the device", "enqueuing"])
def test_a_copy_back_that_fails_fails_the_client_naming_it_and_is_never_released(pair, where):
    """A copy back that fails on the device (a kernel faulted on its lane before it: sticky) is seen by
    the engine's watch, which keeps the failure; the client's DONE thread fails the job with it. One
    the driver refuses to enqueue (its destination is no longer device memory) fails the wait that
    took its DONE at once. Either way it names the collective and the driver's error, and its
    result is never RELEASEd."""
    from smddp_rigs.standin import StandinRuntime, _lib

    client, daemon = pair
    rt = StandinRuntime()
    client._start_device(rt)
    x = rt.asarray(np.ones(64, np.float32))
    h = allreduce_async(client, x, ReduceOp.SUM)
    io = client._device
    assert io is not None
    (s,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    if where == "on the device":

        def fault() -> None:
            raise ValueError("kernel fault")

        rt.launch(io.lane(0).h2d, fault)
        daemon.done(s, 3.0)
        # Enqueued: the failure shows once the device reaches it. (Ordered on a stream of the test's
        # own, which fails with it: the driver's legacy stream is the process's.)
        h.wait(5.0, stream=rt.new_stream())
        deadline = time.monotonic() + 10
        while client._failure is None:
            assert time.monotonic() < deadline, "the client never failed"
            time.sleep(0.01)
        match = r"the copy of collective #1's result to cuda:0 failed: cuEventQuery: CUDA_ERROR_UNKNOWN"
        with pytest.raises(CollectiveError, match=match):
            client._check_open()
    else:
        rt.synchronize()
        _lib().smddp_standin_unmap(x.ptr)  # x's device memory is gone (its owner's doing, not ours)
        daemon.done(s, 3.0)
        match = r"collective #1's result to cuda:0 could not be enqueued: cuMemcpyHtoDAsync: CUDA_ERROR_INVALID_VALUE"
        with pytest.raises(CollectiveError, match=match):
            h.wait(5.0)
    assert not daemon.pending(), "a failed copy back's result was RELEASEd"
    rt.close()


@pytest.mark.parametrize("how", ["callback", "poll"])
def test_a_device_collective_nobody_waits_for_is_completed_by_the_done_thread(pair, how):
    """A device all-reduce that only a callback (or a poll) waits for is on the channel's one table: the
    client's DONE thread takes its DONE, the engine checks it and locates the result, and the handle's
    _arrived enqueues the copy to the device there; the callback runs after that, the result reaches
    the device, the result's RELEASE goes only once that copy is done, and no DONE reaches Python."""
    from smddp_rigs.standin import StandinRuntime

    from smddp.client.session import DeviceHandle

    client, daemon = pair
    python = general_way(client)
    rt = StandinRuntime(copy_delay_s=1.0)  # every copy lands 1 s after it is due: room for a loaded host
    client._start_device(rt)
    x = rt.asarray(np.ones(256, np.float32))
    h = allreduce_async(client, x, ReduceOp.SUM)
    assert isinstance(h, DeviceHandle) and client._channel.live() == [h]
    ran: list[bool] = []
    if how == "callback":
        h.add_done_callback(lambda d: ran.append(d.finished))
    else:
        assert not h.done()
    assert client._handles == {h.seq: h}, "collected, it is not on the client's table"
    (s1,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    assert not daemon.pending()
    daemon.done(s1, 4.0)
    deadline = time.monotonic() + 5
    while not h.finished:
        assert time.monotonic() < deadline, "the DONE thread did not complete it"
        time.sleep(0.002)
    assert ran == ([True] if how == "callback" else [])
    assert client._handles == {} and client._channel.live() == []
    assert not daemon.pending(), "the result's RELEASE went before its copy to the device was done"
    while not h.done():
        assert time.monotonic() < deadline, "the copy to the device never completed"
        time.sleep(0.002)
    assert sent(daemon.frames(1)) == [(MsgType.RELEASE, 1)]
    assert h.synchronize(5.0) is x and np.array_equal(x.get(), np.full(256, 4.0, np.float32))
    assert python == [] and client._arena.in_use == 0
    client.shutdown(timeout=2)
    rt.close()


@pytest.mark.parametrize("kind", ["allreduce", "allreduce_async", "broadcast", "allgather", "reduce_scatter"])
def test_a_collective_of_an_empty_host_buffer_is_the_engines(pair, kind):
    """A collective of nothing runs in the engine like any other (the client once sent these the general
    way): no slot, a SUBMIT of count 0, its DONE completed there, none reaching Python."""
    client, daemon = pair
    python = general_way(client)
    empty = np.zeros(0, np.float32)
    start: dict[str, Callable[[], Any]] = {
        "allreduce": lambda: collectives.allreduce(client, empty, ReduceOp.SUM, 5.0),
        "allreduce_async": lambda: allreduce_async(client, empty).wait(5.0),
        "broadcast": lambda: collectives.broadcast_async(client, empty, 0).wait(5.0),
        "allgather": lambda: collectives.allgather_async(client, empty).wait(5.0),
        "reduce_scatter": lambda: collectives.reduce_scatter_async(client, empty).wait(5.0),
    }
    call = Call(start[kind])
    (s,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    assert s.count == 0 and s.kind.label == kind.removesuffix("_async")
    assert client._arena.in_use == 0, "a collective of nothing took a slot"
    daemon.done(s, 0.0)
    result = call.join()
    assert isinstance(result, np.ndarray) and result.size == 0
    assert python == [], "its DONE reached Python"


def test_a_device_collective_waited_for_at_once_copies_in_line_on_the_callers_stream(pair):
    """A blocking call's copies run on the caller's stream itself, after its queued work, with no
    event between streams (DevicePlan.inline); an asynchronous one's run on the lanes, ordered by an
    event on the caller's stream. Both wait for a slow kernel queued ahead of them, and both land."""
    from smddp_rigs.standin import StandinRuntime

    client, daemon = pair
    rt = StandinRuntime()
    client._start_device(rt)
    current = rt.current_stream(0)
    x = rt.asarray(np.ones(16, np.float32))
    for blocking in (True, False):
        ended: list[bool] = []
        gate = rt.hold(current)  # the caller's work, queued ahead of the collective, let go in 0.2 s
        rt.launch(current, lambda ended=ended: ended.append(True))
        threading.Timer(0.2, gate.set).start()
        # The driver's own record of every copy and wait, the engine's (the copy back, the consumer's
        # wait for it) as well as the client's.
        with rt.traced() as trace:
            if blocking:
                call = Call(lambda: collectives.allreduce(client, x, ReduceOp.SUM, 5.0))
            else:
                h = allreduce_async(client, x)
                call = Call(lambda h=h: h.synchronize(5.0))
            (s,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
            assert ended, "the SUBMIT went before the caller's queued work was done"
            daemon.done(s, 4.0 if blocking else 16.0)
            call.join()
        streams = {name: stream for name, stream in trace if name != "wait_event"}
        waits = [stream for name, stream in trace if name == "wait_event"]
        lane = client._device.lane(0)
        exported = lane.d2h  # the DLPack export makes its consumer stream wait for the producer's
        if blocking:
            assert streams == {"copy_d2h": current, "copy_h2d": current}
            assert waits == [exported], "a stream waited for another's event in a blocking call"
        else:
            assert streams == {"copy_d2h": lane.d2h, "copy_h2d": lane.h2d}
            assert sorted(waits) == sorted([exported, lane.d2h, lane.h2d, current])
    assert np.array_equal(x.get(), np.full(16, 16.0, np.float32))
    client.shutdown(timeout=2)
    rt.close()


# What a device runtime does that touches CUDA: none of it may run per collective (issue 56).
RUNTIME_CALLS = (
    "current_stream", "new_stream", "new_event", "record", "wait_event", "event_synchronize", "event_done",
    "register_host", "unregister_host", "copy_d2h", "copy_h2d", "event_handle",
    "pointer_device",
)  # fmt: skip


def test_a_device_collective_makes_no_call_of_the_python_runtime(pair, monkeypatch):
    """Python starts a device collective and wraps its completion; every CUDA call in between is the
    engine's (issue 56): the capture check, the point of the caller's stream its copies wait for
    (DeviceEngine.mark), the copies, their events and the waits for them. Once a first collective has
    made the lanes and page-locked the segments, neither a blocking all-reduce nor an asynchronous one
    (waited for on the caller's stream, then synchronized) nor a broadcast calls the device runtime:
    a buffer as a front end describes it (smddp.torch's tensors), on the stream it names."""
    from smddp_rigs.standin import StandinRuntime

    from smddp.client.collectives import broadcast_async
    from smddp.client.device.buffers import described

    client, daemon = pair
    rt = StandinRuntime()
    client._start_device(rt)
    cur = rt.new_stream(0)
    x = rt.asarray(np.ones(64, np.float32))
    dev = described(x.ptr, DType.FLOAT32, (64,), 0, rt.library, x)

    def blocking(value: float) -> None:
        call = Call(lambda: collectives.allreduce(client, dev, ReduceOp.SUM, 5.0, stream=cur))
        (s,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
        daemon.done(s, value)
        call.join()

    def asynchronous(value: float) -> None:
        h = allreduce_async(client, dev, ReduceOp.SUM, stream=cur)
        (s,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
        daemon.done(s, value)
        h.wait(5.0, stream=cur)
        h.synchronize(5.0)

    def broadcast(value: float) -> None:
        h = broadcast_async(client, dev, 0, stream=cur)
        (s,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
        daemon.done(s, value)
        h.synchronize(5.0)

    blocking(2.0)  # the lanes, the page-locked segments: once
    asynchronous(3.0)
    calls: list[str] = []
    for name in RUNTIME_CALLS:
        real = getattr(rt, name)
        monkeypatch.setattr(rt, name, lambda *a, _n=name, _f=real, **k: (calls.append(_n), _f(*a, **k))[1])
    # (the broadcast's root sends its buffer and takes nothing back: it keeps 5)
    for what, run, value, held in (("a blocking device all-reduce", blocking, 4.0, 4.0),
                                   ("an asynchronous device all-reduce", asynchronous, 5.0, 5.0),
                                   ("a device broadcast", broadcast, 6.0, 5.0)):  # fmt: skip
        run(value)
        assert calls == [], f"{what} called the runtime: {calls}"
        # (The test's own read calls it: after the copy back on `cur`, which the blocking call and
        # the wait only ordered `cur`'s later work after.)
        rt.stream_synchronize(cur)
        assert np.array_equal(x.get(), np.full(64, held, np.float32))
        calls.clear()
    monkeypatch.undo()
    client.shutdown(timeout=2)
    rt.close()


def test_a_host_collective_started_once_starts_are_closed_raises_and_sends_nothing(pair):
    """Shutdown closes the engine's starts; a host collective that comes after (another thread's,
    past the open check as shutdown closes them) raises that smddp has been shut down, with nothing
    sent: there is no other way for it to go."""
    client, daemon = pair
    x = np.ones(8, np.float32)
    client._channel.close_starts()  # as shutdown does, after a caller's open check
    starts: list[Callable[[], Any]] = [
        lambda: allreduce_async(client, x),
        lambda: collectives.allreduce_parts_async(client, [x, x]),
        lambda: collectives.broadcast_async(client, x, 0),
        lambda: collectives.broadcast_parts_async(client, [x], 0),
        lambda: collectives.allgather_async(client, x),
        lambda: collectives.reduce_scatter_async(client, x),
        lambda: collectives.barrier_async(client),
    ]
    for start in starts:
        with pytest.raises(NotInitializedError, match="shut down"):
            start()
    assert not daemon.pending(), "a collective went on the ring after starts were closed"
    assert client._arena.in_use == 0
    client.shutdown(timeout=2)


def test_a_blocking_call_on_another_stream_than_its_dlpack_producers_waits_for_both(pair):
    """A DLPack buffer still being written on its library's current stream, handed to a blocking call
    with `stream=` another stream: the copy-in reads it after both (the export orders the copy
    stream after the producer's current stream, `before` after the named one), so it goes on the
    lanes, not in line on the named stream alone."""
    from smddp_rigs.standin import StandinRuntime

    client, daemon = pair
    rt = StandinRuntime()
    client._start_device(rt)
    current, other = rt.current_stream(0), rt.new_stream(0)
    x = rt.asarray(np.zeros(16, np.float32))
    # The producer's kernel on the current stream: a while, then the values the call must send.
    rt.launch(current, lambda h: (time.sleep(0.3), h.__setitem__(slice(None), 5.0)), x)
    call = Call(lambda: collectives.allreduce(client, x, ReduceOp.SUM, 5.0, stream=other))
    (s,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    sub = Submit.of(s)
    sent_values = client._arena.segment(sub.segment).view(sub.offset, 64).view(np.float32).copy()
    assert np.array_equal(sent_values, np.full(16, 5.0, np.float32)), (
        "the copy-in read before the producer wrote"
    )
    daemon.done(s, 10.0)
    call.join()
    rt.synchronize()
    assert np.array_equal(x.get(), np.full(16, 10.0, np.float32))
    client.shutdown(timeout=2)
    rt.close()


@pytest.mark.parametrize("how", ["blocking", "async"])
def test_a_device_collective_under_graph_capture_is_refused_at_once(pair, how):
    """Issued on a stream that is capturing a CUDA graph (torch.cuda.graph(), cudaStreamBeginCapture):
    refused at once, naming the stream, with nothing enqueued or sent (under capture its copies would
    be recorded, never run, and its SUBMIT wait for a copy-in that never comes); once the capture has
    ended, the next collective is #1 and goes through."""
    from smddp_rigs.standin import StandinRuntime

    from smddp.errors import GraphCaptureError

    client, daemon = pair
    rt = StandinRuntime()
    client._start_device(rt)
    x = rt.asarray(np.ones(16, np.float32))
    current = rt.new_stream(0)  # what torch.cuda.graph() captures on: a stream of its own
    rt.begin_capture(current)
    with (
        rt.use(current),
        pytest.raises(
            GraphCaptureError, match=f"on stream {current:#x} of cuda:0, which is capturing a CUDA graph"
        ),
    ):
        if how == "blocking":
            collectives.allreduce(client, x, ReduceOp.SUM, 5.0)
        else:
            allreduce_async(client, x)
    graph = rt.end_capture(current)
    assert graph == [] and not daemon.pending(), "something was enqueued under capture, or sent"
    assert client._failure is None
    h = allreduce_async(client, x)
    (s,) = [f for f in until_submits(daemon, 1) if f.type is MsgType.SUBMIT]
    assert s.seq == 1
    daemon.done(s, 2.0)
    h.synchronize(5.0)
    assert np.array_equal(x.get(), np.full(16, 2.0, np.float32))
    client.shutdown(timeout=2)
    rt.close()


def test_shutdown_never_unmaps_memory_a_device_copy_still_uses() -> None:
    """A blocking device all-reduce times out with its copy-in, in line on the caller's stream, still
    behind the caller's held kernel; shutdown waits for that copy within its bound and, past it, leaves
    the memory pinned and mapped and fails the job naming the copy, instead of unmapping the slot the
    copy will write. Once the kernel ends, the copy lands and the process lives. (In a process of its
    own: tests/unit/copy_at_shutdown.py.)"""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.copy_at_shutdown"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "timed out", lines
    assert lines[1].startswith(
        "shutdown: rank 0: shut down with a device copy into or out of smddp's memory still running after 0.5s"
    ), lines
    assert lines[2] == "alive", lines
