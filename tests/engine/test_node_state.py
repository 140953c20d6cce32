"""The daemon's table of collectives (smddp/engine/node_state.h), without processes or sockets: fingerprints
and their mismatch messages, sequence order, retirement, and the job-wide rules for ranks and nodes that left."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from smddp_rigs import _engine_testing

from smddp.errors import CollectiveMismatchError, PeerLostError, ProtocolError
from smddp.proto.dtypes import DType, Kind, ReduceOp
from smddp.proto.frames import SUBMIT_WINDOW


def describe(kind: Kind, dtype: DType, count: int, op: ReduceOp | None, root: int) -> str:
    """How a collective's fingerprint reads in an error message, as the daemon's Python wrote it before the engine took its table (kept here as the reference)."""
    extra = f", op={op.name.lower()}" if op is not None else ""
    if kind == Kind.BROADCAST:
        extra = f", root={root}"
    elif kind == Kind.ALLREDUCE and root:
        extra += f", one of {root} pieces"  # a large buffer pipelined as `root` all-reduces
    return f"{kind.label}({dtype.label}, count={count}{extra})"


F32, I32 = DType.FLOAT32, DType.INT32


def table(node: int = 0, nnodes: int = 2, local: int = 2, replicate: int = 0) -> _engine_testing.NodeState:
    t = _engine_testing.NodeState(
        node, nnodes, local, nnodes * local, 4096, replicate,
        [f"node {j}" for j in range(nnodes)], [f"rank {node * local + i}" for i in range(local)],
    )  # fmt: skip
    for i in range(local):
        t.name_rank(i, f"rank {node * local + i} (pid {100 + i})")
    return t


def spec(
    seq: int,
    kind: Kind = Kind.ALLREDUCE,
    dtype: DType = F32,
    count: int = 8,
    op: int = ReduceOp.SUM,
    root: int = 0,
):
    return (
        seq,
        int(kind),
        int(dtype),
        dtype.itemsize,
        dtype.accumulator != dtype.storage,
        count,
        int(op),
        root,
    )


def test_first_sight_creates_and_every_rank_joins_it():
    t = table()
    sm, all_in = t.submit(0, *spec(1))
    assert isinstance(sm, _engine_testing.Collective) and not all_in and len(t) == 1
    again, all_in = t.submit(1, *spec(1))
    assert again is None and all_in  # found, not created: the daemon keeps its memory for it
    # A peer's frame for a collective we have not seen yet creates it too.
    assert isinstance(t.op_for(*spec(2), "node 1"), _engine_testing.Collective) and len(t) == 2
    assert t.op_for(*spec(2), "node 1") is None


def test_each_rank_submits_each_number_once_within_its_window():
    """A rank's SUBMITs may come out of order (a device collective's goes once its copy lands, and the
    ones after it do not wait), each number once, less than the window past the lowest it has not
    sent: one further on, or one sent again, is a protocol error naming the rank and the number."""
    w = SUBMIT_WINDOW  # (the engine's kSubmitWindow is generated from it: wire.h)
    t = table()
    with pytest.raises(
        ProtocolError, match=rf"rank 0 \(pid 100\) submitted collective #{w + 1}, expected #1 to #{w}"
    ):
        t.submit(0, *spec(w + 1))
    t = table()
    t.submit(0, *spec(3))  # ahead of #1 and #2, within the window
    t.submit(0, *spec(w))  # the window's far end
    with pytest.raises(ProtocolError, match=r"rank 0 \(pid 100\) submitted collective #3 twice"):
        t.submit(0, *spec(3))
    t = table()
    for seq in (2, 1, 3):
        t.submit(0, *spec(seq))
    with pytest.raises(ProtocolError, match="submitted collective #1 twice"):
        t.submit(0, *spec(1))
    t.submit(0, *spec(3 + w))  # #1 to #3 are in: the window starts at #4 now
    with pytest.raises(ProtocolError, match=rf"submitted collective #{4 + w}, expected #4 to #{3 + w}"):
        t.submit(0, *spec(4 + w))


def test_a_rank_that_said_bye_with_a_number_missing_is_a_protocol_error():
    t = table()
    t.submit(0, *spec(1))
    t.submit(0, *spec(3))
    with pytest.raises(
        ProtocolError,
        match=r"rank 0 \(pid 100\) said BYE without submitting collective #2, though it submitted #3",
    ):
        t.rank_said_bye(0)


@pytest.mark.parametrize(
    ("other", "called"),
    [
        (spec(1, count=9), "allreduce(float32, count=9, op=sum)"),
        # Same itemsize, other type: the bytes would add up to nonsense, so this is a mismatch too.
        (spec(1, dtype=I32), "allreduce(int32, count=8, op=sum)"),
        (spec(1, op=ReduceOp.MAX), "allreduce(float32, count=8, op=max)"),
        (spec(1, root=3), "allreduce(float32, count=8, op=sum, one of 3 pieces)"),
        (spec(1, Kind.BROADCAST, op=0, root=1), "broadcast(float32, count=8, root=1)"),
    ],
)
def test_a_different_fingerprint_is_a_mismatch_naming_both(other, called):
    t = table()
    t.submit(0, *spec(1))
    with pytest.raises(CollectiveMismatchError) as e:
        t.submit(1, *other)
    assert str(e.value) == (
        f"collective #1 mismatch: rank 0 (pid 100) called allreduce(float32, count=8, op=sum) "
        f"but rank 1 (pid 101) called {called}"
    )
    # From a peer's frame the same.
    with pytest.raises(CollectiveMismatchError, match=r"but node 1 called"):
        t.op_for(*other, "node 1")


def test_the_collectives_own_checks_come_first():
    t = table()
    with pytest.raises(ProtocolError, match=r"node 1: collective #1 \(allreduce\) without a reduce op"):
        t.op_for(*spec(1, op=0), "node 1")
    assert len(t) == 0


def test_release_and_sends_retire_it_once():
    t = table(local=2)
    sm, _ = t.submit(0, *spec(1))
    t.submit(1, *spec(1))
    while not sm.done:
        sm.chunk_completed()
    sm.send_started()
    assert not t.release(0, 1)
    assert not t.release(1, 1)  # a send is still pending
    assert t.send_finished(1) and len(t) == 0
    with pytest.raises(
        ProtocolError, match=r"rank 0 \(pid 100\) released collective #1, which it does not hold"
    ):
        t.release(0, 1)
    assert not t.send_finished(1)


def test_a_rank_that_said_bye_fails_what_still_needs_it():
    t = table()
    t.submit(0, *spec(1))
    with pytest.raises(CollectiveMismatchError) as e:
        t.rank_said_bye(1)
    # Named as it is known to the job (no pid): the message every rank prints.
    assert str(e.value).startswith(
        "rank 1 shut down while collective #1 allreduce(float32, count=8, op=sum) still needed it: "
        "every rank must issue the same collectives in the same order"
    )
    # And every later collective, whoever names it first.
    with pytest.raises(CollectiveMismatchError, match="rank 1 shut down while collective #2"):
        t.op_for(*spec(2), "node 1")
    with pytest.raises(ProtocolError, match="after BYE"):
        t.submit(1, *spec(2))


def test_bye_with_nothing_pending_is_fine():
    t = table()
    for r in (0, 1):
        t.submit(r, *spec(1))
    t.rank_said_bye(0)  # rank 0 submitted #1: it needs nothing more from rank 0
    assert not t.all_ranks_gone()
    t.rank_said_bye(1)
    assert t.all_ranks_gone()


def test_a_peer_that_said_bye_fails_what_still_waits_for_it():
    t = table(local=1)
    t.submit(0, *spec(1))  # all in here; the partial of node 1 is still due
    with pytest.raises(CollectiveMismatchError, match="every rank of node 1 shut down while collective #1"):
        t.peer_said_bye(1)
    with pytest.raises(ProtocolError, match="not a peer"):
        t.peer_said_bye(0)


def test_a_rank_gone_without_joining():
    t = table()
    assert not t.rank_left_early(0, True, "joined: its connection says the rest")  # it joined
    assert t.rank_left_early(1, False, "rank 1 exited with status 3 without joining the job")
    assert t.left_early(1) and not t.left_early(0)
    assert not t.rank_left_early(1, False, "again")  # recorded once
    with pytest.raises(
        PeerLostError,
        match=r"rank 1 exited with status 3 without joining the job, but collective #1 allreduce\(float32, "
        r"count=8, op=sum\) needs it",
    ):
        t.submit(0, *spec(1))


def test_a_rank_gone_early_while_a_collective_waits():
    t = table()
    t.submit(0, *spec(1))
    with pytest.raises(
        PeerLostError, match=r"^rank 1 was killed by signal 9 without joining, while collective #1 "
    ):
        t.rank_left_early(1, False, "rank 1 was killed by signal 9 without joining")
    t.rank_said_bye(0)
    assert t.all_ranks_gone()


def test_out_of_range_arguments_are_refused():
    t = table()
    with pytest.raises(ProtocolError, match="local rank 2 out of range"):
        t.submit(2, *spec(1))
    with pytest.raises(ProtocolError, match="out of range"):
        t.submit(0, 1, 300, 6, 4, False, 8, 1, 0)
    with pytest.raises(ProtocolError, match="impossible job layout"):
        _engine_testing.NodeState(2, 2, 1, 2, 4096, 0, [], [])


@given(
    kind=st.sampled_from(list(Kind)),
    dtype=st.sampled_from(list(DType)),
    count=st.integers(0, 2**40),
    op=st.sampled_from([None, *ReduceOp]),
    root=st.integers(0, 2**32 - 1),
)
def test_messages_describe_a_collective_as_the_daemon_always_has(kind, dtype, count, op, root):
    """The engine's words for a fingerprint are the daemon's describe(), for every value."""
    t = table()
    first = (1, int(kind), int(dtype), dtype.itemsize, False, count, int(op or 0), root)
    other = (1, int(kind), int(dtype), dtype.itemsize, False, count + 1, int(op or 0), root)
    try:
        t.op_for(*first, "node 1")
    except ProtocolError:
        return  # not a collective at all (the checks' messages are tested elsewhere)
    with pytest.raises(CollectiveMismatchError) as e:
        t.op_for(*other, "node 1")
    assert str(e.value) == (
        f"collective #1 mismatch: node 1 called {describe(kind, dtype, count, op, root)} "
        f"but node 1 called {describe(kind, dtype, count + 1, op, root)}"
    )


def test_a_node_summed_submit_must_be_said_alike_by_the_nodes_ranks():
    """kSubmitNodeSummed (the GPU step across nodes): the node's ranks say it alike, or it is a mismatch
    naming who; only an all-reduce or a reduce-scatter of a job of several nodes may say it."""
    t = table()
    t.submit(0, *spec(1), node_summed=True)
    with pytest.raises(
        CollectiveMismatchError, match=r"#1 mismatch: rank 1 \(pid 101\) did not sum it on the node's GPUs"
    ):
        t.submit(1, *spec(1), node_summed=False)
    t = table()
    t.submit(0, *spec(1))
    with pytest.raises(
        CollectiveMismatchError, match="summed it on the node's GPUs, other ranks of its node did not"
    ):
        t.submit(1, *spec(1), node_summed=True)
    t = table()
    t.submit(0, *spec(1), node_summed=True)
    assert t.submit(1, *spec(1), node_summed=True)[1]  # alike: every local rank is in
    t = table()
    t.submit(0, *spec(1, kind=Kind.REDUCE_SCATTER), node_summed=True)
    assert t.submit(1, *spec(1, kind=Kind.REDUCE_SCATTER), node_summed=True)[1]
    refused = "only an all-reduce or a reduce-scatter of a job of several nodes"
    for kind in (Kind.BROADCAST, Kind.ALLGATHER):
        with pytest.raises(ProtocolError, match=refused):
            table().submit(0, *spec(1, kind=kind, op=0), node_summed=True)
    with pytest.raises(ProtocolError, match=refused):
        table(nnodes=1).submit(0, *spec(1), node_summed=True)
