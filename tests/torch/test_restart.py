"""smddp-launch --max-restarts: a rank killed in the middle of training brings the job back as a fresh
job, which resumes from the last checkpoint and ends with the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from smddp.launcher.mpirun import attempt_job_id
from tests.conftest import BIN, LAUNCHED, REPO, fault_at_checkpoint, job_env, need_module, smddp_launch

torch = need_module("torch", "pip install -e '.[torch]'")

pytestmark = pytest.mark.torch

EXAMPLE = str(REPO / "examples" / "torch" / "train_resume.py")
STEPS = ["--steps", "3000", "--ckpt-every", "100"]


def _rank_process(job: str, rank: int) -> int | None:
    """The pid of rank `rank`'s worker process (not its wrapper) of job `job`, if running."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if (
            f"SMDDP_JOB_ID={job}".encode() in env
            and f"RANK={rank}".encode() in env
            and b"train_resume.py" in cmd
            and b"worker_env" not in cmd
        ):
            return int(pid)
    return None


def test_a_killed_rank_restarts_the_job_which_resumes_exactly(tmp_path: Path, clean_host: None) -> None:
    ref = tmp_path / "ref"
    proc = smddp_launch(2, 2, [EXAMPLE, *STEPS, "--ckpt-dir", str(ref), "--save", str(ref / "final.pt")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    run = tmp_path / "run"
    env = job_env()
    job = env["SMDDP_JOB_ID"]
    LAUNCHED.append(attempt_job_id(job, 1))  # the restart's leftovers are checked too
    cmd = [str(BIN / "smddp-launch"), "-np", "2", "--local-nodes", "2", "--max-restarts", "2"]
    cmd += ["--restart-delay", "0.2", "--", sys.executable, EXAMPLE, *STEPS, "--ckpt-dir", str(run)]
    cmd += ["--save", str(run / "final.pt")]

    def kill_rank_1() -> None:  # as the OOM killer or a crash would
        pid = _rank_process(job, 1)
        assert pid is not None, "rank 1 is not running"
        os.kill(pid, signal.SIGKILL)

    status, out, err = fault_at_checkpoint(cmd, env, run / "ckpt-000100.pt", kill_rank_1, timeout=120)
    assert status == 0, out[-2000:] + err[-3000:]
    assert f"attempt 0 of job {job} failed with status 137" in err, err[-3000:]
    assert "a rank was killed by signal 9 (a crash); restart 1 of 2 in 0.2s" in err, err[-3000:]
    resumed = [line for line in out.splitlines() if "attempt 1: 2 workers, starting at step" in line]
    assert resumed and int(resumed[0].split("step ")[1].split()[0]) >= 100, out[-2000:]
    assert "attempt 1: trained to step 3000" in out
    want = torch.load(ref / "final.pt")
    got = torch.load(run / "final.pt")
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs from the uninterrupted run's"
