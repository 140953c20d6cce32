"""Shard and chunk arithmetic: balanced shards, pipelining chunks, and frame location checks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smddp.errors import ProtocolError
from smddp.proto import Chunk, shard_bounds, split_range
from tests import layout_reference as reference
from tests.layout_reference import GatherLayout, ReduceLayout


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 300))
def test_shard_bounds_properties(count, n):
    b = shard_bounds(count, n)
    assert len(b) == n
    assert b[0][0] == 0 and b[-1][1] == count
    for (_, e), (s, _) in itertools.pairwise(b):
        assert e == s  # contiguous
    sizes = [e - s for s, e in b]
    assert all(x >= 0 for x in sizes)
    assert sum(sizes) == count
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # larger shards first
    assert sizes.count(count // n + 1) == count % n


def test_shard_bounds_examples():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert shard_bounds(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError):
        shard_bounds(5, 0)
    with pytest.raises(ValueError):
        shard_bounds(-1, 2)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**5), st.integers(0, 10**5), st.integers(1, 5000))
def test_split_range_properties(start, length, step):
    end = start + length
    pieces = split_range(start, end, step)
    if length == 0:
        assert pieces == [(start, start)]
        return
    assert pieces[0][0] == start and pieces[-1][1] == end
    for (_, e), (s, _) in itertools.pairwise(pieces):
        assert e == s
    assert all(b - a == step for a, b in pieces[:-1])
    assert 0 < pieces[-1][1] - pieces[-1][0] <= step
    assert len(pieces) == -(-length // step)


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 2**40), st.integers(1, 2000), st.integers(0, 2**20), st.integers(1, 2**16))
def test_the_client_plans_as_the_reference(count, n, length, step):
    """smddp.proto.layout (the client's planner) against the tests' own arithmetic."""
    j = count % n
    assert shard_bounds(count, n)[j] == reference.shard_bounds(count, n)[j]
    assert shard_bounds(count, n)[-1] == reference.shard_bounds(count, n)[-1]
    start = count % 1000
    assert split_range(start, start + length % 5000, step) == reference.split_range(
        start, start + length % 5000, step
    )


def test_split_range_examples():
    assert split_range(3, 3, 4) == [(3, 3)]
    assert split_range(5, 2, 4) == [(5, 5)]
    assert split_range(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert split_range(0, 8, 4) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError):
        split_range(0, 4, 0)


def test_reduce_layout_build():
    lay = ReduceLayout.build(count=1000, itemsize=4, nshards=3, chunk_bytes=1024)
    assert lay.chunk_elems == 256
    assert ReduceLayout.build(10, 8, 2, 3).chunk_elems == 1  # never zero
    assert lay.shards() == shard_bounds(1000, 3)
    chunks = lay.chunks(0)
    assert [(c.start, c.end) for c in chunks] == [(0, 256), (256, 334)]
    assert [c.index for c in chunks] == [0, 1]
    assert all(c.shard == 0 for c in chunks)
    assert chunks[1].count == 78
    flat = [c for cs in lay.all_chunks() for c in cs]
    assert sum(c.count for c in flat) == 1000


LAYOUTS = [
    (0, 4, 2, 16),  # empty buffer: every shard is one empty chunk
    (1, 4, 3, 16),  # fewer elements than shards
    (8, 4, 1, 16),  # shard length a multiple of the chunk
    (16, 2, 2, 8),  # both shards exact multiples of the chunk
    (17, 8, 3, 24),
    (100, 4, 4, 40),
    (1000, 1, 3, 64),
    (33, 2, 5, 2),  # chunk of one element
]


def all_frames(lay: ReduceLayout):
    """Every (offset, length) in bytes a frame could plausibly claim, element-aligned or not."""
    total = lay.count * lay.itemsize
    step = max(1, lay.itemsize // 2)
    lengths = sorted(
        {0, 1, lay.itemsize, lay.chunk_elems * lay.itemsize, lay.chunk_elems * lay.itemsize + 1}
        | {(c.end - c.start) * lay.itemsize for cs in lay.all_chunks() for c in cs}
        | {lay.chunk_elems * lay.itemsize - lay.itemsize, 2 * lay.chunk_elems * lay.itemsize}
    )
    for off in range(0, total + 2 * lay.itemsize + 1, step):
        for length in lengths:
            if length >= 0:
                yield off, length


@pytest.mark.parametrize("count,itemsize,nshards,chunk_bytes", LAYOUTS)
def test_reduce_locate_accepts_exactly_the_real_chunks(count, itemsize, nshards, chunk_bytes):
    lay = ReduceLayout.build(count, itemsize, nshards, chunk_bytes)
    real = {}
    for s in range(nshards):
        for c in lay.chunks(s):
            real[(s, c.start * itemsize, c.count * itemsize)] = c
    for key, c in real.items():
        assert lay.locate(*key) == c
    for s in range(nshards):
        for off, length in all_frames(lay):
            if (s, off, length) in real:
                continue
            with pytest.raises(ProtocolError):
                got = lay.locate(s, off, length)
                # show what was wrongly accepted
                raise AssertionError(f"locate({s}, {off}, {length}) accepted {got}; chunks: {lay.chunks(s)}")


def test_reduce_locate_phantom_empty_chunk_at_shard_end():
    """A zero-length frame at the end of a shard whose length is a multiple of the chunk is no chunk.

    shard 0 of 8 float32 in 1 shard with 4-element chunks has chunks [0,4) and [4,8); a PARTIAL
    claiming offset 32, length 0 must be refused, not located as a third chunk of index 2.
    """
    lay = ReduceLayout.build(count=8, itemsize=4, nshards=1, chunk_bytes=16)
    assert len(lay.chunks(0)) == 2
    with pytest.raises(ProtocolError):
        lay.locate(0, 32, 0)


def test_reduce_locate_refusals():
    lay = ReduceLayout.build(count=100, itemsize=4, nshards=4, chunk_bytes=40)  # shards of 25, chunks of 10
    assert lay.locate(1, 25 * 4, 40) == Chunk(1, 0, 25, 35)
    assert lay.locate(1, 45 * 4, 20) == Chunk(1, 2, 45, 50)
    with pytest.raises(ProtocolError, match="out of range"):
        lay.locate(4, 0, 40)
    with pytest.raises(ProtocolError, match="out of range"):
        lay.locate(-1, 0, 40)
    with pytest.raises(ProtocolError, match="aligned"):
        lay.locate(1, 25 * 4 + 2, 40)  # misaligned offset
    with pytest.raises(ProtocolError, match="aligned"):
        lay.locate(1, 25 * 4, 39)  # misaligned length
    with pytest.raises(ProtocolError):
        lay.locate(1, 26 * 4, 40)  # shifted by one element
    with pytest.raises(ProtocolError):
        lay.locate(1, 25 * 4, 44)  # too long
    with pytest.raises(ProtocolError):
        lay.locate(1, 25 * 4, 36)  # too short
    with pytest.raises(ProtocolError):
        lay.locate(1, 45 * 4, 40)  # last chunk claimed at full length, running into shard 2
    with pytest.raises(ProtocolError, match="outside"):
        lay.locate(1, 0, 40)  # shard 0's chunk claimed as shard 1's
    with pytest.raises(ProtocolError, match="outside"):
        lay.locate(1, 60 * 4, 40)
    with pytest.raises(ProtocolError):
        lay.locate(1, -4, 4)


def test_gather_layout_allgather():
    lay = GatherLayout.allgather(nbytes=12, nnodes=3, workers_per_node=2, chunk_bytes=10)
    assert lay.total_bytes == 72
    assert lay.blocks == ((0, 0, 24), (1, 24, 48), (2, 48, 72))
    assert lay.block_of(1) == (24, 48)
    assert lay.block_of(3) is None
    assert lay.chunks(1) == [(24, 34), (34, 44), (44, 48)]
    assert lay.chunks(7) == []
    assert lay.total_chunks() == 9
    assert lay.locate(1, 24, 10) == 0
    assert lay.locate(1, 44, 4) == 2
    assert lay.locate(2, 58, 10) == 1
    for bad in [(1, 25, 10), (1, 24, 9), (1, 24, 11), (1, 44, 10), (0, 24, 10), (1, 48, 0), (1, 14, 10)]:
        with pytest.raises(ProtocolError):
            lay.locate(*bad)
    with pytest.raises(ProtocolError, match="no block"):
        lay.locate(3, 0, 10)


def test_gather_layout_allgather_empty():
    lay = GatherLayout.allgather(nbytes=0, nnodes=2, workers_per_node=4, chunk_bytes=8)
    assert lay.total_bytes == 0
    assert lay.chunks(0) == [(0, 0)] and lay.chunks(1) == [(0, 0)]
    assert lay.total_chunks() == 2
    assert lay.locate(1, 0, 0) == 0
    with pytest.raises(ProtocolError):
        lay.locate(1, 0, 1)


def test_gather_layout_broadcast():
    lay = GatherLayout.broadcast(nbytes=100, nnodes=3, root_node=2, chunk_bytes=32)
    assert lay.total_bytes == 100
    assert lay.block_of(2) == (0, 100)
    # Every other node contributes one empty block, so every node sees every fingerprint.
    assert lay.block_of(0) == (100, 100) and lay.chunks(0) == [(100, 100)]
    assert lay.chunks(2) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert lay.total_chunks() == 4 + 2
    assert [lay.locate(2, a, b - a) for a, b in lay.chunks(2)] == [0, 1, 2, 3]
    assert lay.locate(0, 100, 0) == 0
    with pytest.raises(ProtocolError):
        lay.locate(0, 0, 32)
    with pytest.raises(ProtocolError):
        lay.locate(2, 96, 32)
    with pytest.raises(ProtocolError, match="no block"):
        lay.locate(3, 100, 0)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 500), st.integers(1, 5), st.integers(1, 4), st.integers(1, 300))
def test_gather_layout_allgather_properties(nbytes, nnodes, g, chunk):
    lay = GatherLayout.allgather(nbytes, nnodes, g, chunk)
    assert lay.total_bytes == nbytes * nnodes * g
    covered = []
    for j in range(nnodes):
        a, b = lay.block_of(j)
        assert b - a == nbytes * g
        pieces = lay.chunks(j)
        for i, (x, y) in enumerate(pieces):
            assert lay.locate(j, x, y - x) == i
            covered.extend(range(x, y))
    assert covered == list(range(lay.total_bytes))
