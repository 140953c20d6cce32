"""The smddp backend under torchrun on one host: no mpirun, the daemon started by the first worker through torch's store; the same bits as gloo and as smddp-launch, restarts, errors, nothing left behind."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from smddp.transport.bootstrap import PLACEMENT_VARS, default_socket_dir
from smddp.transport.netif import service_port
from tests.conftest import BIN, REPO, need_module, smddp_launch
from tests.replicas import assert_replicas_identical

torch = need_module("torch", "pip install -e '.[torch]'")

pytestmark = pytest.mark.torch

HERE = Path(__file__).parent
EXAMPLES = REPO / "examples" / "torch"
MODES = "default,bucket_view,unused,static,no_sync,smddp_ddp"


def torchrun_argv(
    nproc: int, run_id: str, script: list[str], tmp: Path, extra: list[str] | None = None
) -> list[str]:
    """torchrun on this host alone, with a c10d rendezvous of our own id (TORCHELASTIC_RUN_ID: the
    leftover check finds this run's daemons by it), its log directory in the test's `tmp` (without
    one it makes a torchelastic_* directory in /tmp, and never removes it)."""
    return [
        str(BIN / "torchrun"),
        *("--nnodes", "1", "--nproc-per-node", str(nproc), "--log-dir", str(tmp / "torchelastic")),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{service_port()}", "--rdzv-id", run_id),
        *(extra or []),
        *script,
    ]


def run_env() -> dict[str, str]:
    # A developer's shell may hold a job's placement; torchrun's workers must not inherit it.
    env = {k: v for k, v in os.environ.items() if k not in PLACEMENT_VARS}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def torchrun_leftovers(run_id: str, dirs_before: set[str]) -> list[str]:
    """What a torchrun run left: smddp-daemon processes of the run, its jobs' directories (job.json
    names the run), smddp files in /dev/shm. Other jobs on the machine are not this test's."""
    found = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if "smddp" in n.lower()]
    base = default_socket_dir()
    for name in set(os.listdir(base)) - dirs_before if os.path.isdir(base) else ():
        try:
            run = json.loads((Path(base) / name / "job.json").read_text()).get("run")
        except (OSError, ValueError):
            continue  # gone meanwhile, or a job still starting: not one of this run's leftovers
        if run == run_id:
            found.append(os.path.join(base, name))
    return found + live_daemons_with(f"TORCHELASTIC_RUN_ID={run_id}")


def live_daemons_with(variable: str) -> list[str]:
    """The live smddp-daemon processes whose environment holds `variable` (NAME=value)."""
    found = []
    ps = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True, timeout=30)
    for line in ps.stdout.splitlines():
        pid, stat, args = [*line.split(None, 2), "", ""][:3]
        if "smddp" in args and "daemon" in args and not stat.startswith("Z"):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if variable.encode() in env.split(b"\0"):
                found.append(f"process {pid} {args[:160]}")
    return found


@pytest.fixture
def torchrun(tmp_path: Path):
    """Runs torchrun jobs; after the test, fails it if any of them left something behind."""
    base = default_socket_dir()
    before = set(os.listdir(base)) if os.path.isdir(base) else set()
    runs: list[str] = []

    def run(nproc: int, script: list[str], timeout: float = 300, extra: list[str] | None = None) -> Any:
        run_id = f"t{secrets.token_hex(6)}"
        runs.append(run_id)
        argv = torchrun_argv(nproc, run_id, script, tmp_path, extra)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=run_env(), cwd=REPO)

    run.runs = runs  # type: ignore[attr-defined]
    yield run
    deadline = time.monotonic() + 10
    while True:
        left = [x for r in runs for x in torchrun_leftovers(r, before)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"left behind: {left}"


def _why(out: str, err: str) -> str:
    """What a failed torchrun job said that matters: its output's tail and every error or smddp line
    (torchrun's own report of the failure is long and says little)."""
    said = [ln for ln in err.splitlines() if "rror" in ln or "smddp" in ln or "attempt" in ln]
    return out[-2000:] + "\n".join(said[-80:])


def _ok(proc: Any) -> None:
    assert proc.returncode == 0, _why(proc.stdout, proc.stderr)


def _ddp(run: Any, tmp: Path, name: str, backend: str, nproc: int, modes: str) -> list[dict[str, Any]]:
    out = tmp / name
    out.mkdir()
    script = [str(HERE / "check_ddp.py"), "--out", str(out), "--backend", backend, "--no-init"]
    script += ["--dtypes", "float32,bfloat16", "--modes", modes]
    if run is smddp_launch:
        _ok(smddp_launch(nproc, 1, script, timeout=400))
    else:
        _ok(run(nproc, script, timeout=400))
    return [torch.load(out / f"rank{r}.pt") for r in range(nproc)]


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]], keys: Any = None) -> None:
    for key in keys or a[0]:
        for r in range(len(a)):
            for part in ("params", "buffers"):
                for name, t in a[r][key][part].items():
                    assert torch.equal(t, b[r][key][part][name]), (key, r, part, name)
            for name, t in a[r][key]["params"].items():
                assert torch.equal(t, a[0][key]["params"][name]), (key, r, name)


def test_ddp_under_torchrun_gives_gloo_bits(torchrun: Any, tmp_path: Path) -> None:
    """Two workers under torchrun, every DDP mode, float32 and bfloat16: the bits of gloo under torchrun."""
    ours = _ddp(torchrun, tmp_path, "smddp", "smddp", 2, MODES)
    ref = _ddp(torchrun, tmp_path, "gloo", "gloo", 2, MODES.replace(",smddp_ddp", ""))
    assert ours[0]["default/float32"]["group"] == "smddp"
    _same(ours, ref, [k for k in ours[0] if not k.startswith("smddp_ddp/")])
    for r in range(2):  # smddp.torch.DistributedDataParallel is stock DDP on smddp: default's bits
        for name, t in ours[r]["smddp_ddp/float32"]["params"].items():
            assert torch.equal(t, ref[r]["default/float32"]["params"][name]), name


# `long`: CI compares torchrun's bits with smddp-launch's on 4 simulated nodes
# (tests/multinode/test_torchrun.py), and runs 4 workers on one host in test_examples_run_under_torchrun.
@pytest.mark.long
def test_four_workers_under_torchrun_give_the_bits_of_smddp_launch(torchrun: Any, tmp_path: Path) -> None:
    """One data plane: 4 workers under torchrun sum exactly as under smddp-launch (mpirun)."""
    modes = "default,no_sync"
    ours = _ddp(torchrun, tmp_path, "torchrun", "smddp", 4, modes)
    ref = _ddp(smddp_launch, tmp_path, "launch", "smddp", 4, modes)
    _same(ours, ref)


def test_a_killed_worker_is_restarted_by_torchrun_and_training_finishes(
    torchrun: Any, tmp_path: Path
) -> None:
    """SIGKILL of a worker that is not its node's first: torchrun (--max-restarts 1) stops the others,
    the daemon goes with the node's first worker, and a fresh job (new id, new daemon) resumes from
    the checkpoint and ends with the parameters of an uninterrupted run, bit for bit."""
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    script = [str(EXAMPLES / "train_resume.py"), "--steps", "600", "--ckpt-every", "100"]
    _ok(torchrun(2, [*script, "--ckpt-dir", str(ref), "--save", str(tmp_path / "ref.pt")]))

    run_id = f"t{secrets.token_hex(6)}"
    torchrun.runs.append(run_id)
    argv = torchrun_argv(
        2, run_id, [*script, "--ckpt-dir", str(ckpt), "--save", str(tmp_path / "got.pt")], tmp_path
    )
    argv[1:1] = ["--max-restarts", "1"]
    p = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env(), cwd=REPO
    )
    try:
        deadline = time.monotonic() + 180
        while not (ckpt / "ckpt-000100.pt").exists():
            assert p.poll() is None and time.monotonic() < deadline, "no checkpoint came"
            time.sleep(0.05)
        victim = _worker_pid(p.pid, local_rank=1)
        os.kill(victim, signal.SIGKILL)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, _why(out, err)
    assert "attempt 1: 2 workers, starting at step" in out, out[-3000:]
    assert "attempt 1: trained to step 600" in out
    # torchrun saw the kill (it stops the node's other workers itself, often before smddp tells them).
    assert "exitcode: -9" in err and "local_rank: 1" in err, err[-5000:]
    got, want = torch.load(tmp_path / "got.pt"), torch.load(tmp_path / "ref.pt")
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.long  # 21 s; CI keeps the restart of a killed worker, which is a fresh job the same way
def test_a_node_that_joins_starts_a_new_round_which_is_a_fresh_job(torchrun: Any, tmp_path: Path) -> None:
    """torchrun --nnodes 1:2: the first agent trains alone (2 workers, one daemon), a second agent
    joins, torch elastic restarts the round with both (4 workers, two daemons): a fresh smddp job,
    new id, the first round's daemon gone, every sum right; nothing left behind."""
    run_id = f"t{secrets.token_hex(6)}"
    torchrun.runs.append(run_id)
    script = [str(HERE / "check_torchrun_elastic.py"), "--out", str(tmp_path), "--want", "4"]
    # The round closes 1 s after the minimum is there (torch's default waits 30 s for more).
    conf = ["--rdzv-conf", "last_call_timeout=1"]
    argv = torchrun_argv(2, run_id, script, tmp_path, conf)
    argv[argv.index("--nnodes") + 1] = "1:2"
    # torch 2.13's agents, sharing the rendezvous store with the job (its default), never finish the
    # round after a node joins (both wait for keys the other writes elsewhere: the same with gloo and
    # no smddp at all); with a store of the job's own they do. docs/launching.md says so.
    env = {**run_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    ]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "round2-rank1.json").exists():
            assert agents[0].poll() is None and time.monotonic() < deadline, "the first round did not start"
            time.sleep(0.05)
        first = json.loads((tmp_path / "round2-rank0.json").read_text())
        agents.append(
            subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
            )
        )
        outs = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.communicate()
    for a, (out, err) in zip(agents, outs, strict=True):
        assert a.returncode == 0, _why(out, err)
    rounds = {r: json.loads((tmp_path / f"round4-rank{r}.json").read_text()) for r in range(4)}
    assert {x["job"] for x in rounds.values()} == {rounds[0]["job"]} and rounds[0]["job"] != first["job"]
    assert all(x["sum_ok"] for x in rounds.values()) and first["sum_ok"]
    assert sorted(x["node"] for x in rounds.values()) == [0, 0, 1, 1]
    assert first["daemon_pid"] not in {x["daemon_pid"] for x in rounds.values()}
    assert (
        not Path(f"/proc/{first['daemon_pid']}").exists()
        or "zombie" in Path(f"/proc/{first['daemon_pid']}/status").read_text()
    ), "the first round's daemon outlived its round"


def _worker_pid(agent: int, local_rank: int) -> int:
    """The pid of torchrun's worker with LOCAL_RANK=`local_rank` (a child of the agent)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"LOCAL_RANK={local_rank}".encode() in env:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under torchrun (pid {agent})")


def test_a_daemon_that_cannot_start_fails_every_rank_with_the_cause(
    torchrun: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A secret file others can read: the daemon refuses it, and every rank's error says so, quickly."""
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o644)
    monkeypatch.setenv("SMDDP_SECRET_FILE", str(secret))
    script = [str(EXAMPLES / "train_resume.py"), "--steps", "10", "--ckpt-dir", str(tmp_path / "c")]
    t0 = time.monotonic()
    proc = torchrun(2, script)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    err = proc.stderr
    cause = "must be a regular file of uid"
    # The daemon says why, and so does the worker that started it (torchrun's root cause; torchrun
    # then stops the other ranks, which may or may not have printed the same first).
    assert "[smddp-daemon ERROR" in err and "bootstrap failed: the secret file" in err, err[-5000:]
    assert f"smddp.errors.BootstrapError: the secret file {secret} {cause}" in err, err[-5000:]
    if "BootstrapError: rank 1:" in err:
        assert f"BootstrapError: rank 1: the secret file {secret} {cause}" in err, err[-5000:]
    assert took < 60, took


SLOW_FIRST_GROUP = (
    "import os, time\n"
    "import torch, torch.distributed as dist\n"
    "import smddp.torch  # noqa: F401\n"
    "if os.environ['RANK'] == '1':\n"
    "    time.sleep(8)  # a slow start-up before its first group: a dataset to fetch, a JIT build\n"
    "dist.init_process_group('smddp')\n"
    "t = torch.ones(4)\n"
    "dist.all_reduce(t)\n"
    "print('sum', t[0].item(), flush=True)\n"
)


def test_a_rank_that_does_not_reach_its_first_group_in_time_is_named(
    torchrun: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun the ranks' first groups bootstrap the daemons, bounded by the join timeout of
    smddp-launch's daemons (SMDDP_JOIN_TIMEOUT_S, 30 min: torch's default) rather than a fixed 300 s;
    here 2 s, and rank 1 comes 8 s late."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_FIRST_GROUP)
    monkeypatch.setenv("SMDDP_JOIN_TIMEOUT_S", "2")
    t0 = time.monotonic()
    proc = torchrun(2, [str(script)])
    assert proc.returncode != 0, _why(proc.stdout, proc.stderr)
    said = "BootstrapError: rank 0: rank(s) 1 did not join the smddp job within 2s (SMDDP_JOIN_TIMEOUT_S"
    assert said in proc.stderr, _why(proc.stdout, proc.stderr)
    assert time.monotonic() - t0 < 60


def test_a_secret_file_keeps_the_secret_off_the_store(
    torchrun: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --secret-file (SMDDP_SECRET_FILE) the job's secret is derived from the file on every node,
    so none crosses torch's store (daemon 0 sends only the job id: tests/unit/test_relay.py)."""
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    monkeypatch.setenv("SMDDP_SECRET_FILE", str(secret))
    out = tmp_path / "out"
    out.mkdir()
    _ok(torchrun(2, [str(HERE / "check_torchrun_secret.py"), "--out", str(out)]))
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(g["derived"] and g["sum"] == 3.0 for g in got), got
    assert got[0]["job"] == got[1]["job"]
    status = json.loads(got[0]["status"])
    assert status["job"] == got[0]["job"] and len(status["daemons"]) == 1, status
    w = status["daemons"][0]["workers"]
    assert (w["connected"], w["expected"], w["ranks"]) == (2, 2, [0, 1]), status


def test_examples_run_under_torchrun(torchrun: Any, tmp_path: Path) -> None:
    """The DDP example and the Hugging Face Trainer one, unchanged, under torchrun."""
    (tmp_path / "ddp").mkdir()
    proc = torchrun(
        4, [str(EXAMPLES / "train_digits.py"), "--epochs", "4", "--save-params", str(tmp_path / "ddp")]
    )
    _ok(proc)
    acc = [float(m) for m in re.findall(r"test accuracy (\d\.\d+)", proc.stdout)]
    assert len(acc) == 4 and acc[-1] > 0.85, proc.stdout[-3000:]
    assert "replicas agree bit for bit: True" in proc.stdout
    assert_replicas_identical(tmp_path / "ddp", 4)
    need_module("transformers", "make setup installs it")
    save = tmp_path / "hf.pt"
    (tmp_path / "hf").mkdir()
    hf = [
        str(EXAMPLES / "train_hf_trainer.py"),
        "--epochs",
        "1",
        "--save",
        str(save),
        "--save-params",
        str(tmp_path / "hf"),
    ]
    proc = torchrun(2, hf)
    _ok(proc)
    assert "replicas agree bit for bit: True" in proc.stdout, proc.stdout[-3000:]
    assert_replicas_identical(tmp_path / "hf", 2)
    assert "backend smddp, 2 workers" in proc.stdout, proc.stdout[-3000:]
