"""The engine's layout checks: shard ranges equal the Python planner's, and wire offsets near every bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smddp_rigs import _engine_testing

from smddp.errors import ProtocolError
from smddp.proto.layout import shard_bounds, split_range
from tests.layout_reference import GatherLayout, ReduceLayout


@settings(max_examples=1500, deadline=None)
@given(st.integers(0, 2**40), st.integers(1, 2000))
def test_shard_range_is_shard_bounds(count, n):
    bounds = shard_bounds(count, n)
    for j in {0, n // 2, n - 1, min(count % n, n - 1)}:
        assert _engine_testing.shard_range(count, n, j) == bounds[j]


_BIG = st.one_of(st.integers(0, 2**63 - 1), st.sampled_from([0, 1, 2**32, 2**62, 2**63 - 1, 2**63 - 8]))


@settings(max_examples=3000, deadline=None)
@given(
    st.integers(0, 2**40),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 64),
    st.integers(1, 1 << 22),
    st.integers(0, 70),
    _BIG,
    _BIG,
)
def test_reduce_locate_takes_only_real_chunks(count, itemsize, nshards, chunk_bytes, shard, off, length):
    lay = ReduceLayout.build(count, itemsize, nshards, chunk_bytes)
    try:
        c = lay.locate(shard, off, length)
    except ProtocolError:
        return
    # Accepted: it must be exactly the chunk the planner would have sent.
    a, b = shard_bounds(count, nshards)[shard]
    assert c.start == off // itemsize and (c.end - c.start) * itemsize == length
    assert a <= c.start <= c.end <= b and c.count <= lay.chunk_elems
    assert (c.start - a) % lay.chunk_elems == 0 and c.index == (c.start - a) // lay.chunk_elems
    assert c.end == min(c.start + lay.chunk_elems, b)


@settings(max_examples=2000, deadline=None)
@given(st.integers(0, 2**40), st.integers(1, 8), st.integers(1, 1 << 22), st.integers(0, 9), _BIG, _BIG)
def test_block_locate_takes_only_real_chunks(nbytes, nnodes, chunk_bytes, node, off, length):
    lay = GatherLayout.allgather(nbytes, nnodes, 1, chunk_bytes)
    try:
        i = lay.locate(node, off, length)
    except ProtocolError:
        return
    # Chunk i of the block, computed (lay.chunks() would list up to 2**40 of them).
    blk = lay.block_of(node)
    assert blk is not None
    a, b = blk
    start = a + i * chunk_bytes
    assert (off, off + length) == ((a, a) if a == b else (start, min(start + chunk_bytes, b)))
    assert start < b or a == b


def test_negative_and_huge_values_are_refused_not_wrapped():
    with pytest.raises(ProtocolError, match="out of range"):
        _engine_testing.locate_reduce(100, 4, 4, 10, -1, 0, 40)
    with pytest.raises(ProtocolError):
        _engine_testing.locate_reduce(100, 4, 4, 10, 0, 2**63 - 4, 40)
    with pytest.raises(TypeError):  # beyond 64 bits: no binding takes it (nanobind names the types it takes)
        _engine_testing.locate_block(0, 100, 10, 2**64, 10)
    assert split_range(0, 0, 4) == [(0, 0)] and _engine_testing.locate_block(0, 0, 4, 0, 0) == 0
