"""The GPU step (smddp/engine/device_step.h) on the stand-in driver: a node's ranks as processes.

The ranks share staging memory and flags across processes through the stand-in's IPC memory. The
copies, waits and fold kernels run late on the stand-in's streams. Every result is compared bit for
bit with tests/reference.py (check_step.py). The cases: one device shared by 4 ranks; 4 devices with
peer access; 2 ranks. Also: a node whose devices cannot reach each other is refused, naming why; a
driver that refuses the kernels' PTX is refused, naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, job_env

pytestmark = pytest.mark.multiprocess

SCRIPT = str(Path(__file__).parent / "check_step.py")


def run_node(tmp_path: Path, size: int, devices: int, extra: list[str], timeout: float = 300, **env: str):
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                SCRIPT,
                "--rank",
                str(r),
                "--size",
                str(size),
                "--dir",
                str(tmp_path),
                "--device",
                str(r % devices),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=job_env(SMDDP_STANDIN_DEVICES=str(devices), **env),
        )
        for r in range(size)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@pytest.mark.parametrize(
    ("size", "devices"), [(4, 1), (4, 4), (2, 2)], ids=["4-ranks-1-device", "4-devices", "2-devices"]
)
def test_the_node_collectives_are_the_host_paths_bits(tmp_path: Path, size: int, devices: int):
    outs = run_node(tmp_path, size, devices, [])
    for rc, _out, err in outs:
        assert rc == 0, err[-3000:]
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]
    recs = [p["records"] for p in per_rank]
    n = len(recs[0])
    assert n > 150 and all(len(x) == n for x in recs)
    bad = [(r, rec) for r, rr in enumerate(recs) for rec in rr if not rec["ok"]]
    assert not bad, f"{len(bad)} results differ from the reference, first: {bad[:3]}"
    kinds = {rec["case"]["kind"] for rec in recs[0]}
    assert kinds == {"allreduce", "reduce_scatter", "allgather", "broadcast"}
    assert {rec["case"]["root"] for rec in recs[0] if rec["case"]["kind"] == "broadcast"} == set(range(size))
    for i in range(n):
        if recs[0][i]["case"]["kind"] != "reduce_scatter":  # (each rank its own block)
            assert len({recs[r][i]["digest"] for r in range(size)}) == 1
    # Several pieces went through the two slots (each a multiple of the slot's size).
    assert per_rank[0]["pieces"] > n
    assert all(p["closed"] for p in per_rank)


def test_a_step_whose_waits_hold_nothing_back_gives_wrong_results(tmp_path: Path):
    """The same run on a driver whose stream memory waits do not wait (the stand-in's
    SMDDP_STANDIN_WAIT_SKIP): folds and gathers then read slots before their producers have filled
    them, and the checks above see it. So those checks depend on the step's ordering."""
    outs = run_node(tmp_path, 2, 2, ["--quick"], SMDDP_STANDIN_WAIT_SKIP="1")
    for rc, _out, err in outs:
        assert rc == 0, err[-3000:]
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text())["records"] for r in range(2)]
    wrong = {rec["case"]["kind"] for rr in recs for rec in rr if not rec["ok"]}
    assert wrong == {"allreduce", "reduce_scatter", "allgather", "broadcast"}, wrong


def test_devices_that_cannot_reach_each_other_are_refused_naming_why(tmp_path: Path):
    outs = run_node(tmp_path, 2, 2, ["--quick"], timeout=120, SMDDP_STANDIN_PEER="0")
    for rc, _out, err in outs:
        assert rc != 0
        assert "cannot reach local rank" in err and "no peer access" in err, err[-2000:]


def test_a_driver_that_refuses_the_kernels_ptx_is_named(tmp_path: Path):
    outs = run_node(tmp_path, 1, 1, ["--quick"], timeout=120, SMDDP_STANDIN_PTX_MAX="8.5")
    rc, _out, err = outs[0]
    assert rc != 0
    assert "CUDA_ERROR_UNSUPPORTED_PTX_VERSION" in err and "kernels" in err, err[-2000:]


@pytest.mark.parametrize("fail", [False, True], ids=["reached", "failed"])
def test_an_interprocess_event_holds_another_process_s_stream_until_reached(tmp_path: Path, fail: bool):
    """The stand-in's IPC events: a stream of one process waits for an event another records, no
    longer; a recorder's failure is the waiter's."""
    script = str(Path(__file__).parent / "check_ipc_event.py")
    flags = ["--fail"] if fail else []
    procs = [
        subprocess.Popen(
            [sys.executable, script, role, "--dir", str(tmp_path), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=job_env(),
        )
        for role in ("record", "wait")
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    assert "ok" in out
