"""smddp.launcher.worker_env: torchrun's variables from an MPMD world rank, and the launch command carrying them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from smddp.launcher.worker_env import torchrun_env, world_rank_from
from tests.conftest import BIN


def test_ranks_follow_the_mpmd_layout() -> None:
    # 2 daemons (world ranks 0, 1), then 6 workers, 3 per node.
    envs = [torchrun_env(w, 2, 3, "10.0.0.1", 29500, "job") for w in range(2, 8)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3", "4", "5"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "0", "1", "2"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "0", "1", "1", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"6"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"3"}
    assert envs[0]["MASTER_ADDR"] == "10.0.0.1" and envs[0]["MASTER_PORT"] == "29500"
    assert envs[0]["TORCHELASTIC_RUN_ID"] == "job"
    with pytest.raises(ValueError):
        torchrun_env(1, 2, 3, "a", 1)  # a daemon's world rank


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
    workers = out.strip().split(" : ")[1].split()
    assert workers[:2] == ["-np", "4"] and workers[-3:] == ["--", "python", "t.py"]
    assert workers[3].endswith("/smddp/launcher/worker_env.py")
    flags = dict(zip(workers[4:12:2], workers[5:12:2], strict=True))
    assert flags["--daemons"] == "2" and flags["--per-node"] == "2" and flags["--master-addr"] == "127.0.0.1"
    assert 0 < int(flags["--master-port"]) < 65536


def test_exec_with_the_variables() -> None:
    code = "import os; print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'])"
    flags = ["--daemons", "1", "--per-node", "2", "--master-addr", "127.0.0.1", "--master-port", "1234"]
    proc = subprocess.run(
        [sys.executable, "-m", "smddp.launcher.worker_env", *flags, "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"OMPI_COMM_WORLD_RANK": "2", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "1", "2"]
