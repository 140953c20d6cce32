"""Shard and chunk arithmetic the client plans with; the daemon's layouts are the engine's (smddp/engine/collective.h)."""

from __future__ import annotations

from dataclasses import dataclass


def shard_bounds(count: int, nshards: int) -> list[tuple[int, int]]:
    """Element ranges of the N shards: as equal as possible, the first `count % N` one element longer."""
    if nshards <= 0:
        raise ValueError("nshards must be positive")
    if count < 0:
        raise ValueError("count must be non-negative")
    base, rem = divmod(count, nshards)
    bounds = []
    start = 0
    for j in range(nshards):
        end = start + base + (1 if j < rem else 0)
        bounds.append((start, end))
        start = end
    return bounds


def split_range(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """Cut [start, end) into pieces of `step` (the last shorter); an empty range is one empty piece."""
    if step <= 0:
        raise ValueError("step must be positive")
    if end <= start:
        return [(start, start)]
    return [(a, min(a + step, end)) for a in range(start, end, step)]


@dataclass(frozen=True)
class Chunk:
    """One pipelining unit: shard `shard`, element range [start, end), `index` within the shard."""

    shard: int
    index: int
    start: int
    end: int

    @property
    def count(self) -> int:
        return self.end - self.start
