"""smddp-launch --max-restarts and --restart-on: which failures restart a job, and what a restart sees."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from smddp.launcher.mpirun import attempt_job_id
from tests.conftest import LAUNCHED, smddp_launch

SCRIPT = (
    "import os, smddp\n"
    "smddp.init()\n"
    "n = int(os.environ['SMDDP_RESTART_COUNT'])\n"
    "assert os.environ['TORCHELASTIC_RESTART_COUNT'] == str(n)\n"
    "print('attempt', n, 'job', os.environ['SMDDP_JOB_ID'], flush=True)\n"
    "smddp.barrier(timeout=60)\n"
    "smddp.shutdown()\n"
    "raise SystemExit(4 if n < 1 else 0)\n"
)


def test_a_scripts_own_failure_is_not_restarted_unless_asked(tmp_path: Path, clean_host: None) -> None:
    """A script's own non-zero exit is not a crash: no restart, unless --restart-on any; a restart is
    a fresh job (another id) that sees its attempt number."""
    script = tmp_path / "fail.py"
    proc = _failed_without_restart(script, SCRIPT)
    assert proc.stdout.count("attempt 0 job") == 2 and "attempt 1" not in proc.stdout, proc.stdout

    extra = ["--max-restarts", "3", "--restart-delay", "0", "--restart-on", "any"]
    proc = smddp_launch(2, 2, [str(script)], extra=extra)
    first = LAUNCHED[-1]
    LAUNCHED.append(attempt_job_id(first, 1))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not a crash; restart 1 of 3 in 0s" in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.count(f"attempt 0 job {first}") == 2, proc.stdout
    assert proc.stdout.count(f"attempt 1 job {attempt_job_id(first, 1)}") == 2, proc.stdout


TORN = (
    "import os, time, smddp\n"
    "smddp.init()\n"
    "smddp.barrier(timeout=60)\n"
    "if smddp.client().rank == 1:\n"
    "    time.sleep(30)  # still in the job when rank 0's exit makes mpirun tear it down\n"
    "smddp.shutdown()\n"
    "raise SystemExit(4)\n"
)


def test_a_rank_stopped_because_another_failed_is_no_crash(tmp_path: Path, clean_host: None) -> None:
    """Rank 0's own exit 4 makes mpirun tear the job down while rank 1 is still in it: rank 1's end
    (SIGTERM, no status of its own) is a consequence, so the job is not restarted for it. (Before its
    wrapper said so, its daemon took a rank gone without a status for a crash, and restarted it.)"""
    proc = _failed_without_restart(tmp_path / "torn.py", TORN)
    assert "stopped with its job: mpirun or the scheduler tore the job down" in proc.stderr, proc.stderr[
        -2000:
    ]


def _failed_without_restart(script: Path, text: str) -> subprocess.CompletedProcess[str]:
    """`text` run as `script` (2 ranks on 2 nodes, --max-restarts 3): it ends with status 4, which
    is said to be no crash, and is not restarted."""
    script.write_text(text)
    proc = smddp_launch(2, 2, [str(script)], extra=["--max-restarts", "3", "--restart-delay", "0"])
    LAUNCHED.append(attempt_job_id(LAUNCHED[-1], 1))
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "not a crash; not restarted (--restart-on any would)" in proc.stderr, proc.stderr[-2000:]
    return proc


def test_restart_flags_are_checked() -> None:
    import sys

    from tests.conftest import BIN

    for bad in (
        ["--max-restarts", "-1"],
        ["--restart-on", "sometimes"],
        ["--restart-delay", "-2"],
        ["--host-wait", "-1"],
    ):
        proc = subprocess.run(
            [str(BIN / "smddp-launch"), "-np", "1", *bad, "--", sys.executable, "-c", "pass"],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2 and "smddp-launch:" in proc.stderr, (bad, proc.stderr)


FREEZE = (
    "import os, signal, sys, smddp\n"
    "smddp.init()\n"
    "n = int(os.environ['SMDDP_RESTART_COUNT'])\n"
    "c = smddp.client()\n"
    "print('attempt', n, 'rank', c.rank, 'job', os.environ['SMDDP_JOB_ID'], flush=True)\n"
    "smddp.barrier(timeout=60)\n"
    "if n == 0:\n"
    "    if c.rank == int(sys.argv[1]):\n"
    "        os.kill(c.job.daemons[c.node].pid, getattr(signal, sys.argv[2]))  # this rank's own daemon\n"
    "    while True:\n"
    "        smddp.barrier(timeout=60)  # until the job fails: a silent daemon is named within 3 s\n"
    "smddp.shutdown()\n"
    "print('attempt', n, 'rank', c.rank, 'finished', flush=True)\n"
)


@pytest.mark.parametrize(
    ("world", "nodes", "freezer", "sig"),
    [(2, 1, 1, "SIGSTOP"), (4, 2, 2, "SIGSTOP"), (4, 2, 2, "SIGKILL")],
    ids=["one-daemon-frozen", "2-nodes-frozen", "2-nodes-killed"],
)
def test_a_frozen_or_killed_daemon_restarts_like_a_crash(
    world: int, nodes: int, freezer: int, sig: str, tmp_path: Path, clean_host: None
) -> None:
    """A daemon SIGSTOPped (or SIGKILLed) mid-job is an infrastructure failure, though every rank ends
    with status 1: with one daemon its workers' wrappers say so (it cannot); with two, the other
    daemon does. The job restarts and finishes."""
    script = tmp_path / "freeze.py"
    script.write_text(FREEZE)
    extra = ["--max-restarts", "1", "--restart-delay", "0", "--heartbeat-timeout", "3"]
    proc = smddp_launch(world, nodes, [str(script), str(freezer), sig], extra=extra, timeout=240)
    LAUNCHED.append(attempt_job_id(LAUNCHED[-1], 1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("smddp-launch: attempt 0")]
    assert len(said) == 1 and "(a crash)" in said[0] and "restart 1 of 1 in 0s" in said[0], proc.stderr[
        -3000:
    ]
    if sig == "SIGSTOP":
        assert "an infrastructure failure (a crash)" in said[0] and "silent" in said[0], said
    if nodes == 1:
        assert "lost the node daemon" in said[0], said
    assert proc.stdout.count("finished") == world, proc.stdout[-3000:]


SCRIPT_FAILS = (
    "import os, sys, numpy as np, smddp\n"
    "smddp.init()\n"
    "n = int(os.environ['SMDDP_RESTART_COUNT'])\n"
    "print('attempt', n, flush=True)\n"
    "smddp.barrier(timeout=60)\n"
    "if sys.argv[1] == 'exception' and smddp.rank() == 1:\n"
    "    raise RuntimeError('the script fails')\n"
    "smddp.allreduce(np.ones(10 + smddp.rank() if sys.argv[1] == 'mismatch' else 10), timeout=60)\n"
    "smddp.shutdown()\n"
)


@pytest.mark.parametrize("how", ["exception", "mismatch"])
def test_a_raised_exception_or_a_mismatch_is_not_restarted(
    how: str, tmp_path: Path, clean_host: None
) -> None:
    """The script's own failures (an exception in one rank; ranks calling different collectives) end
    the job without a restart, --max-restarts notwithstanding."""
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT_FAILS)
    proc = smddp_launch(2, 1, [str(script), how], extra=["--max-restarts", "1", "--restart-delay", "0"])
    LAUNCHED.append(attempt_job_id(LAUNCHED[-1], 1))
    assert proc.returncode != 0, proc.stdout[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("smddp-launch: attempt 0")]
    assert len(said) == 1 and "not a crash; not restarted (--restart-on any would)" in said[0], proc.stderr[
        -3000:
    ]
    assert "attempt 1" not in proc.stdout, proc.stdout[-2000:]
    if how == "mismatch":
        assert "CollectiveMismatchError" in proc.stdout + proc.stderr, proc.stderr[-3000:]


LATE = (
    "import os, signal, sys, time, smddp\n"
    "from smddp.errors import CollectiveStallError\n"
    "smddp.init()\n"
    "n = int(os.environ['SMDDP_RESTART_COUNT'])\n"
    "rank = smddp.rank()\n"
    "smddp.barrier(timeout=60)\n"
    "if n == 0 and rank == 1:\n"
    "    if sys.argv[1] == 'stop':\n"
    "        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: the infrastructure's\n"
    "    else:\n"
    "        time.sleep(600)  # stuck in its own code: the script's\n"
    "t0 = time.monotonic()\n"
    "try:\n"
    "    smddp.barrier(timeout=120)\n"
    "except CollectiveStallError as e:\n"
    "    print('rank', rank, 'waited', round(time.monotonic() - t0, 2), flush=True)\n"
    "    print('rank', rank, 'stalled:', e, 'infra' if e.infra else 'script', flush=True)\n"
    "    raise\n"
    "smddp.shutdown()\n"
    "print('attempt', n, 'rank', rank, 'finished', flush=True)\n"
)


@pytest.mark.parametrize("how", ["stuck", "stop"])
def test_a_rank_that_never_submits_fails_the_job_at_the_stall_limit(
    how: str, tmp_path: Path, clean_host: None
) -> None:
    """--stall-timeout: a collective that waits that long for a rank fails on every rank, naming it.
    A rank stuck in its own code is the script's failure (not restarted); a frozen one (SIGSTOP) is
    the infrastructure's: the job restarts and finishes."""
    script = tmp_path / "late.py"
    script.write_text(LATE)
    extra = [
        "--max-restarts",
        "1",
        "--restart-delay",
        "0",
        "--stall-timeout",
        "3",
        "--heartbeat-timeout",
        "3",
    ]
    proc = smddp_launch(2, 1, [str(script), how], extra=extra, timeout=240)
    LAUNCHED.append(attempt_job_id(LAUNCHED[-1], 1))
    stalled = [line for line in proc.stdout.splitlines() if "stalled:" in line]
    assert stalled and "rank 0 stalled:" in stalled[0], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "past the stall limit (--stall-timeout 3)" in stalled[0] and "rank 1 (node 0" in stalled[0], (
        stalled
    )
    # The detection bound of a rank that never submits (a frozen worker: workers send no heartbeats):
    # the stall limit, then the inspector's next look (once a second), then the ERROR's way back.
    waited = float(next(ln for ln in proc.stdout.splitlines() if "rank 0 waited" in ln).split()[-1])
    print(f"stall detected after {waited} s (--stall-timeout 3, {how})")
    assert 3.0 <= waited < 3.0 + 2.0, waited
    said = [line for line in proc.stderr.splitlines() if line.startswith("smddp-launch: attempt 0")]
    assert len(said) == 1, proc.stderr[-3000:]
    if how == "stuck":
        assert "is running" in stalled[0] and stalled[0].endswith("script"), stalled
        assert proc.returncode == 1 and "not a crash; not restarted" in said[0], said
    else:
        assert "is stopped" in stalled[0] and stalled[0].endswith("infra"), stalled
        assert "an infrastructure failure (a crash)" in said[0] and "restart 1 of 1" in said[0], said
        assert proc.returncode == 0 and proc.stdout.count("finished") == 2, proc.stderr[-3000:]
