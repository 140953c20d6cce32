"""What ships is what users run: the wheel `pip wheel .` builds holds no test or benchmark rig."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RIGS = ("simcluster", "delayline", "standin", "targets", "benchmarks_md", "smddp_rigs", "rigs/")


@pytest.mark.timeout(240)
def test_the_wheel_lists_no_rig(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("smddp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if ".dist-info/" not in n]
    assert code and all(n.startswith(("smddp/", "smdistributed/")) for n in code), code
    assert [n for n in names if any(r in n for r in RIGS)] == []
    for shipped in ("smddp/settings.py", "smddp/client/device/runtime.py", "smddp/bench/sweep.py"):
        assert shipped in names
    assert not any(n.startswith(("tests/", "examples/")) for n in names)
