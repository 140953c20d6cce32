"""What ships is what users run: the wheel holds no test rig, and installs and runs a job without a compiler."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RIGS = ("simcluster", "delayline", "standin", "targets", "benchmarks_md", "smddp_rigs", "rigs/")


@pytest.mark.timeout(900)
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
    assert any(n.startswith("smddp/_engine.") and n.endswith(".so") for n in names)  # built, not built later
    assert not any(n.startswith(("tests/", "examples/")) for n in names)

    # It installs into a fresh environment where no compiler works, and runs a job.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "CC": "/bin/false",
        "CXX": "/bin/false",
        "HOME": str(tmp_path),
    }
    out = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    job = (
        "import numpy as np, smddp, smddp._engine; smddp.init(); x = np.full(8, smddp.rank() + 1.0, np.float32); "
        "smddp.allreduce(x); assert (x == 3).all(), x; smddp.shutdown(); print('ok', smddp.__file__)"
    )
    out = subprocess.run(
        [str(venv / "bin" / "smddp-launch"), "-np", "2", "--", str(venv / "bin" / "python"), "-c", job],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("ok " + str(venv)) == 2, out.stdout
