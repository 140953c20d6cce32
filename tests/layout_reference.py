"""The layouts the daemon followed before the engine (smddp/engine/collective.h) took them over, kept
as the tests' independent plan: N balanced shards cut into chunks, and gather blocks, computed here
with arithmetic of their own (not smddp.proto.layout's, which the client plans with and which the
tests compare with this). `locate` is the engine's check (the one every wire offset passes), so that
tests of every offset compare it with these chunks."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from smddp_rigs import _engine_testing

from smddp.errors import ProtocolError
from smddp.proto.layout import Chunk  # a plain record: shard, index, start, end


def shard_bounds(count: int, nshards: int) -> list[tuple[int, int]]:
    """Shard j starts after j shards of count // N elements and one more for each of the first
    count % N shards before it."""
    base, longer = count // nshards, count % nshards
    starts = [j * base + min(j, longer) for j in range(nshards + 1)]
    return list(itertools.pairwise(starts))


def split_range(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """[start, end) in pieces of `step` elements, the last one shorter; an empty range is one empty piece."""
    pieces = [(start, start)] if end <= start else []
    a = start
    while a < end:
        pieces.append((a, min(end, a + step)))
        a += step
    return pieces


@dataclass(frozen=True)
class ReduceLayout:
    """Where every chunk of a reduced buffer lies: N balanced shards, each cut into chunks."""

    count: int
    itemsize: int
    nshards: int
    chunk_elems: int

    @classmethod
    def build(cls, count: int, itemsize: int, nshards: int, chunk_bytes: int) -> ReduceLayout:
        return cls(count, itemsize, nshards, max(1, chunk_bytes // itemsize))

    def shards(self) -> list[tuple[int, int]]:
        return list(_shards(self.count, self.nshards))

    def chunks(self, shard: int) -> list[Chunk]:
        return list(_chunks(self.count, self.nshards, self.chunk_elems, shard))

    def all_chunks(self) -> list[list[Chunk]]:
        return [self.chunks(j) for j in range(self.nshards)]

    def locate(self, shard: int, byte_offset: int, byte_length: int) -> Chunk:
        """The chunk a data frame claims to carry; raises ProtocolError unless it is exactly one chunk.

        The check is the engine's (smddp/engine/layout.cc), the one every offset from the wire passes.
        """
        index, a, b = _engine_testing.locate_reduce(
            self.count, self.itemsize, self.nshards, self.chunk_elems, shard, byte_offset, byte_length
        )
        return Chunk(shard, index, a, b)


# A training job repeats the same few buffer sizes: every daemon and frame asks for their layout again.
@functools.lru_cache(maxsize=512)
def _shards(count: int, nshards: int) -> tuple[tuple[int, int], ...]:
    return tuple(shard_bounds(count, nshards))


@functools.lru_cache(maxsize=8192)  # all_chunks() asks for every shard: room for 1024 nodes' worth
def _chunks(count: int, nshards: int, chunk_elems: int, shard: int) -> tuple[Chunk, ...]:
    start, end = _shards(count, nshards)[shard]
    return tuple(Chunk(shard, i, a, b) for i, (a, b) in enumerate(split_range(start, end, chunk_elems)))


@dataclass(frozen=True)
class GatherLayout:
    """Where every block of a gathered result lies: node j's block is written by node j alone.

    Broadcast is the gather in which only the root's node contributes a block.
    """

    total_bytes: int
    blocks: tuple[tuple[int, int, int], ...]  # (node, start byte, end byte)
    chunk_bytes: int

    @classmethod
    def allgather(cls, nbytes: int, nnodes: int, workers_per_node: int, chunk_bytes: int) -> GatherLayout:
        per_node = nbytes * workers_per_node
        blocks = tuple((j, j * per_node, (j + 1) * per_node) for j in range(nnodes))
        return cls(per_node * nnodes, blocks, chunk_bytes)

    @classmethod
    def broadcast(cls, nbytes: int, nnodes: int, root_node: int, chunk_bytes: int) -> GatherLayout:
        """The root's node sends the data; every other node sends one empty block, so each node sees
        every other node's fingerprint (a disagreement about the root is caught, never waited on)."""
        blocks = tuple((j, 0, nbytes) if j == root_node else (j, nbytes, nbytes) for j in range(nnodes))
        return cls(nbytes, blocks, chunk_bytes)

    def block_of(self, node: int) -> tuple[int, int] | None:
        for j, a, b in self.blocks:
            if j == node:
                return a, b
        return None

    def chunks(self, node: int) -> list[tuple[int, int]]:
        blk = self.block_of(node)
        if blk is None:
            return []
        return split_range(blk[0], blk[1], self.chunk_bytes)

    def total_chunks(self) -> int:
        return sum(len(self.chunks(j)) for j, _, _ in self.blocks)

    def locate(self, node: int, byte_offset: int, byte_length: int) -> int:
        """Index of the chunk a BLOCK frame from `node` claims to carry; ProtocolError if it is not one."""
        blk = self.block_of(node)
        if blk is None:
            raise ProtocolError(f"node {node} contributes no block to this collective")
        return int(_engine_testing.locate_block(blk[0], blk[1], self.chunk_bytes, byte_offset, byte_length))
