"""The daemons' shard exchange over libfabric (--fabric ofi, the tcp provider): every collective bit-exact,
and a provider libfabric does not offer ends the job at once, naming it and what is offered."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import smddp_launch
from tests.multiprocess.test_collectives import SCRIPT, check_every_collective, check_without_big

pytestmark = pytest.mark.multiprocess

OFI = ["--fabric", "ofi", "--ofi-provider", "tcp"]
# (workers, local nodes, provider): libfabric's tcp provider, and its shm provider (one host).
CONFIGS = [(4, 2, "tcp"), (3, 3, "tcp"), (4, 2, "shm")]


@pytest.mark.parametrize(
    ("world", "nodes", "provider"),
    # All `make test-long`: CI runs every collective over libfabric's tcp provider on 4 simulated
    # nodes of 2 (tests/multinode/test_jobs.py, 4x2-ofi), and both reduce paths over it here.
    [pytest.param(w, n, p, id=f"W{w}-N{n}-{p}", marks=pytest.mark.long) for w, n, p in CONFIGS],
)
def test_every_collective_over_ofi(
    world: int, nodes: int, provider: str, tmp_path: Path, clean_host: None
) -> None:
    check_every_collective(world, nodes, tmp_path, extra=["--fabric", "ofi", "--ofi-provider", provider])


@pytest.mark.parametrize(
    "path",
    [["--replicate-kb", "0"], ["--pipeline-kb", "16"]],
    ids=["never-replicated", "pipelined-16KiB-pieces"],
)
def test_both_reduce_paths_over_ofi(path: list[str], tmp_path: Path, clean_host: None) -> None:
    """The sharded path and pipelined pieces (payloads inline and in tagged parts) without the 64 MiB
    cases: this one also runs with the engine under ASan and TSan (make engine-sanitize-jobs)."""
    check_without_big(4, 2, tmp_path, [*OFI, *path])


def test_a_provider_not_offered_fails_fast(tmp_path: Path, clean_host: None) -> None:
    t0 = time.monotonic()
    proc = smddp_launch(
        2, 2, [SCRIPT, "--out", str(tmp_path), "--nnodes", "2"], timeout=120, extra=["--fabric", "ofi"]
    )
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # Every node's daemon says so (each checks on its own, before the bootstrap).
    assert out.count("the libfabric provider 'efa' is not available here") == 2, out[-3000:]
    assert "offers " in out and "tcp" in out.split("offers ", 1)[1], out[-3000:]
    assert took < 20, took  # the workers, which no daemon could take in, are stopped at once
