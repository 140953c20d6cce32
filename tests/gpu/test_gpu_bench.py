"""The GPU benchmarks end to end on the stand-in runtime: smddp.bench.gpu (copies, all-reduce jobs) and smddp-bench torch-gpu."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BIN, REPO, job_env

pytestmark = [pytest.mark.bench, pytest.mark.multiprocess]


def test_gpu_bench_on_the_standin(tmp_path: Path, clean_host: None) -> None:
    cmd = [sys.executable, "-m", "smddp.bench.gpu", "--runtime", "standin", "--sizes", "64K,1M"]
    cmd += ["--workers", "1,2", "--repeats", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=job_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["runtime"] == "standin" and "stand-in" in report["copy"]["device"]
    rows = report["copy"]["rows"]
    assert [r["bytes"] for r in rows] == [64 << 10, 1 << 20]
    assert all(
        r[k] > 0 for r in rows for k in ("plain_d2h_gbs", "plain_h2d_gbs", "arena_d2h_gbs", "arena_h2d_gbs")
    )
    assert report["copy"]["pageable"] == 0  # every copy was page-locked
    assert [run["workers"] for run in report["allreduce"]] == [1, 2]
    for run in report["allreduce"]:
        assert [r["bytes"] for r in run["rows"]] == [64 << 10, 1 << 20]
        assert all(r["correct"] and r["device_s"] > 0 and r["host_s"] > 0 for r in run["rows"])
    md = (tmp_path / "gpu.md").read_text()
    assert "arena D2H" in md and "| 2 | 1 MiB |" in md


def test_torch_gpu_bench_on_the_standin(tmp_path: Path, clean_host: None) -> None:
    """`smddp-bench torch-gpu` end to end on CPU tensors through the stand-in device route, the two ranks
    on two simulated nodes: the 1 MiB all-reduce goes in 4 pieces (the launch flags passed through,
    and the pieces checked like the rest)."""
    cmd = [str(BIN / "smddp-bench"), "torch-gpu", "--runtime", "standin", "--sizes", "4096,1048576"]
    cmd += ["--workers", "2", "--repeats", "3", "--out", str(tmp_path), "--name", "tg"]
    cmd += ["--launch-args", "--local-nodes 2 --pipeline-kb 256"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=job_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "tg.json").read_text())
    assert report["runtime"] == "standin" and [j["workers"] for j in report["jobs"]] == [2]
    (job,) = report["jobs"]
    assert "stand-in" in job["device"] and [r["bytes"] for r in job["rows"]] == [4096, 1 << 20]
    for r in job["rows"]:
        assert r["correct"] and all(r[f"{impl}_ms"] > 0 for impl in ("smddp", "gloo", "copy"))
        assert r["smddp_over_gloo"] == pytest.approx(r["smddp_ms"] / r["gloo_ms"])
    md = (tmp_path / "tg.md").read_text()
    assert "| 2 | 4 KiB |" in md and "smddp / copy" in md
