"""The local plane (smddp/engine/local_plane.h) driven through real rings in shared memory, without
processes or sockets: results bit-exact against tests/reference.py for every kind and type, DONE on
every worker's ring, memory back on release, and every refusal a failure event naming who did what."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest

from smddp import _engine
from smddp.daemon.config import PlaneConfig
from smddp.daemon.stats import LATENCY_BUCKETS, SIZE_LIMITS
from smddp.proto import decode_header
from smddp.proto.dtypes import DType, Kind, ReduceOp
from smddp.proto.frames import Header, MsgType
from smddp.proto.messages import Done, Release, Submit
from tests import reference

NO_SEGMENT = 2**32 - 1


class Rig:
    """A plane with `n` workers: each a channel and one input segment, as the client makes them."""

    def __init__(self, n: int) -> None:
        self.n, self.first = n, 0
        self.results = _engine.Arena("rig-results", 1 << 20)
        config = PlaneConfig(
            node=0,
            local_size=n,
            world=n,
            first_rank=0,
            nnodes=1,
            chunk_bytes=4096,
            rank_names=tuple(f"rank {i}" for i in range(n)),
            me="node 0",
            spin_us=5.0,
            push_timeout_s=10.0,
            threads=2,
            size_limits=SIZE_LIMITS,
            latency_buckets=LATENCY_BUCKETS,
        )
        self.plane = _engine.LocalPlane(config, self.results)
        self.channels = [_engine.WorkerChannel(f"rig-ch{i}") for i in range(n)]
        self.inputs = [_engine.segment_create(1, 1 << 20, f"rig-in{i}") for i in range(n)]
        self.seq = [0] * n
        for i, ch in enumerate(self.channels):
            self.plane.name_rank(i, f"rank {i} (pid {100 + i})")
            # The plane owns the side socket's end it is given (the channel closes its own).
            self.plane.add_worker(i, i, f"rank {i} (pid {100 + i})", ch.segment, os.dup(ch.daemon_end))
            ch.close_daemon_end()
            ch.attach(self.inputs[i], i, 5.0, 0.0)  # the ATTACH, ahead of every SUBMIT on the ring

    def submit(self, i: int, kind: Kind, dtype: DType, data: np.ndarray | None, count: int, op=None, root=0):
        self.seq[i] += 1
        seg = NO_SEGMENT
        if data is not None:
            raw = data.view(np.uint8)
            np.frombuffer(memoryview(self.inputs[i]), np.uint8)[: raw.size] = raw  # type: ignore[arg-type]
            seg = 1
        hdr = Submit(self.first + i, self.seq[i], seg, 0, root, count, dtype, op, kind).header().encode()
        self.channels[i].push(hdr, 5.0, 0.0)

    def events(self, timeout: float = 0.2) -> list[tuple]:
        out = []
        while (e := self.plane.next_event(timeout)) is not None:
            out.append(e)
        return out

    def done(self, i: int, timeout: float = 5.0) -> Done:
        got = self.channels[i].pop(timeout, 0.0)
        assert isinstance(got, _engine.Unmatched), f"no DONE for worker {i}: {got!r}"
        return Done.of(decode_header(got.header))

    def result(self, d: Done, nbytes: int) -> np.ndarray:
        # The channel that popped the DONE took its SEGMENT in first.
        seg = next(s for ch in self.channels if (s := ch.result(d.segment)) is not None)
        return np.frombuffer(memoryview(seg), np.uint8)[d.offset : d.offset + nbytes]

    def release(self, i: int, seq: int) -> None:
        self.channels[i].push(Release(self.first + i, seq).header().encode(), 5.0, 0.0)

    def close(self) -> None:
        self.plane.close()


@pytest.fixture
def rig():
    made: list[Rig] = []

    def make(n: int = 3, **kw) -> Rig:
        made.append(Rig(n, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def rng_inputs(dtype: DType, n: int, count: int, seed: int) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    if dtype in (DType.UINT8, DType.INT32, DType.INT64):
        return [g.integers(-100, 100, count).astype(dtype.storage) for _ in range(n)]
    vals = [g.standard_normal(count).astype(np.float32) for _ in range(n)]
    if dtype == DType.BFLOAT16:
        return [(v.view(np.uint32) >> 16).astype(np.uint16) for v in vals]
    return [v.astype(dtype.storage) for v in vals]


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("op", list(ReduceOp))
def test_allreduce_is_the_reference_on_every_ring(rig, dtype, op):
    r = rig(3)
    count = 5000  # more than one 16-bit kernel block, and not a multiple of one
    xs = rng_inputs(dtype, 3, count, seed=int(dtype) * 10 + int(op))
    for i in range(3):
        r.submit(i, Kind.ALLREDUCE, dtype, xs[i], count, op)
    want = reference.allreduce([x.copy() for x in xs], dtype.name.lower(), op.name.lower(), 1)
    for i in range(3):
        d = r.done(i)
        assert (d.seq, d.kind, d.dtype, d.count, d.op) == (1, Kind.ALLREDUCE, dtype, count, op)
        got = r.result(d, count * dtype.itemsize)
        assert got.tobytes() == np.ascontiguousarray(want).view(np.uint8).tobytes()
        r.release(i, 1)
    assert [e for e in r.events() if isinstance(e, _engine.PlaneFailure)] == []
    for _ in range(100):
        if len(r.plane) == 0:
            break
        r.events(0.01)
    assert len(r.plane) == 0 and r.results.in_use == 0  # retired, its slot back


def test_gathers_broadcast_and_barrier(rig):
    r = rig(3)
    xs = [np.arange(10, dtype=np.int64) + 100 * i for i in range(3)]
    for i in range(3):
        r.submit(i, Kind.ALLGATHER, DType.INT64, xs[i], 10)
    for i in range(3):
        d = r.done(i)
        assert r.result(d, 240).view(np.int64).tolist() == np.concatenate(xs).tolist()
        r.release(i, 1)
    # Broadcast from rank 1: the others send no data.
    src = np.linspace(0, 1, 33).astype(np.float32)
    for i in range(3):
        r.submit(i, Kind.BROADCAST, DType.FLOAT32, src if i == 1 else None, 33, root=1)
    for i in range(3):
        d = r.done(i)
        assert r.result(d, 132).tobytes() == src.tobytes()
        r.release(i, 2)
    for i in range(3):
        r.submit(i, Kind.BARRIER, DType.UINT8, None, 0)
    assert [r.done(i).seq for i in range(3)] == [3, 3, 3]
    assert r.plane.counters().collectives == 3
    rows = r.plane.take_completions()
    assert sorted((c.kind, c.completed) for c in rows) == sorted(
        [(Kind.ALLGATHER, 1), (Kind.BROADCAST, 1), (Kind.BARRIER, 1)]
    )
    assert r.plane.take_completions() == []  # taken


def test_completions_come_summed_by_class_not_one_by_one(rig):
    """The daemon's statistics get a few summed rows, however many collectives completed: each row's
    size class and latency bucket are the ones smddp.daemon.stats would give each collective."""
    r = rig(2)
    small, large = np.ones(4, np.float32), np.ones((64 << 10) // 4 + 1, np.float32)  # 16 B; 64 KiB + 4 B
    t0 = time.monotonic()
    for x, times in ((small, 30), (large, 3)):
        for _ in range(times):
            for i in range(2):
                r.submit(i, Kind.ALLREDUCE, DType.FLOAT32, x, x.size, ReduceOp.SUM)
            for i in range(2):
                d = r.done(i)
                r.release(i, d.seq)
    elapsed = time.monotonic() - t0
    rows = r.plane.take_completions()
    assert sum(c.completed for c in rows) == 33
    by_class = {}
    for c in rows:
        assert (c.kind, c.dtype) == (Kind.ALLREDUCE, DType.FLOAT32)
        by_class[c.size_class] = by_class.get(c.size_class, 0) + c.completed
        # every latency in this row lies in its bucket: so does their mean
        lo = LATENCY_BUCKETS[c.bucket - 1] if c.bucket > 0 else 0.0
        hi = LATENCY_BUCKETS[c.bucket] if c.bucket < len(LATENCY_BUCKETS) else float("inf")
        assert lo < c.seconds / c.completed <= hi
        assert c.seconds <= elapsed
    assert by_class == {0: 30, 1: 3}  # <=64KiB, <=1MiB
    assert len(rows) <= 2 * (len(LATENCY_BUCKETS) + 1)


def test_bye_is_seen_after_everything_before_it(rig):
    r = rig(2)
    x = np.ones(4, np.float32)
    for i in range(2):
        r.submit(i, Kind.ALLREDUCE, DType.FLOAT32, x, 4, ReduceOp.SUM)
    for i in range(2):
        r.release(i, r.done(i).seq)
        r.channels[i].push(Header(MsgType.BYE, sender=i).encode(), 5.0, 0.0)
        assert r.plane.remove_worker(i) is True
    assert r.plane.all_ranks_gone()
    assert [e for e in r.events() if isinstance(e, _engine.PlaneFailure)] == []


def failure(r: Rig, timeout: float = 5.0) -> tuple[str, str]:
    for _ in range(int(timeout / 0.1)):
        for e in r.events(0.1):
            if isinstance(e, _engine.PlaneFailure):
                return e.fault, e.why
    raise AssertionError("the plane did not fail")


def test_a_mismatch_names_both_calls(rig):
    r = rig(2)
    r.submit(0, Kind.ALLREDUCE, DType.FLOAT32, np.ones(8, np.float32), 8, ReduceOp.SUM)
    r.submit(1, Kind.ALLREDUCE, DType.INT32, np.ones(8, np.int32), 8, ReduceOp.SUM)
    fault, why = failure(r)
    assert fault == "mismatch" and "float32" in why and "int32" in why and "rank 1 (pid 101)" in why, why


def test_out_of_bounds_and_unattached_segments_are_refused(rig):
    r = rig(2)
    hdr = Submit(0, 1, 1, (1 << 20) - 8, 0, 4, DType.FLOAT32, ReduceOp.SUM, Kind.ALLREDUCE).header().encode()
    r.channels[0].push(hdr, 5.0, 0.0)
    fault, why = failure(r)
    assert fault == "protocol" and why.startswith(
        "rank 0 (pid 100) submitted collective #1 outside its memory"
    ), why
    # The ring is the one ordered channel: a segment not attached ahead of the SUBMIT never was.
    r2 = rig(1)
    hdr = Submit(0, 1, 9, 0, 0, 4, DType.FLOAT32, ReduceOp.SUM, Kind.ALLREDUCE).header().encode()
    r2.channels[0].push(hdr, 5.0, 0.0)
    # Refused at once, not after a wait for the segment: an ATTACH of it right behind (itself refused,
    # its fd never sent) is never reached.
    r2.channels[0].push(Header(MsgType.ATTACH, sender=0, shard=9, offset=4096).encode(), 5.0, 0.0)
    fault, why = failure(r2)
    assert fault == "protocol" and "named segment 9, which it never attached" in why, why
    # An ATTACH pushed without its fd on the side socket.
    r3 = rig(1)
    r3.channels[0].push(Header(MsgType.ATTACH, sender=0, shard=5, offset=4096).encode(), 5.0, 0.0)
    fault, why = failure(r3)
    assert (
        fault == "protocol" and "wrote ATTACH of segment 5's fd was not sent before its descriptor" in why
    ), why


def test_garbage_and_impostors_fail_the_plane(rig):
    r = rig(2)
    r.channels[0].push(b"\xff" * 56, 5.0, 0.0)
    fault, why = failure(r)
    assert fault == "protocol" and "wrote a descriptor that is not a frame: bad magic" in why, why
    r2 = rig(2)
    r2.channels[1].push(Release(0, 1).header().encode(), 5.0, 0.0)  # rank 1 claiming to be rank 0
    fault, why = failure(r2)
    assert fault == "protocol" and "claiming to be rank 0" in why, why
    r3 = rig(1)
    r3.channels[0].push(
        Header(MsgType.PARTIAL, sender=0, dtype=DType.FLOAT32, kind=Kind.ALLREDUCE).encode(), 5.0, 0.0
    )
    fault, why = failure(r3)
    assert "wrote PARTIAL, which workers may not write on their ring" in why, why


def test_a_rank_gone_without_joining_fails_what_waits_for_it(rig):
    r = rig(2)
    r.submit(0, Kind.ALLREDUCE, DType.FLOAT32, np.ones(8, np.float32), 8, ReduceOp.SUM)
    r.events(0.2)
    from smddp.errors import PeerLostError

    with pytest.raises(PeerLostError, match="rank 1 was killed"):
        r.plane.rank_left_early(1, False, "rank 1 was killed by signal 9 without joining the job")


def test_float16_nan_blocks_follow_the_engine_rule(rig):
    r = rig(2)
    a = np.ones(3000, np.float16)
    b = np.full(3000, 2, np.float16)
    a[5] = np.float16("nan")
    b[2500] = np.float16("inf")
    a[2500] = np.float16("-inf")
    for i, x in enumerate((a, b)):
        r.submit(i, Kind.ALLREDUCE, DType.FLOAT16, x, 3000, ReduceOp.SUM)
    got = r.result(r.done(0), 6000).view(np.float16)
    with np.errstate(invalid="ignore"):  # inf + -inf
        want = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
    assert np.isnan(got[5]) and np.isnan(got[2500])
    ok = ~np.isnan(want)
    assert got[ok].tobytes() == want[ok].tobytes()


def test_two_takers_share_the_done_ring_and_take_each_done_once(rig):
    """The done ring has one consumer at a time: two threads popping it (the background taker's pop,
    as the client's DONE thread and the plane tests do) take every DONE exactly once between them,
    and neither sleeps out its whole timeout while the other has the ring."""
    import threading
    import time

    r = rig(1)
    x = np.ones(256, np.float32)
    stop = threading.Event()
    taken: list[list[int]] = [[], []]

    def taker(k: int) -> None:
        while not stop.is_set():
            got = r.channels[0].pop(0.05, 0.0)
            if got is not None:
                taken[k].append(Done.of(decode_header(got.header)).seq)

    other = threading.Thread(target=taker, args=(1,))
    other.start()
    try:
        for seq in range(1, 201):
            r.submit(0, Kind.ALLREDUCE, DType.FLOAT32, x, 256, ReduceOp.SUM)
            deadline = time.monotonic() + 5.0
            while seq not in taken[0] and seq not in taken[1]:
                assert time.monotonic() < deadline, f"nobody took the DONE of #{seq}"
                got = r.channels[0].pop(0.05, 0.0)
                if got is not None:
                    taken[0].append(Done.of(decode_header(got.header)).seq)
            r.release(0, seq)
    finally:
        stop.set()
        other.join()
    assert sorted(taken[0] + taken[1]) == list(range(1, 201))  # each once


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.BFLOAT16, DType.INT64])
def test_large_allreduce_on_the_compute_threads(rig, dtype):
    """Over 64 KiB: the plane's compute threads share its chunks (4 KiB each here); same bits."""
    r = rig(3)
    count = 100_003
    xs = rng_inputs(dtype, 3, count, seed=7)
    for i in range(3):
        r.submit(i, Kind.ALLREDUCE, dtype, xs[i], count, ReduceOp.AVG)
    want = reference.allreduce([x.copy() for x in xs], dtype.name.lower(), "avg", 1)
    for i in range(3):
        d = r.done(i)
        got = r.result(d, count * dtype.itemsize)
        assert got.tobytes() == np.ascontiguousarray(want).view(np.uint8).tobytes()
        r.release(i, d.seq)
    assert [e for e in r.events() if isinstance(e, _engine.PlaneFailure)] == []


@pytest.mark.parametrize(
    ("field", "value", "want"),
    [
        ("chunk_bytes", "4096", "an int"),
        ("trace", 1, "a bool"),
        ("rank_names", "rank 0", "a sequence of str"),
        ("size_limits", (2, 1), "a sequence of numbers, ascending, at most 255"),
        ("latency_buckets", ("0.1",), "a sequence of numbers, ascending, at most 255"),
        ("size_limits", (-1,), "a sequence of numbers, ascending, at most 255"),
    ],
)
def test_a_plane_config_field_of_the_wrong_type_is_named(field, value, want):
    """The plane reads its PlaneConfig by name: a field of the wrong type is refused, naming it."""
    good = PlaneConfig(
        node=0, local_size=1, world=1, first_rank=0, nnodes=1, chunk_bytes=4096, rank_names=("rank 0",),
        me="node 0", spin_us=0.0, push_timeout_s=1.0, threads=0,
    )  # fmt: skip
    results = _engine.Arena("rig-config", 1 << 20)
    _engine.LocalPlane(good, results).close()
    with pytest.raises(TypeError, match=rf"PlaneConfig\.{field} must be {want}"):
        _engine.LocalPlane(dataclasses.replace(good, **{field: value}), results)
