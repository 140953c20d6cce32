"""Jobs on the engine data plane (smddp/engine/local_plane.h; the default, named here so that these
tests keep meaning it), on one node and on several: the whole collective matrix bit-exact, mismatches
and early exits named on every rank, a killed worker named within the same bound as on the Python
data plane. And the Python data plane (--data-plane python) while it exists: the same matrix, on one
node and on two."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import smddp_launch
from tests.faults.test_faults import EOF_BOUND_S, check, finish, reports, start, wait_running
from tests.multiprocess.test_collectives import check_every_collective

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).parent
ENGINE = ["--data-plane", "engine"]


# One node (the rings and the plane's threads) and several (the fabric between the daemons too).
LAYOUTS = [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2), (3, 3)]


@pytest.mark.parametrize(("world", "nodes"), LAYOUTS, ids=[f"W{w}-N{n}" for w, n in LAYOUTS])
def test_every_collective_bit_exact_on_the_engine(
    world: int, nodes: int, tmp_path: Path, clean_host: None
) -> None:
    check_every_collective(world, nodes, tmp_path, extra=ENGINE)


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_collective_bit_exact_on_the_python_data_plane(
    nodes: int, tmp_path: Path, clean_host: None
) -> None:
    check_every_collective(4 if nodes == 2 else 3, nodes, tmp_path, extra=["--data-plane", "python"])


def test_mismatch_and_early_exit_on_the_engine(tmp_path: Path, clean_host: None) -> None:
    proc = smddp_launch(
        2, 1, [str(HERE / "check_errors.py"), "--out", str(tmp_path)], timeout=180, extra=ENGINE
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(2):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert all(msg != "NOT REFUSED" for msg in out["refusals"].values())
        assert out["after_refusals"] == [3.0] * 8
        assert (
            "mismatch" in out["mismatch"] and "count=10" in out["mismatch"] and "count=12" in out["mismatch"]
        )
        assert out["later_call"].startswith("CollectiveMismatchError")
    early = tmp_path / "early"
    early.mkdir()
    args = [str(HERE / "check_errors.py"), "--out", str(early), "--mode", "early"]
    proc = smddp_launch(3, 1, args, timeout=180, extra=ENGINE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(2):
        out = json.loads((early / f"rank{r}.json").read_text())
        assert "shut down while collective" in out["mismatch"] and "rank 2" in out["mismatch"], out
        assert out["seconds"] < 15, out["seconds"]


def test_worker_killed_on_the_engine(tmp_path: Path, clean_host: None) -> None:
    world, victim = 4, 2
    proc = start(tmp_path, world, 1, extra=ENGINE)
    pids = wait_running(proc, tmp_path, world)
    t_fault = time.time()
    os.kill(pids[victim]["pid"], signal.SIGKILL)
    output = finish(proc)
    assert proc.returncode != 0
    check(
        "worker SIGKILL (engine)",
        reports(tmp_path, [0, 1, 3]),
        t_fault,
        EOF_BOUND_S,
        f"rank {victim}",
        "died",
    )
    assert "died" in output
