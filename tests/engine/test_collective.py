"""The engine's collective state machine, without processes or sockets: N daemons' machines driven by
the daemon's rules, their frames delivered in any order; and every refusal a bad frame must meet."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smddp_rigs import _engine_testing

from smddp.errors import ProtocolError
from smddp.proto.dtypes import Kind
from tests.layout_reference import GatherLayout, ReduceLayout

CHUNK = 4096


def make(
    kind: Kind,
    count: int,
    node: int = 0,
    nnodes: int = 2,
    local: int = 1,
    itemsize: int = 4,
    has_op: bool | None = None,
    root: int = 0,
    chunk: int = CHUNK,
    replicate: int = 0,
    widened: bool = False,
    seq: int = 7,
) -> _engine_testing.Collective:
    if has_op is None:
        has_op = kind in (Kind.ALLREDUCE, Kind.REDUCE_SCATTER)
    return _engine_testing.Collective(
        f"node {node}", seq, int(kind), itemsize, widened, count, has_op, root, node, nnodes, local,
        nnodes * local, chunk, replicate,
    )  # fmt: skip


@dataclass
class Node:
    """One daemon's side of a collective, driven the way smddp/daemon/node.py drives it."""

    j: int
    sm: _engine_testing.Collective
    outbox: list[tuple] = field(default_factory=list)  # (to, type, shard, offset, length)
    done_calls: int = 0
    covered: list[tuple[int, int]] = field(default_factory=list)  # result ranges written here

    def complete(self) -> None:
        if self.sm.chunk_completed():
            self.done_calls += 1


def run_exchange(
    kind: Kind, count: int, nnodes: int, local: int, itemsize: int, replicate: int, order: random.Random
):
    nodes = [
        Node(j, make(kind, count, j, nnodes, local, itemsize, replicate=replicate)) for j in range(nnodes)
    ]
    peers = lambda j: [k for k in range(nnodes) if k != j]  # noqa: E731

    def server_reduce(n: Node, index: int) -> None:
        _, _, a, b = n.sm.own_chunk(index)
        n.covered.append((a, b))
        if kind != Kind.REDUCE_SCATTER and not n.sm.replicated:
            for k in peers(n.j):
                n.outbox.append((k, "RESULT", n.j, a * itemsize, (b - a) * itemsize))
        n.complete()

    def partial_in(n: Node, index: int, frm: int) -> None:
        if n.sm.partial_arrived(index, frm, f"node {frm}"):
            server_reduce(n, index)

    for n in nodes:
        for r in range(local):
            all_in = n.sm.submit(r, f"rank {n.j * local + r}")
            assert all_in == (r == local - 1)
        for shard, index, a, b in n.sm.local_tasks():
            if n.sm.is_gather:
                for k in peers(n.j):
                    n.outbox.append((k, "BLOCK", n.j, a, b - a))
                n.covered.append((a, b))
                n.complete()
            elif nnodes == 1:
                n.covered.append((a, b))
                n.complete()
            elif n.sm.replicated:
                for k in peers(n.j):
                    n.outbox.append((k, "PARTIAL", 0, a * itemsize, (b - a) * itemsize))
                partial_in(n, index, n.j)
            elif shard == n.j:
                partial_in(n, index, n.j)
            else:
                n.outbox.append((shard, "PARTIAL", shard, a * itemsize, (b - a) * itemsize))
                if kind == Kind.REDUCE_SCATTER:
                    n.complete()
    # Deliver every frame, in a random order across links (in order within one link, as TCP does).
    while any(n.outbox for n in nodes):
        sender = order.choice([n for n in nodes if n.outbox])
        to, typ, shard, off, length = sender.outbox.pop(0)
        n = nodes[to]
        who = f"node {sender.j}"
        if typ == "PARTIAL":
            index, a, b = n.sm.locate_partial(sender.j, shard, off, length, who, f"node {to}")
            assert (b - a) * itemsize == length
            partial_in(n, index, sender.j)
        elif typ == "RESULT":
            _, a, b = n.sm.locate_result(sender.j, shard, off, length, who)
            n.covered.append((a, b))
            n.complete()
        else:
            _, a, b = n.sm.locate_block(sender.j, off, length, who)
            assert (a, b - a) == (off, length)
            n.covered.append((a, b))
            n.complete()
    return nodes


KINDS = [Kind.ALLREDUCE, Kind.REDUCE_SCATTER, Kind.ALLGATHER, Kind.BROADCAST, Kind.BARRIER]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(KINDS),
    st.integers(0, 40 * CHUNK),
    st.integers(1, 5),
    st.integers(1, 3),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([0, 8 * CHUNK, 1 << 30]),
    st.integers(0, 2**32),
)
def test_every_node_completes_once_and_covers_its_result(
    kind, count, nnodes, local, itemsize, replicate, seed
):
    world = nnodes * local
    if kind == Kind.BARRIER:
        count = 0
    if kind == Kind.REDUCE_SCATTER:
        count -= count % world
    nodes = run_exchange(kind, count, nnodes, local, itemsize, replicate, random.Random(seed))
    for n in nodes:
        assert n.sm.done and n.done_calls == 1
        # What this node wrote into its result, exactly once each, is everything the ranks read.
        spans = sorted(x for x in n.covered if x[1] > x[0])
        want = n.sm.own_range if kind == Kind.REDUCE_SCATTER else (0, n.sm.result_bytes // (
            1 if n.sm.is_gather else itemsize))  # fmt: skip
        if kind == Kind.BROADCAST:
            want = (0, count * itemsize)
        pos = want[0]
        for a, b in spans:
            assert a == pos, (spans, want)
            pos = b
        assert pos == want[1]
        assert all(not n.sm.lacks_from(k) for k in range(nnodes)) and n.sm.late_nodes() == []
        assert not n.sm.may_retire
        n.sm.send_started()
        retires = [n.sm.release(r, f"rank {r}") for r in range(local)]
        assert retires == [False] * local
        assert n.sm.send_finished() and n.sm.may_retire


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from([Kind.ALLREDUCE, Kind.REDUCE_SCATTER, Kind.ALLGATHER, Kind.BROADCAST]),
    st.integers(0, 300 * CHUNK),
    st.integers(1, 9),
    st.integers(1, 4),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([4096, 5000, 1 << 20]),
    st.sampled_from([0, 1 << 20]),
)
def test_tasks_and_layout_match_the_python_planner(kind, count, nnodes, local, itemsize, chunk, replicate):
    """The engine's layout is the one proto/layout.py plans (and the daemon used before the engine)."""
    world = nnodes * local
    if kind == Kind.REDUCE_SCATTER:
        count -= count % world
    for node in {0, nnodes - 1, nnodes // 2}:
        root = world - 1 if kind == Kind.BROADCAST else 0
        sm = make(kind, count, node, nnodes, local, itemsize, chunk=chunk, replicate=replicate, root=root)
        tasks = sm.local_tasks()
        if kind.is_gather:
            nbytes = count * itemsize
            lay = (
                GatherLayout.allgather(nbytes, nnodes, local, chunk)
                if kind == Kind.ALLGATHER
                else GatherLayout.broadcast(nbytes, nnodes, (world - 1) // local, chunk)
            )
            assert [(a, b) for _, _, a, b in tasks] == lay.chunks(node)
            assert sm.result_bytes == lay.total_bytes and sm.server_rows == 0
            continue
        replicated = nnodes > 1 and kind == Kind.ALLREDUCE and count * itemsize * (nnodes - 1) <= replicate
        assert sm.replicated == replicated
        lay = ReduceLayout.build(count, itemsize, 1 if replicated else nnodes, chunk)
        if replicated:
            want = lay.chunks(0)
        else:
            per_shard = lay.all_chunks()
            order = [(node + 1 + k) % nnodes for k in range(nnodes)]
            want = [
                per_shard[j][i]
                for i in range(max(len(c) for c in per_shard))
                for j in order
                if i < len(per_shard[j])
            ]
        assert tasks == [(c.shard, c.index, c.start, c.end) for c in want]
        own = lay.shards()[0 if replicated else node]
        assert sm.own_range == own and sm.server_rows == (nnodes if nnodes > 1 else 0)
        assert sm.own_in_input == (nnodes > 1 and local == 1 and not replicated)
        for i, c in enumerate(lay.chunks(0 if replicated else node)):
            assert sm.own_chunk(i) == (c.shard if not replicated else 0, c.index, c.start, c.end)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        (
            {"kind": Kind.ALLREDUCE, "count": 4, "has_op": False},
            "node 0: collective #7 (allreduce) without a reduce op",
        ),
        (
            {"kind": Kind.BROADCAST, "count": 4, "has_op": True},
            "node 0: collective #7 (broadcast) carries a reduce op",
        ),
        ({"kind": Kind.BROADCAST, "count": 4, "root": 2}, "node 0: broadcast root 2 out of range"),
        ({"kind": Kind.ALLGATHER, "count": 4, "root": 1}, "node 0: root set on allgather"),
        ({"kind": Kind.REDUCE_SCATTER, "count": 5}, "node 0: reduce_scatter of 5 elements over 2 ranks"),
        ({"kind": Kind.BARRIER, "count": 1}, "node 0: barrier with data"),
        ({"kind": Kind.ALLREDUCE, "count": 2**38 + 1}, "node 0: collective #7 is larger than 1 TiB"),
        ({"kind": Kind.ALLGATHER, "count": 2**39}, "node 0: collective #7 is larger than 1 TiB"),
        ({"kind": Kind.ALLREDUCE, "count": 2**63 - 1}, "larger than 1 TiB"),
        ({"kind": 9, "count": 4}, "node 0: collective #7 of unknown kind 9"),
        ({"kind": Kind.ALLREDUCE, "count": 2**36, "chunk": 1}, "more than 2**24 chunks"),
        (
            {"kind": Kind.ALLREDUCE, "count": 2**24 + 1, "chunk": 4},
            "more than 2**24 chunks (raise --chunk-kb)",
        ),
    ],
)
def test_refused_collectives(kw, why):
    with pytest.raises(ProtocolError, match=why.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        make(**kw)


def test_negative_and_oversized_values_are_refused():
    with pytest.raises(ProtocolError):
        make(Kind.ALLREDUCE, -1)
    with pytest.raises(TypeError):  # beyond 64 bits: no binding takes it (nanobind names the types it takes)
        make(Kind.ALLREDUCE, 2**64)
    sm = make(Kind.ALLREDUCE, 10 * CHUNK)
    for args in [(-1, 0, 0, 4), (1, 0, -4, 4), (1, 0, 0, -4), (2**32, 0, 0, 4)]:
        with pytest.raises(ProtocolError):
            sm.locate_partial(*args, "node 1", "node 0")
    with pytest.raises(TypeError):  # beyond 64 bits: no binding takes it (nanobind names the types it takes)
        sm.locate_result(1, 1, 2**64, 4, "node 1")


def test_bad_frames_are_refused_with_the_sender_named():
    n = CHUNK // 4  # elements per chunk
    sm = make(Kind.ALLREDUCE, 4 * n, node=0)  # shard 0: chunks 0-1, shard 1: chunks 0-1
    with pytest.raises(ProtocolError, match="node 1 sent a partial of shard 1 to node 0"):
        sm.locate_partial(1, 1, 2 * CHUNK, CHUNK, "node 1", "node 0")
    with pytest.raises(ProtocolError, match="does not match chunk"):
        sm.locate_partial(1, 0, 4, CHUNK, "node 1", "node 0")
    with pytest.raises(ProtocolError, match="outside shard 0"):
        sm.locate_partial(1, 0, 2 * CHUNK, CHUNK, "node 1", "node 0")
    assert sm.locate_partial(1, 0, CHUNK, CHUNK, "node 1", "node 0") == (1, n, 2 * n)
    assert sm.partial_arrived(1, 1, "node 1") is False
    with pytest.raises(ProtocolError, match="node 1 sent chunk 1 of #7 twice"):
        sm.locate_partial(1, 0, CHUNK, CHUNK, "node 1", "node 0")
    with pytest.raises(ProtocolError, match="node 1 sent chunk 1 of #7 twice"):
        sm.partial_arrived(1, 1, "node 1")
    with pytest.raises(ProtocolError, match="node 1 sent a result of shard 0"):
        sm.locate_result(1, 0, 0, CHUNK, "node 1")
    assert sm.locate_result(1, 1, 2 * CHUNK, CHUNK, "node 1") == (0, 2 * n, 3 * n)
    with pytest.raises(ProtocolError, match=r"node 1 sent RESULT \[8192, \+4096\) of #7 twice"):
        sm.locate_result(1, 1, 2 * CHUNK, CHUNK, "node 1")
    with pytest.raises(ProtocolError, match="node 1 sent BLOCK for allreduce #7"):
        sm.locate_block(1, 0, 0, "node 1")
    with pytest.raises(ProtocolError, match="chunk 5 is not one this node serves"):
        sm.own_chunk(5)
    with pytest.raises(ProtocolError, match="node 1 released collective #7, which it does not hold"):
        sm.release(0, "node 1")
    gather = make(Kind.ALLGATHER, 10, node=1)
    with pytest.raises(ProtocolError, match="node 0 sent PARTIAL for allgather #7"):
        gather.locate_partial(0, 1, 0, 4, "node 0", "node 1")
    with pytest.raises(ProtocolError, match="node 0 sent RESULT for allgather #7"):
        gather.locate_result(0, 0, 0, 4, "node 0")
    with pytest.raises(ProtocolError, match="not a chunk of the block"):
        gather.locate_block(0, 40, 40, "node 0")
    assert gather.locate_block(0, 0, 40, "node 0") == (0, 0, 40)
    with pytest.raises(ProtocolError, match=r"node 0 sent BLOCK \[0, \+40\) of #7 twice"):
        gather.locate_block(0, 0, 40, "node 0")
    with pytest.raises(ProtocolError, match="contributes no block"):
        gather.locate_block(5, 0, 0, "node 5")


def test_submit_twice_and_release_twice():
    sm = make(Kind.ALLREDUCE, 0, nnodes=1, local=2)
    assert sm.submit(0, "rank 0") is False
    with pytest.raises(ProtocolError, match="rank 0 submitted collective #7 twice"):
        sm.submit(0, "rank 0")
    assert sm.submit(1, "rank 1") is True
    with pytest.raises(ProtocolError, match="not a local rank"):
        sm.submit(2, "rank 2")
    assert sm.chunk_completed() is True and sm.done
    assert sm.chunk_completed() is False  # done once only
    assert sm.release(0, "rank 0") is False
    with pytest.raises(ProtocolError, match="rank 0 released collective #7, which it does not hold"):
        sm.release(0, "rank 0")
    assert sm.release(1, "rank 1") is True


def test_a_partial_after_completion_is_refused_and_server_rows_are_freed():
    sm = make(Kind.ALLREDUCE, 2, node=0)  # one element per node
    sm.submit(0, "rank 0")
    assert sm.server_live
    assert sm.partial_arrived(0, 0, "node 0") is False
    assert sm.partial_arrived(0, 1, "node 1") is True
    assert not sm.chunk_completed()  # our server reduce; the RESULT of shard 1 is still due
    assert sm.lacks_from(1) and sm.late_nodes() == []
    sm.locate_result(1, 1, 4, 4, "node 1")
    assert sm.chunk_completed() and not sm.server_live and not sm.lacks_from(1)
    with pytest.raises(ProtocolError, match="node 1 sent a partial of #7 after it was complete"):
        sm.locate_partial(1, 0, 0, 4, "node 1", "node 0")


def test_stall_report_names_late_nodes():
    sm = make(Kind.ALLREDUCE, 3 * (CHUNK // 4), node=1, nnodes=3)  # one chunk per shard
    assert sm.late_nodes() == [0, 2]
    sm.partial_arrived(0, 2, "node 2")
    assert sm.late_nodes() == [0]
    gather = make(Kind.ALLGATHER, 4, node=1, nnodes=3, local=2)
    assert gather.late_nodes() == [0, 1, 2]
    gather.submit(0, "rank 2")
    gather.submit(1, "rank 3")
    gather.locate_block(2, 2 * 32, 32, "node 2")
    assert gather.late_nodes() == [0]
