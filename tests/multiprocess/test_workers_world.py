"""The workers' own MPI world: scripts that never call smddp.init(), use MPI themselves, leave before joining, or join late."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import smddp_launch

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).parent


def _launch(np_: int, nodes: int, args: list[str], timeout: float = 120) -> tuple[Any, float]:
    """smddp_launch (python ARGS on every worker), and how long the job took."""
    t0 = time.monotonic()
    proc = smddp_launch(np_, nodes, args, timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize(
    "args",
    [
        ["-c", "print('hello')"],
        [str(HERE / "check_world.py"), "--help"],
    ],
    ids=["print", "help"],
)
def test_workers_that_never_join_end_the_job_with_0(args: list[str], clean_host: None) -> None:
    """Issue 15: this used to hang, the daemons spinning in the MPI bootstrap until killed."""
    proc, seconds = _launch(4, 2, args, timeout=90)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for r in range(4):
        assert any(line.startswith(f"[rank {r}] ") for line in proc.stdout.splitlines()), proc.stdout
    assert seconds < 45, seconds


def test_a_failing_worker_that_never_joined_gives_its_status(clean_host: None) -> None:
    proc, _ = _launch(2, 1, ["-c", "import sys; sys.exit(5)"])
    assert proc.returncode == 5, proc.stderr[-2000:]


def test_mpi_script_sees_a_world_of_workers(tmp_path: Path, clean_host: None) -> None:
    """A script that uses MPI alone (another backend): the world is the workers, ranks are RANK."""
    proc, _ = _launch(4, 2, [str(HERE / "check_world.py"), "--out", str(tmp_path), "--mode", "mpi_only"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for r in range(4):
        d = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert d["mpi"][:2] == [r, 4] and d["mpi_sum"] == 6


@pytest.mark.parametrize(("world", "nodes"), [(2, 1), (4, 2)], ids=["W2-N1", "W4-N2"])
def test_mpi4py_beside_smddp(world: int, nodes: int, tmp_path: Path, clean_host: None) -> None:
    """mpi4py's COMM_WORLD is the workers' world, consistent with RANK, and works beside smddp."""
    args = [str(HERE / "check_world.py"), "--out", str(tmp_path), "--mode", "mpi"]
    proc, _ = _launch(world, nodes, args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    g = world // nodes
    expect = [sum(i + r for r in range(world)) for i in range(8)]
    for r in range(world):
        d = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert d["mpi"][:2] == [r, world] and d["mpi_sum"] == sum(range(world))
        assert d["smddp"] == [r, world, r % g, g]
        assert d["smddp_sum"] == expect and d["mpi_vec"] == expect
        env = d["env"]
        assert env["OMPI_COMM_WORLD_RANK"] == str(r) and env["OMPI_COMM_WORLD_SIZE"] == str(world)
        assert env["OMPI_COMM_WORLD_LOCAL_RANK"] == str(r % g) and env["OMPI_COMM_WORLD_LOCAL_SIZE"] == str(g)
        assert env["SMDATAPARALLEL_LOCAL_RANK"] == str(r % g)


@pytest.mark.parametrize(("world", "nodes", "skip"), [(3, 1, 1), (4, 2, 3), (4, 2, 0)])
def test_a_rank_that_leaves_before_joining_is_named(
    world: int, nodes: int, skip: int, tmp_path: Path, clean_host: None
) -> None:
    """The others, waiting for it in a collective (on its node or another), fail at once naming it
    as a lost rank. (They catch the error and exit 0, so the job's status is 0 here.)"""
    args = [str(HERE / "check_world.py"), "--out", str(tmp_path), "--mode", "skip", "--skip-rank", str(skip)]
    t0 = time.monotonic()
    proc = smddp_launch(world, nodes, args, timeout=120)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert seconds < 60, seconds
    for r in range(world):
        d = json.loads((tmp_path / f"rank{r}.json").read_text())
        if r == skip:
            assert d == {"skipped": True}
            continue
        err = d["error"]
        assert err is not None and f"rank {skip} (node {skip // (world // nodes)}" in err, err
        assert "exited with status 0 without joining the job" in err, err
        assert d["seconds"] < 30, d


def test_a_rank_that_fails_before_joining_ends_the_job_with_its_status(
    tmp_path: Path, clean_host: None
) -> None:
    """A rank that crashes before smddp.init() while the others wait: the job ends, with its status."""
    args = [str(HERE / "check_world.py"), "--out", str(tmp_path), "--mode", "skip"]
    t0 = time.monotonic()
    proc = smddp_launch(4, 2, [*args, "--skip-rank", "2", "--skip-status", "4"], timeout=120)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60


SLOW_START = (
    "import os, sys, time\n"
    "import numpy as np\n"
    "import smddp\n"
    "if os.environ['RANK'] == '1':\n"
    "    time.sleep(float(sys.argv[1]))  # a slow start-up: imports, a JIT build, data\n"
    "smddp.init()\n"
    "a = np.full(10, float(os.environ['RANK']) + 1, np.float32)\n"
    "smddp.allreduce(a)\n"
    "print('sum', a[0], flush=True)\n"
    "smddp.shutdown()\n"
)


def test_a_rank_slow_to_join_is_waited_for(tmp_path: Path, clean_host: None) -> None:
    """A script's start-up before smddp.init() is no peer's connect time: rank 1 joins 4 s in, past a
    1 s --connect-timeout (which bounds the daemons' links alone), and the job runs. (Before
    --join-timeout, the connect timeout bounded both: 120 s for a script's imports and JIT builds.)"""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_START)
    proc = smddp_launch(2, 2, [str(script), "4"], timeout=120, extra=["--connect-timeout", "1"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("sum 3.0") == 2, proc.stdout


def test_a_rank_that_does_not_join_in_time_fails_the_job_as_its_own(tmp_path: Path, clean_host: None) -> None:
    """Past --join-timeout every rank hears which rank did not join, and the job is the script's
    failure: not a crash, not restarted."""
    script = tmp_path / "stuck.py"
    script.write_text(SLOW_START)
    t0 = time.monotonic()
    extra = ["--join-timeout", "3", "--max-restarts", "1", "--restart-delay", "0"]
    proc = smddp_launch(2, 2, [str(script), "300"], timeout=120, extra=extra)
    seconds = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    host = os.uname().nodename
    said = (
        f"[rank 0] smddp.errors.PeerLostError: node 1 ({host}, rank 1): rank 1 (node 1, {host}) did not "
        "join (call smddp.init()) within 3s of the job's start (--join-timeout)"
    )
    assert said in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "not a crash; not restarted" in proc.stderr, proc.stderr[-2000:]
    assert seconds < 60, seconds
