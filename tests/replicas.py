"""Replicas compared without smddp: each rank's parameters as written to DIR/rank<r>.bin by the examples' --save-params."""

from __future__ import annotations

from pathlib import Path


def assert_replicas_identical(directory: Path, world: int, min_bytes: int = 1024) -> bytes:
    """Every rank's file holds the same bytes as rank 0's (and there are `world` of them, not empty);
    returns them. A check made by the collectives under test (an all-gather whose rows agree) could
    pass on a broken all-gather: this one reads what each rank itself wrote."""
    got = {r: (directory / f"rank{r}.bin").read_bytes() for r in range(world)}
    assert len(got[0]) >= min_bytes, f"rank 0 wrote {len(got[0])} bytes of parameters"
    differ = [r for r in range(1, world) if got[r] != got[0]]
    assert not differ, f"ranks {differ} hold other parameters than rank 0"
    return got[0]
