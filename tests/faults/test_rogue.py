"""An authenticated worker that sends an invalid frame fails the job cleanly: an error on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import smddp_launch

pytestmark = pytest.mark.faults

WORKER = str(Path(__file__).parent / "rogue_worker.py")
FRAMES = [
    "out of bounds",
    "unknown segment",
    "a number past the window",
    "an attach without its fd",
    "another rank's name",
    "release of nothing",
    "a daemon's message",
]


@pytest.mark.parametrize("frame", FRAMES)
def test_invalid_frame_from_an_authenticated_worker(frame, tmp_path, clean_host):
    proc = smddp_launch(4, 2, [WORKER, "--out", str(tmp_path), "--frame", frame], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(4):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        # Every rank fails with a job error that names the rogue, never a timeout or wrong numbers.
        assert out["outcome"] in ("CollectiveError", "PeerLostError"), (r, out)
        assert "rank 1" in out["message"], (r, out)
