"""torch's own distributed test suite against smddp, with gloo as the control: every test gloo passes, smddp passes, but for the ones listed here with why (2 ranks: gloo's outcomes as recorded for the pinned torch, checked against a live gloo run in the long tier; 4 ranks: gloo live)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from smddp.transport.bootstrap import default_socket_dir
from tests.conftest import REPO, need_module
from tests.torch.test_spawn import MARK, marked_leftovers
from tests.torch.test_torchrun import run_env

need_module("torch", "pip install -e '.[torch]'")
need_module("expecttest", "make setup installs it (torch's test suite imports it)")

pytestmark = pytest.mark.torch

#: What gloo passes and smddp cannot, each with its reason (docs/torch.md says the same). The runner
#: tells the suite "gloo" so that its gates by name let smddp in (tests/torch/torch_suite.py).
GLOO_ONLY = {
    "test_get_backend": "it asks get_backend() for the name the suite was told (gloo); an smddp group says smddp",
    "test_monitored_barrier_gloo": "torch implements monitored_barrier for gloo groups alone (it refuses any other by name)",
    "test_monitored_barrier_gloo_subgroup": "the same: monitored_barrier is gloo's alone",
    "test_monitored_barrier_gloo_rank_0_timeout": "the same: monitored_barrier is gloo's alone",
}

#: What the C++ backend cannot pass and the Python one does, with why.
NATIVE_ONLY_FAILS = {
    "test_ddp_logging_data_cpu": "DDP logs its group's ProcessGroup::getBackendName(), which torch makes "
    '"custom" for every C++ backend it does not know by type (dist.get_backend says smddp); a Python '
    "group answers for itself",
}


def _suite(backend: str, world: int, out: Path) -> dict[str, Any]:
    mark = f"suite{os.getpid()}{backend}{world}"
    base = default_socket_dir()
    before = set(os.listdir(base)) if os.path.isdir(base) else set()
    tmp = Path(tempfile.gettempdir())
    tmp_before = set(tmp.iterdir())
    env = {**run_env(), "SMDDP_SUITE_BACKEND": backend, "WORLD_SIZE": str(world), MARK: mark}
    report = out / f"{backend}-{world}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.torch.torch_suite", "--out", str(report)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0 and report.exists(), proc.stderr[-4000:]
    left = marked_leftovers(mark, before)
    assert not left, f"the suite's smddp jobs left {left}"
    # Nor its tests their store files (a FileStore's keys name the group: default_pg).
    stores = [
        p for p in set(tmp.iterdir()) - tmp_before if p.is_file() and b"default_pg" in p.read_bytes()[:65536]
    ]
    assert not stores, f"the suite's tests left their store files: {sorted(stores)[:5]}"
    return json.loads(report.read_text())["tests"]


def _passed(tests: dict[str, Any]) -> set[str]:
    return {name for name, t in tests.items() if t["outcome"] == "pass"}


#: gloo's outcomes at 2 ranks, recorded (its suite run costs CI about a minute, and gloo at a pinned
#: torch does not change between runs): used where the torch installed is the one they were recorded
#: with; test_the_recorded_gloo_outcomes_are_gloos (long tier) runs gloo and compares.
RECORDED = REPO / "tests" / "torch" / "gloo_suite_2.json"


def _recorded_gloo() -> dict[str, Any] | None:
    import torch

    rec = json.loads(RECORDED.read_text())
    if rec["torch"] != torch.__version__:
        return None  # another torch: gloo runs live
    return {name: {"outcome": o} for name, o in rec["outcomes"].items()}


# Each backend runs the whole suite; the Python one (the fallback, which every other torch test also
# runs) in the long tier, at about two minutes of CI's time a run.
@pytest.mark.parametrize(
    "torch_backend", ["native", pytest.param("python", marks=pytest.mark.long)], indirect=True
)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.long)])
def test_every_test_gloo_passes_smddp_passes(world: int, torch_backend: str, tmp_path: Path) -> None:
    gloo = (_recorded_gloo() if world == 2 else None) or _suite("gloo", world, tmp_path)
    ours = _suite("smddp", world, tmp_path)
    assert set(gloo) == set(ours) and len(gloo) > 250  # the same suite, whole
    missing = _passed(gloo) - _passed(ours)
    excused = set(GLOO_ONLY) | (set(NATIVE_ONLY_FAILS) if torch_backend == "native" else set())
    why = {n: ours[n]["why"][-600:] for n in sorted(missing - excused)}
    assert not why, f"gloo passes these and smddp does not: {json.dumps(why, indent=1)}"
    # Each listed test fails on smddp, as its reason says (a list that outlives its reason is wrong).
    stale = {n for n in excused if n in _passed(ours) or ours[n]["outcome"] == "skip"}
    assert not stale, f"listed as failing on smddp, but smddp does not fail them: {sorted(stale)}"
    assert len(_passed(ours)) >= len(_passed(gloo)) - len(excused)


@pytest.mark.long
def test_the_recorded_gloo_outcomes_are_gloos(tmp_path: Path) -> None:
    """The recorded outcomes are what gloo does now, test by test (regenerate them with the command
    the file names when torch's pin moves)."""
    recorded = _recorded_gloo()
    assert recorded is not None, f"{RECORDED.name} was recorded with another torch: regenerate it"
    live = _suite("gloo", 2, tmp_path)
    assert {n: t["outcome"] for n, t in live.items()} == {n: t["outcome"] for n, t in recorded.items()}
