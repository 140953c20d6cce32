"""The torch backend's device route on the stand-in runtime: every collective, and stock DDP bit for bit.

With SMDDP_DEVICE_RUNTIME=standin the backend hands every tensor to smddp as device memory, on
the caller's stream, and finishes each Work on a side stream after the results' copies, exactly
as for CUDA tensors; copies are delayed, so a Work completed before its copies shows stale data.
(torch's CPU build has no CUDA tensors: tests/gpu/test_gpu.py runs the CUDA part on a GPU.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, REPO, job_env, need_module

torch = need_module("torch", "pip install -e '.[torch]'")

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess]

TORCH_TESTS = REPO / "tests" / "torch"
WRAPPER = str(Path(__file__).parent / "run_standin.py")


def launch(world: int, nodes: int, args: list[str], timeout: float = 600) -> None:
    cmd = [str(BIN / "smddp-launch"), "-np", str(world), "--local-nodes", str(nodes), "--", sys.executable]
    proc = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, env=job_env(), cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def device_route_taken(stats_dir: Path, world: int) -> None:
    for r in range(world):
        d = json.loads((stats_dir / f"stats{r}.json").read_text())
        st = d["stats"]
        assert d["runtime"] == "standin" and st["d2h"] > 20 and st["h2d"] > 20 and st["kernels"] > 0, st
        assert st["pageable"] == 0, st


@pytest.mark.parametrize(("world", "nodes"), [(2, 1), (4, 2)], ids=["W2-N1", "W4-N2"])
def test_every_collective_on_the_device_route(
    world: int, nodes: int, tmp_path: Path, clean_host: None
) -> None:
    launch(
        world,
        nodes,
        [WRAPPER, str(tmp_path), str(TORCH_TESTS / "check_collectives.py"), "--out", str(tmp_path)],
    )
    device_route_taken(tmp_path, world)
    for r in range(world):
        d = json.loads((tmp_path / f"rank{r}.json").read_text())
        failed = [k for k, v in d["checks"].items() if not v]
        assert not failed and len(d["checks"]) > 45, failed
        # What smddp does not run went to the side group (gloo: stand-in tensors are CPU tensors).
        assert d["routed"] and all(d["routed"].values()), d["routed"]


def test_ddp_on_the_device_route_matches_the_host_route(tmp_path: Path, clean_host: None) -> None:
    """Stock DDP in every mode (buckets, hook, unused parameters, no_sync...): the same bits both ways."""
    modes = "default,bucket_view,unused,static,no_sync,hook,smddp_ddp"
    args = [
        str(TORCH_TESTS / "check_ddp.py"),
        "--backend",
        "smddp",
        "--modes",
        modes,
        "--dtypes",
        "float32,bfloat16",
    ]
    dev, host = tmp_path / "device", tmp_path / "host"
    dev.mkdir()
    host.mkdir()
    launch(2, 1, [WRAPPER, str(dev), *args, "--out", str(dev)])
    launch(2, 1, [*args, "--out", str(host)])
    device_route_taken(dev, 2)
    for r in range(2):
        a: dict[str, Any] = torch.load(dev / f"rank{r}.pt")
        b: dict[str, Any] = torch.load(host / f"rank{r}.pt")
        assert a.keys() == b.keys() and len(a) == 14
        for key in a:
            for kind in ("params", "buffers"):
                for name, t in a[key][kind].items():
                    assert torch.equal(t, b[key][kind][name]), (key, kind, name)
            assert a[key]["losses"] == b[key]["losses"], key
