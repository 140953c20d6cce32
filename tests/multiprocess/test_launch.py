"""smddp-launch end to end: argument errors, mismatches, a failing rank, and the mpirun it builds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, job_env, skip_or_fail, smddp_launch

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).parent


@pytest.mark.parametrize(("world", "nodes"), [(2, 1), (4, 2)])
def test_bad_arguments_refused_and_mismatch_fails_every_rank(world, nodes, tmp_path, clean_host):
    proc = smddp_launch(world, nodes, [str(HERE / "check_errors.py"), "--out", str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(world):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "init" in out["before_init"]
        for name, msg in out["refusals"].items():
            assert msg != "NOT REFUSED", name
        assert "C-contiguous" in out["refusals"]["non_contiguous"]
        assert "int16" in out["refusals"]["int16"]
        assert "read-only" in out["refusals"]["read_only"]
        assert "out of range" in out["refusals"]["root_out_of_range"]
        assert out["after_refusals"] == [world * (world + 1) / 2] * 8
        # Every rank names both sides of the mismatch.
        assert (
            "mismatch" in out["mismatch"] and "count=10" in out["mismatch"] and "count=12" in out["mismatch"]
        )
        assert out["later_call"].startswith("CollectiveMismatchError")
        assert "shut down" in out["after_shutdown"] or "init" in out["after_shutdown"]


@pytest.mark.parametrize(("world", "nodes"), [(2, 1), (3, 3), (4, 2)])
def test_a_rank_that_shuts_down_early_fails_the_others_at_once(world, nodes, tmp_path, clean_host):
    """One rank skips a collective and shuts down: every other rank gets an error naming it, in
    seconds (the node daemon of that rank, or its peers, see that it can never take part)."""
    args = [str(HERE / "check_errors.py"), "--out", str(tmp_path), "--mode", "early"]
    proc = smddp_launch(world, nodes, args, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads((tmp_path / f"rank{world - 1}.json").read_text())
    assert last["mismatch"] == "LEFT EARLY"
    for r in range(world - 1):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        msg = out["mismatch"]
        assert "shut down while collective" in msg and "same collectives" in msg, msg
        assert f"rank {world - 1}" in msg or f"node {nodes - 1}" in msg, msg
        assert out["seconds"] < 15, out["seconds"]
        assert out["later_call"].startswith("CollectiveMismatchError"), out["later_call"]


@pytest.mark.parametrize(("world", "nodes"), [(3, 1), (3, 3), (4, 2)])
def test_failing_rank_sets_exit_status_and_tears_job_down(world, nodes, clean_host):
    t0 = time.monotonic()
    proc = smddp_launch(world, nodes, [str(HERE / "check_exit.py")], timeout=120)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert took < 30, took
    # Surviving ranks that got to report named the rank that died (mpirun may stop some first).
    saw = [line for line in proc.stdout.splitlines() if " saw: " in line]
    assert saw, out[-3000:]
    assert all("saw: rank 1 " in line for line in saw), saw
    # The cause's status reached every survivor, so whichever rank's exit mpirun saw first, it was 3.
    assert all("(exit status 3)" in line and "[exit_status=3]" in line for line in saw), saw


def test_exit_status_is_the_cause_even_when_a_consequence_exits_first(clean_host):
    """Rank 1 exits 3; its wrapper ends 3 s later (a grandchild holds its output), so mpirun sees a
    survivor's exit first: that survivor's wrapper ends with the cause's status, 3, not its own 1."""
    t0 = time.monotonic()
    proc = smddp_launch(4, 2, [str(HERE / "check_exit.py"), "--slow-cause"], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert time.monotonic() - t0 < 30
    saw = [line for line in proc.stdout.splitlines() if " saw: " in line]
    assert saw and all("[exit_status=3]" in line for line in saw), out[-3000:]


@pytest.mark.parametrize(
    "args",
    [["-np", "3", "--local-nodes", "2", "--", "x"], ["-np", "0", "--", "x"], ["-np", "2"]],
)
def test_bad_launch_arguments(args):
    proc = subprocess.run([str(BIN / "smddp-launch"), *args], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "smddp-launch:" in proc.stderr


@pytest.mark.parametrize(("world", "nodes"), [(2, 2), (3, 3), (4, 2)])
def test_broadcast_root_mismatch_fails_instead_of_hanging(world, nodes, tmp_path, clean_host):
    args = [str(HERE / "check_errors.py"), "--out", str(tmp_path), "--mode", "root"]
    proc = smddp_launch(world, nodes, args, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(world):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        msg = out["mismatch"]
        assert "mismatch" in msg and f"root={world - 1}" in msg and "root=0" in msg, msg


@pytest.mark.parametrize(("world", "nodes"), [(2, 2), (4, 2)])
def test_buffers_cut_into_equal_pieces_still_mismatch(world, nodes, tmp_path, clean_host):
    """A 16 KiB and an 8 KiB all-reduce, pipelined in 4 KiB pieces, have pieces of equal size: every
    rank must still get a mismatch naming both, not a result made of unrelated pieces."""
    args = [str(HERE / "check_errors.py"), "--out", str(tmp_path), "--mode", "pieces"]
    proc = smddp_launch(world, nodes, args, timeout=180, extra=["--pipeline-kb", "4"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(world):
        msg = json.loads((tmp_path / f"rank{r}.json").read_text())["mismatch"]
        assert "mismatch" in msg and "one of 4 pieces" in msg and "one of 2 pieces" in msg, msg


def test_dry_run_prints_mpmd_command():
    out = subprocess.run(
        [
            str(BIN / "smddp-launch"),
            "-np",
            "4",
            "--local-nodes",
            "2",
            "--fusion-mb",
            "32",
            "--dry-run",
            "--mpi-args",
            "--mca btl tcp,self",
            "--",
            "python",
            "train.py",
            "--lr",
            "0.1",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out.count("\n") == 1, "two mpiruns: the daemons' world and the workers'"
    left, right = out.splitlines()
    assert "mpirun" in left.split()[0] and "mpirun" in right.split()[0]
    assert " -np 2 " in left and "smddp-daemon --workers-per-node 2 " in left and "python" not in left
    assert " -np 4 " in right and right.endswith(" python train.py --lr 0.1") and "smddp-daemon" not in right
    assert "SMDDP_FUSION_MB=32" in out and "--mca btl tcp,self" in out
    assert "--mca btl self,tcp" not in out, "the user's btl choice replaces smddp's default"
    assert ("--allow-run-as-root" in out) == (os.geteuid() == 0)


def test_bootstrap_uses_no_mpi_shared_memory(tmp_path, clean_host):
    """MPI's shared-memory transport is off, so a job killed mid-bootstrap cannot leave /dev/shm files."""
    assert "--mca btl self,tcp" in _dry_run(["-np", "2", "--", "python", "x.py"])
    before = set(os.listdir("/dev/shm"))
    seen: set[str] = set()
    proc = subprocess.Popen(
        [
            str(BIN / "smddp-launch"),
            "-np",
            "4",
            "--local-nodes",
            "2",
            "--",
            sys.executable,
            "-c",
            "import smddp; smddp.init(); smddp.barrier(); smddp.shutdown()",
        ],
        env=job_env(),
    )
    while proc.poll() is None:
        seen |= set(os.listdir("/dev/shm")) - before
        time.sleep(0.005)
    assert proc.returncode == 0
    assert not [n for n in seen if n.startswith("sm_segment")], seen


def test_python_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "smddp.launcher.cli", "version"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.startswith("smddp ")


def _dry_run(args: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [str(BIN / "smddp-launch"), "--dry-run", *args],
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_dry_run_inside_a_slurm_allocation():
    out = _dry_run(
        ["--iface", "eth1", "--", "python", "train.py"],
        {"SLURM_JOB_NODELIST": "trn[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)"},
    )
    daemons, workers = out.splitlines()
    assert "-np 2 --host trn01:1,trn02:1 " in daemons
    assert "--iface eth1" in daemons and "smddp-daemon" in daemons
    assert "-np 8 --host trn01:4,trn02:4 " in workers and workers.endswith(" python train.py")
    assert "--prtemca oob_tcp_if_include eth1" in out and "--mca btl_tcp_if_include eth1" in out


def test_dry_run_with_hostfile_and_agent(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two boxes\nboxa slots=2\nboxb:2\n")
    out = _dry_run(["--hostfile", str(hostfile), "--launch-agent", "/opt/agent", "--", "train"])
    assert "--prtemca plm_ssh_agent /opt/agent" in out
    assert "-np 4 --host boxa:2,boxb:2 " in out.splitlines()[1] and out.endswith(" train")
    # -H wins over a Slurm allocation, and -np picks G when the slots allow it.
    out = _dry_run(["-np", "2", "-H", "x:4,y:4", "--", "t"], {"SLURM_JOB_NODELIST": "z[1-3]"})
    assert "-np 2 --host x:1,y:1 " in out.splitlines()[1] and out.endswith(" t")


@pytest.mark.parametrize(
    "args",
    [
        ["-H", "a:2,b:3", "--", "x"],  # unequal slots
        ["-np", "5", "-H", "a:4,b:4", "--", "x"],  # does not divide
        ["-np", "10", "-H", "a:4,b:4", "--", "x"],  # more than the slots
        ["-H", "a,b", "--local-nodes", "2", "--", "x"],
        ["-H", "a,b", "--iface", "10.0.0.1", "--", "x"],
        ["-H", "a", "--hostfile", "f", "--", "x"],
    ],
)
def test_bad_host_arguments(args):
    proc = subprocess.run([str(BIN / "smddp-launch"), "--dry-run", *args], capture_output=True, text=True)
    assert proc.returncode == 2 and "smddp-launch:" in proc.stderr, proc.stderr


def test_wait_timeout_leaves_the_job_usable(tmp_path, clean_host):
    proc = smddp_launch(3, 1, [str(HERE / "check_timeout.py"), "--out", str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(3):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        if r < 2:  # the early ranks' short wait ran out, and the late result still came
            assert out["first_wait"].startswith("timeout"), out
            assert out["done_after_timeout"] is False
        assert out["second_wait_ok"] and out["later_ok"], out


def test_worker_output_is_tagged_with_the_rank(clean_host):
    script = (
        "import sys, smddp; smddp.init(); r = smddp.rank(); "
        "print(f'out from {r}'); print(f'err from {r}', file=sys.stderr); smddp.shutdown()"
    )
    proc = smddp_launch(3, 1, ["-c", script], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for r in range(3):
        assert f"[rank {r}] out from {r}" in proc.stdout.splitlines()
        assert f"[rank {r}] err from {r}" in proc.stderr.splitlines()
    raw = smddp_launch(2, 1, ["-c", script], timeout=120, extra=["--no-tag-output"])
    assert raw.returncode == 0 and "out from 1" in raw.stdout.splitlines()


def test_more_collectives_in_flight_than_the_rings_hold(tmp_path, clean_host):
    # 600 asynchronous collectives started before any is waited for (numpy handles kept, then
    # dropped; torch Works kept, then dropped): the done ring holds 256, so the starts themselves
    # must take the DONEs nobody waits for yet. Two nodes of two, so the daemons' exchange runs too.
    proc = smddp_launch(
        4, 2, [str(HERE / "check_backlog.py"), "--out", str(tmp_path), "--case", "flood"], timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(4):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert out == {
            "numpy_bad": [],
            "after_drops_ok": True,
            "torch_bad": [],
            "torch_after_drops_ok": True,
        }, out


def test_a_start_behind_collectives_that_never_complete_times_out(tmp_path, clean_host):
    # The last rank is late by 2.5x the job's timeout: the others start as many collectives as a
    # channel keeps in flight, and the next start raises CollectiveTimeoutError after the timeout,
    # naming the cause, with the job intact: once the late rank joins, every collective started completes.
    args = [str(HERE / "check_backlog.py"), "--out", str(tmp_path), "--case", "late", "--timeout", "2"]
    proc = smddp_launch(3, 1, args, timeout=300, extra=["--timeout", "2"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(3):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert out["late_bad"] == [] and out["late_started"] == out["max_in_flight"], out
        if r < 2:
            head, _, why = out["late_start"].partition(": ")
            took = float(head.removeprefix("timeout after ").removesuffix("s"))
            # Not before its 2 s (--timeout 2); the upper bound tells that bound from the job's 300 s, with
            # room for a loaded host's seconds.
            assert 2.0 <= took < 60.0, out
            assert (
                f"rank {r}: a collective could not start: the {out['max_in_flight']} this worker started"
                in why
            )
            assert "had no result for 2 s" in why, out
        else:
            assert out["late_start"] == "all started", out


def test_session_directories_killed_mpiruns_left_do_not_stop_a_launch(clean_host):
    """A killed mpirun leaves its session directory, <TMPDIR>/ompi.<pid>, holding PMIx rendezvous files
    that PMIx creates exclusively: a later mpirun given that pid (pids wrap) fails to start. Here every
    pid of a fresh pid namespace has one. A plain mpirun there fails, and so does smddp-launch told to
    use the shared TMPDIR; smddp-launch as it is (a session base of each attempt's own) runs the job,
    and removes its base, and of the rest only a base whose launcher is gone."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        skip_or_fail("needs root and unshare(1) for a pid namespace")
    # Short: the daemons' sockets go there too (a unix socket's path has 108 bytes).
    tmp = tempfile.mkdtemp(prefix="smddp-ss-", dir="/tmp")
    env = {**job_env(), "TMPDIR": tmp}
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(HERE / "check_stale_session.py")]
    cmd.append(str(BIN))
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(HERE.parent.parent)
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = "listener thread failed to start"
    # What the planted files do to a start that meets them: the test would catch the launcher meeting them.
    assert rec["plain"]["rc"] != 0 and failed in rec["plain"]["out"], rec["plain"]
    assert rec["launch_shared"]["rc"] != 0 and failed in rec["launch_shared"]["out"], rec["launch_shared"]
    assert rec["launch"]["rc"] == 0, rec["launch"]["out"][-3000:]
    assert rec["launch"]["out"].count("SUM 10.0") == 4, rec["launch"]["out"][-3000:]
    # Its base went with it; one a SIGKILLed launcher left is swept, a live launcher's kept.
    assert rec["left"] == [] and rec["removed"] == [rec["gone"]] and rec["live_kept"], rec


def test_the_daemons_and_the_launcher_never_load_numpy(tmp_path, clean_host):
    """smddp-launch and the daemons hold no array: they start without numpy (nor the client), which was
    a third of their start-up, and serve collectives without it. The worker, which holds arrays, has
    it mapped: the check sees numpy where it is."""
    proc = smddp_launch(4, 2, [str(HERE / "check_lean.py"), "--out", str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(4):
        mapped = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert set(mapped) == {"daemon0", "daemon1", "launcher", "worker"}, mapped
        assert mapped["worker"], "the worker's numpy is not seen"
        assert {k: v for k, v in mapped.items() if k != "worker" and v} == {}
