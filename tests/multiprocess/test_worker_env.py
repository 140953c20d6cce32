"""smddp.launcher.worker_env: every variable a worker gets from its rank in the workers' MPI world, and the wrapper that runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from smddp.launcher.worker_env import worker_env, world_rank_from
from tests.conftest import BIN


def test_ranks_follow_the_workers_world() -> None:
    # 2 nodes x 3 workers: the MPI rank of the workers' own world is the rank.
    envs = [worker_env(w, 2, 3, "10.0.0.1", 29500, "job") for w in range(6)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3", "4", "5"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "0", "1", "2"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "0", "1", "1", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"6"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"3"}
    assert envs[0]["MASTER_ADDR"] == "10.0.0.1" and envs[0]["MASTER_PORT"] == "29500"
    assert envs[0]["TORCHELASTIC_RUN_ID"] == "job"
    for e in envs:
        # smddp's, SageMaker's and Open MPI's per-node view all agree with torchrun's.
        assert e["SMDDP_RANK"] == e["RANK"] and e["SMDDP_NODE"] == e["GROUP_RANK"]
        assert e["SMDDP_LOCAL_RANK"] == e["LOCAL_RANK"] == e["SMDATAPARALLEL_LOCAL_RANK"]
        assert e["OMPI_COMM_WORLD_LOCAL_RANK"] == e["LOCAL_RANK"]
        assert e["OMPI_COMM_WORLD_LOCAL_SIZE"] == e["LOCAL_WORLD_SIZE"] == e["SMDDP_LOCAL_SIZE"]
        assert e["SMDDP_NNODES"] == "2" and e["SMDDP_WORLD_SIZE"] == "6"
        assert e["SMDATAPARALLEL_USE_HOMOGENEOUS"] == "1" and "SMDATAPARALLEL_USE_SINGLENODE" not in e
        assert e["SMDATAPARALLEL_SERVER_ADDR"] == "10.0.0.1"
    assert worker_env(0, 1, 2, "a", 1)["SMDATAPARALLEL_USE_SINGLENODE"] == "1"
    with pytest.raises(ValueError):
        worker_env(6, 2, 3, "a", 1)  # more workers than the job has


def test_world_rank_from_open_mpi_or_pmix() -> None:
    assert world_rank_from({"OMPI_COMM_WORLD_RANK": "5"}) == 5
    assert world_rank_from({"PMIX_RANK": "3"}) == 3
    with pytest.raises(ValueError):
        world_rank_from({})


def test_dry_run_wraps_the_worker_command() -> None:
    out = subprocess.run(
        [str(BIN / "smddp-launch"), "-np", "4", "--local-nodes", "2", "--dry-run", "--", "python", "t.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    workers = out.strip().splitlines()[1].split()
    workers = workers[workers.index("-np") :]
    assert workers[:2] == ["-np", "4"] and workers[-3:] == ["--", "python", "t.py"]
    assert workers[3].endswith("/smddp/launcher/worker_env.py")
    flags = dict(zip(workers[4:12:2], workers[5:12:2], strict=True))
    assert flags["--nodes"] == "2" and flags["--per-node"] == "2" and flags["--master-addr"] == "127.0.0.1"
    assert 0 < int(flags["--master-port"]) < 65536


def test_runs_the_command_with_the_variables() -> None:
    code = (
        "import os; print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], "
        "os.environ['SMDATAPARALLEL_LOCAL_RANK'], 'SMDDP_JOINED_FD' in os.environ); raise SystemExit(7)"
    )
    flags = ["--nodes", "1", "--per-node", "3", "--master-addr", "127.0.0.1", "--master-port", "1234"]
    proc = subprocess.run(
        [sys.executable, "-m", "smddp.launcher.worker_env", *flags, "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"OMPI_COMM_WORLD_RANK": "2", "PATH": "/usr/bin:/bin"},
    )
    # No job id: nothing to report to, and no pipe to join through; the worker's own status.
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout.split() == ["2", "2", "3", "2", "False"]
