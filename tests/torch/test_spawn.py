"""The smddp backend with no launcher (mp.spawn, file://, tcp://, a store passed in): torch's tutorial pattern bit for bit against gloo, several groups and a second init in one process, two jobs at once, errors named on every rank, nothing left behind."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from smddp.transport.bootstrap import default_socket_dir
from tests.conftest import REPO, need_module
from tests.torch.test_torchrun import live_daemons_with, run_env

torch = need_module("torch", "pip install -e '.[torch]'")

pytestmark = pytest.mark.torch
HERE = Path(__file__).parent
EXAMPLE = REPO / "examples" / "torch" / "train_spawn.py"
#: The variable each run's processes carry (its daemons inherit it): the leftover check finds them by it.
MARK = "SMDDP_TEST_SPAWN_RUN"


def marked_leftovers(mark: str, dirs_before: set[str]) -> list[str]:
    """What a run marked `mark` left: its smddp-daemon processes, job directories that were not there
    before it, smddp files in /dev/shm."""
    found = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if "smddp" in n.lower()]
    base = default_socket_dir()
    found += [
        os.path.join(base, n) for n in set(os.listdir(base) if os.path.isdir(base) else ()) - dirs_before
    ]
    return found + live_daemons_with(f"{MARK}={mark}")


@pytest.fixture
def spawn() -> Any:
    """Starts scripts that spawn their own ranks; after the test, fails it if any left something behind."""
    base = default_socket_dir()
    before = set(os.listdir(base)) if os.path.isdir(base) else set()
    mark = secrets.token_hex(6)

    def start(argv: list[str]) -> subprocess.Popen[str]:
        env = {**run_env(), MARK: mark}
        return subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(argv: list[str], timeout: float = 300) -> tuple[int, str, str]:
        p = start(argv)
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err

    run.start = start  # type: ignore[attr-defined]
    yield run
    deadline = time.monotonic() + 10
    while (left := marked_leftovers(mark, before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind: {left}"


def _outcomes(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_the_tutorials_spawned_ddp_gives_gloo_bits(spawn: Any, tmp_path: Path) -> None:
    """examples/torch/train_spawn.py (mp.spawn, MASTER_ADDR/PORT set by the script, no launcher): each
    rank's final parameters, written to files, equal gloo's bit for bit, rank by rank."""
    got = {}
    for backend in ("smddp", "gloo"):
        save = tmp_path / backend
        save.mkdir()
        code, out, err = spawn([str(EXAMPLE), "--world", "2", "--backend", backend, "--save", str(save)])
        assert code == 0, out[-2000:] + err[-3000:]
        assert f"2 spawned workers, backend {backend}" in out and "epoch 3: loss" in out, out
        got[backend] = [torch.load(save / f"rank{r}.pt") for r in range(2)]
    for r in range(2):
        assert got["smddp"][r].keys() == got["gloo"][r].keys()
        for name, t in got["smddp"][r].items():
            assert torch.equal(t, got["gloo"][r][name]), (r, name)
            assert torch.equal(t, got["gloo"][0][name]), (r, name)  # and every replica gloo's rank 0's


def _sum(world: int) -> float:
    return float(sum(r + 1 for r in range(world)))


@pytest.mark.parametrize(
    ("scenario", "world", "local_size"),
    [("groups", 4, 4), ("tcp", 2, 2), ("store", 2, 2), ("hosts", 4, 2)],
    ids=["file-groups-reinit", "tcp", "store-passed-in", "two-hosts-by-id"],
)
def test_ranks_place_themselves_through_the_store(
    spawn: Any, tmp_path: Path, scenario: str, world: int, local_size: int
) -> None:
    code, out, err = spawn([str(HERE / "check_spawn.py"), str(tmp_path), scenario, str(world)])
    assert code == 0, out[-2000:] + err[-3000:]
    for r, got in enumerate(_outcomes(tmp_path, world)):
        assert got["ok"], got
        assert got["first"] == _sum(world), got
        # One node per host (SMDDP_HOST_ID gives two in "hosts"), ranks in order within it.
        assert got["placed"] == {"smddp_rank": r, "local_rank": r % local_size, "local_size": local_size}, got
        if scenario == "groups":
            assert got["every"] == _sum(world) and got["again"] == _sum(world), got
            assert got["some"] == (_sum(2) if r < 2 else None), got  # a subgroup of ranks 0 and 1
            assert got["broadcast"] == float(world - 1) and got["backend"] == "smddp", got


def test_two_spawned_jobs_on_one_host_at_once(spawn: Any, tmp_path: Path) -> None:
    jobs = []
    for j in range(2):
        (tmp_path / str(j)).mkdir()
        jobs.append(spawn.start([str(HERE / "check_spawn.py"), str(tmp_path / str(j)), "groups", "2"]))
    for j, p in enumerate(jobs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out[-2000:] + err[-3000:]
        for got in _outcomes(tmp_path / str(j), 2):
            assert got["ok"] and got["first"] == _sum(2) and got["again"] == _sum(2), got


@pytest.mark.parametrize(
    ("scenario", "world", "said"),
    [
        ("world", 2, ["rank 1 has a world of 3 ranks and rank 0 one of 2"] * 2),
        ("local", 2, [r"rank 0 \(", r"both claim local rank 0 of their node \(LOCAL_RANK\)"]),
        (
            "lonely",
            3,
            [r"rank\(s\) 1-2 did not join the smddp job within 3s"]
            + ["rank 0 gave no smddp job id within 3s"] * 2,
        ),
    ],
    ids=["world-size-disagrees", "same-local-rank", "store-nobody-else-reaches"],
)
def test_what_cannot_start_is_named_on_every_rank(
    spawn: Any, tmp_path: Path, scenario: str, world: int, said: list[str]
) -> None:
    # Each within its init timeout (20 s; 3 s for the lonely ranks), not the group's 30 minutes: the
    # run's own bound is 120 s (a loaded host's spawns and imports take seconds of their own).
    code, out, err = spawn([str(HERE / "check_spawn.py"), str(tmp_path), scenario, str(world)], timeout=120)
    assert code == 0, out[-2000:] + err[-3000:]
    for r, got in enumerate(_outcomes(tmp_path, world)):
        assert not got["ok"] and got["error"].startswith("BootstrapError: "), got
        for words in said if scenario == "local" else [said[r]]:
            assert re.search(words, got["error"]), (r, words, got["error"])
