"""Every collective, dtype, op and size through real smddp-launch jobs, bit-exact against the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import smddp_launch

pytestmark = pytest.mark.multiprocess

SCRIPT = str(Path(__file__).parent / "check_collectives.py")
# (workers, local nodes): W = 1..4 and --local-nodes 1..3, every split that divides evenly.
CONFIGS = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 2)]
# CI runs one rank alone, 3 nodes of 1 and 2 of 2; the other splits are `make test-long`. 4 on one node
# is long here only: CI's checks run that very test under ASan+UBSan (make engine-sanitize-jobs, the
# same assertions on the sanitized engine), so the plain run would be the same job twice.
LONG = {(2, 1), (2, 2), (3, 1), (4, 1)}


def configs(pairs: list[tuple[int, int]], long: set[tuple[int, int]]) -> list:  # type: ignore[type-arg]
    return [
        pytest.param(w, n, id=f"W{w}-N{n}", marks=[pytest.mark.long] if (w, n) in long else [])
        for w, n in pairs
    ]


@pytest.mark.parametrize(("world", "nodes"), configs(CONFIGS, LONG))
def test_every_collective_bit_exact(world: int, nodes: int, tmp_path: Path, clean_host: None) -> None:
    check_every_collective(world, nodes, tmp_path)


def check_every_collective(world: int, nodes: int, tmp_path: Path, extra: list[str] | None = None) -> None:
    """The whole matrix in one job: every rank's result is the reference's, and every rank's the same."""
    proc = smddp_launch(
        world,
        nodes,
        [SCRIPT, "--out", str(tmp_path), "--nnodes", str(nodes), "--big"],
        timeout=600,
        extra=extra,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    per_rank = []
    for r in range(world):
        data = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert data["world"] == world
        per_rank.append(data["records"])
    n_records = len(per_rank[0])
    assert n_records > 250 and all(len(recs) == n_records for recs in per_rank)
    bad = [(r, rec) for r, recs in enumerate(per_rank) for rec in recs if not rec["ok"]]
    assert not bad, f"{len(bad)} results differ from the reference, first: {bad[:3]}"
    # Every rank got the very same bits (reduce_scatter parts differ by design).
    for i in range(n_records):
        recs = [per_rank[r][i] for r in range(world)]
        assert len({rec["id"] for rec in recs}) == 1
        if recs[0]["case"]["kind"] != "reduce_scatter":
            assert len({rec["digest"] for rec in recs}) == 1, f"ranks disagree on {recs[0]['case']}"
    assert sum(1 for rec in per_rank[0] if rec.get("inflight")) == 32
    assert any(rec.get("blocking") for rec in per_rank[0])  # the large all-reduces, blocking
    # On one node every all-reduce of 1 MiB or more streams in, and results come out before their
    # DONE; across nodes none does (they go as pipelined pieces).
    for r in range(world):
        streamed_in, streamed_out = json.loads((tmp_path / f"rank{r}.json").read_text())["streamed"]
        if nodes == 1:
            assert streamed_in > 0 and streamed_out > 0, (r, streamed_in, streamed_out)
        else:
            assert streamed_in == 0 and streamed_out == 0, (r, streamed_in, streamed_out)


MULTI = [(w, n) for w, n in CONFIGS if n > 1]


PATHS = {
    "never-replicated": ["--replicate-kb", "0"],
    "replicated-up-to-64MiB": ["--replicate-kb", "65536"],
    # Every all-reduce over 16 KiB goes as pipelined pieces, some replicated and some not.
    "pipelined-16KiB-pieces": ["--pipeline-kb", "16"],
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("world", "nodes"), configs(MULTI, {(2, 2)}))
def test_both_reduce_paths_bit_exact(
    world: int, nodes: int, path: str, tmp_path: Path, clean_host: None
) -> None:
    """The sharded path (two network steps) and the replicated one (small all-reduces: one step) give
    the reference's bits for every size: by default only the small sizes go replicated; here every
    all-reduce and barrier up to 1 Mi + 3 elements goes one way or the other, or in pieces."""
    check_without_big(world, nodes, tmp_path, PATHS[path])


def check_without_big(world: int, nodes: int, tmp_path: Path, extra: list[str]) -> None:
    """The matrix up to 1 Mi + 3 elements (no 64 MiB cases) in one job with `extra` flags: every
    rank's result the reference's, and every rank's the same."""
    proc = smddp_launch(
        world, nodes, [SCRIPT, "--out", str(tmp_path), "--nnodes", str(nodes)], timeout=600, extra=extra
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text())["records"] for r in range(world)]
    bad = [(r, rec) for r, recs in enumerate(per_rank) for rec in recs if not rec["ok"]]
    assert per_rank[0] and not bad, f"{len(bad)} results differ from the reference, first: {bad[:3]}"
    for i in range(len(per_rank[0])):
        recs = [per_rank[r][i] for r in range(world)]
        if recs[0]["case"]["kind"] != "reduce_scatter":
            assert len({rec["digest"] for rec in recs}) == 1, f"ranks disagree on {recs[0]['case']}"
