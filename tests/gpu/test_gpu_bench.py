"""python -m smddp.bench.gpu end to end on the stand-in runtime: copies, all-reduce jobs, JSON and markdown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, job_env

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
    assert report["copy"]["pageable"] == 0 and not report["copy"]["errors"]  # every copy was page-locked
    assert [run["workers"] for run in report["allreduce"]] == [1, 2]
    for run in report["allreduce"]:
        assert [r["bytes"] for r in run["rows"]] == [64 << 10, 1 << 20]
        assert all(r["correct"] and r["device_s"] > 0 and r["host_s"] > 0 for r in run["rows"])
    md = (tmp_path / "gpu.md").read_text()
    assert "arena D2H" in md and "| 2 | 1 MiB |" in md
