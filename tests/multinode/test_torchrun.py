"""torchrun across 4 simulated nodes with the c10d rendezvous: no mpirun, one daemon per node started by its first worker; the bits of smddp-launch, nothing left in any node."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from smddp_rigs.simcluster import ClusterConfig, SimCluster, cleanup_stale

from tests.conftest import (
    BIN,
    REPO,
    communicate_all,
    need_module,
    need_root,
    processes_in_nodes,
    smddp_launch,
)
from tests.torch.test_torchrun import run_env, torchrun_leftovers

pytestmark = pytest.mark.multinode

torch = need_module("torch", "pip install -e '.[torch]'")

PREFIX = "smddpe"
SUBNET = "10.77.30"
CHECK_DDP = str(REPO / "tests" / "torch" / "check_ddp.py")


def test_ddp_under_torchrun_on_four_nodes_gives_the_bits_of_smddp_launch(
    tmp_path: Path, clean_host: None
) -> None:
    need_root("multi-node tests")
    cleanup_stale(PREFIX)
    args = ["--backend", "smddp", "--no-init", "--modes", "default,no_sync", "--dtypes", "float32,bfloat16"]
    ours, ref = tmp_path / "torchrun", tmp_path / "launch"
    ours.mkdir()
    ref.mkdir()
    run_id = "mn-torchrun"
    cluster = SimCluster(ClusterConfig(nodes=4, prefix=PREFIX, subnet=SUBNET)).up()
    try:
        endpoint = f"{cluster.hosts()[0]}:29400"
        procs = [
            cluster.popen(
                i,
                [
                    str(BIN / "torchrun"),
                    *("--nnodes", "4", "--nproc-per-node", "1"),
                    *("--log-dir", str(tmp_path / f"torchelastic{i}")),
                    *("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id),
                    *(CHECK_DDP, "--out", str(ours), *args),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=run_env(),
                cwd=REPO,
            )
            for i in range(4)
        ]
        outs = communicate_all(procs, 400)
        for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
            assert p.returncode == 0, f"node {i}: " + out[-2000:] + err[-4000:]
        # Nothing of the job stays in any node: no daemon, no worker, no agent.
        deadline = time.monotonic() + 10
        while (left := processes_in_nodes([cluster.netns(i) for i in range(4)], cluster.hosts(), set())) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert not left, left
    finally:
        cluster.down()
    assert not torchrun_leftovers(run_id, set())
    # The same job under smddp-launch, 4 simulated nodes on this host: the same sums, the same bits.
    proc = smddp_launch(4, 4, [CHECK_DDP, "--out", str(ref), *args], timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    a = [torch.load(ours / f"rank{r}.pt") for r in range(4)]
    b = [torch.load(ref / f"rank{r}.pt") for r in range(4)]
    assert (
        sorted(a[0])
        == sorted(b[0])
        == ["default/bfloat16", "default/float32", "no_sync/bfloat16", "no_sync/float32"]
    )
    for key in a[0]:
        for r in range(4):
            for name, t in a[r][key]["params"].items():
                assert torch.equal(t, b[r][key]["params"][name]), (key, r, name)
                assert torch.equal(t, a[0][key]["params"][name]), (key, r, name)
