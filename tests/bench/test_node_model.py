"""The model of nodes of 8 GPUs (issue 57, item 7): its terms against the arithmetic they stand for."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from smddp_rigs.bench import node_model as nm

from tests.conftest import REPO


@pytest.mark.parametrize("inst", nm.INSTANCES, ids=[c.name for c in nm.INSTANCES])
def test_the_gpu_step_moves_one_gth_over_pcie_and_the_same_over_the_network(inst):
    """Each GPU's PCIe copies are S/G on the GPU step and S on the host path, both ways; the network
    carries 2 (N-1)/N S either way; the CPU folds G inputs on the host path only. Read off the stages
    with everything else made free, one term at a time."""
    s, n = 64 * nm.MiB, 4
    free = dict(nvlink=1e30, pcie=1e30, host_memory=1e30, efa=1e30, gamma=1e30, latency=0.0, piece=s)
    only_pcie = dataclasses.replace(inst, **{**free, "pcie": inst.pcie})
    host, _ = nm.host_path(only_pcie, n, s)
    gpu, _ = nm.gpu_step(only_pcie, n, s)
    one_way = inst.gpus_per_switch * s / inst.pcie
    assert host == pytest.approx(one_way + 2 * one_way)  # the slower stage, and the fill through both
    assert gpu == pytest.approx((one_way + 2 * one_way) / inst.gpus)
    only_net = dataclasses.replace(inst, **{**free, "efa": inst.efa})
    want = 2 * (n - 1) / n * s / inst.efa
    assert nm.host_path(only_net, n, s)[0] == pytest.approx(2 * want)
    assert nm.gpu_step(only_net, n, s)[0] == pytest.approx(2 * want)
    only_cpu = dataclasses.replace(inst, **{**free, "gamma": inst.gamma})
    t_g = inst.threads * inst.gamma
    assert nm.host_path(only_cpu, n, s)[0] == pytest.approx(2 * (inst.gpus + 1) * s / t_g)
    assert nm.gpu_step(only_cpu, n, s)[0] == pytest.approx(2 * s / t_g)


def test_a_ring_moves_more_through_each_node_than_two_steps():
    """NCCL's ring over N G GPUs sends 2 (NG-1)/(NG) S through each node's NICs; smddp 2 (N-1)/N S."""
    inst = dataclasses.replace(nm.P4D, nvlink=1e30, latency=0.0, ring_step=0.0)
    s = 100 * nm.MiB
    for n in nm.NODES:
        w = n * inst.gpus
        assert nm.nccl_ring(inst, n, s)[0] == pytest.approx(2 * (w - 1) / w * s / inst.efa)
        assert nm.nccl_ring(inst, n, s)[0] > 2 * (n - 1) / n * s / inst.efa


def test_the_tables_and_the_lent_check_print():
    """Every instance, model size and node count, and the check against the committed GPU run."""
    out = subprocess.run(
        [sys.executable, "-m", "smddp_rigs.bench", "node-model"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for c in nm.INSTANCES:
        for label, _s in nm.MODELS:
            assert f"**{c.name}, {label}**" in out.stdout
    assert out.stdout.count("\n| 64 |") == len(nm.INSTANCES) * len(nm.MODELS)
    assert "Lent GPU: NVIDIA H200" in out.stdout and "| 4 | 64 MiB | 14.59 |" in out.stdout
