"""Soak: thousands of random collectives over 4 simulated nodes while a stranger keeps knocking.

CI runs the short form; the full form is `SMDDP_SOAK_COLLECTIVES=10000 pytest -s tests/faults/test_soak.py`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from smddp_rigs.simcluster import ClusterConfig, SimCluster, cleanup_stale

from tests.conftest import BIN, REPO, job_env

pytestmark = pytest.mark.faults

WORKER = str(Path(__file__).parent / "soak_worker.py")
COLLECTIVES = int(os.environ.get("SMDDP_SOAK_COLLECTIVES", "1500"))
NODES = 4
# The daemon may keep what its arenas grew to, but must not grow with the number of collectives.
RSS_GROWTH_BOUND_KIB = 32 * 1024


def knock(out: Path, stop: threading.Event, counter: list[int]) -> None:
    """A stranger that keeps connecting to every daemon's port and sending garbage."""
    path = out / "endpoints.json"
    while not path.exists():
        if stop.wait(0.1):
            return
    endpoints = json.loads(path.read_text())
    while not stop.is_set():
        for host, port in endpoints:
            try:
                with socket.create_connection((host, port), timeout=2) as s:
                    s.sendall(os.urandom(64))
                    s.settimeout(2)
                    while s.recv(4096):
                        pass
                counter[0] += 1
            except OSError:
                pass  # refused or reset: also fine
        stop.wait(0.05)


def test_soak_random_collectives_with_a_stranger(tmp_path):
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the soak runs on simulated nodes (root) and must not skip in CI")
        pytest.skip("needs root")
    prefix = "smddps"
    cleanup_stale(prefix)
    cfg = ClusterConfig(nodes=NODES, prefix=prefix, subnet="10.77.4", uplink=True)
    t0 = time.monotonic()
    with SimCluster(cfg) as cluster:
        cmd = [
            str(BIN / "smddp-launch"),
            *("-H", cluster.host_list(1)),
            *("--iface", cfg.cidr),
            *("--launch-agent", cluster.launch_agent_path()),
            *("--", sys.executable, WORKER, "--out", str(tmp_path), "--collectives", str(COLLECTIVES)),
            *("--nnodes", str(NODES)),
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=job_env()
        )
        stop = threading.Event()
        knocks = [0]
        stranger = threading.Thread(target=knock, args=(tmp_path, stop, knocks))
        stranger.start()
        try:
            output = proc.communicate(timeout=1500)[0]
        finally:
            stop.set()
            stranger.join()
    took = time.monotonic() - t0
    assert proc.returncode == 0, output[-3000:]
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NODES)]
    for rec in recs:
        assert rec["done"] == COLLECTIVES and not rec["wrong"], rec["wrong"][:3]
        growth = rec["rss"]["end_kib"] - rec["rss"]["start_kib"]
        print(f"node {rec['node']}: daemon RSS {rec['rss']['start_kib']} -> {rec['rss']['end_kib']} KiB")
        assert growth <= RSS_GROWTH_BOUND_KIB, rec["rss"]
    print(f"{COLLECTIVES} collectives on {NODES} nodes in {took:.0f}s, {knocks[0]} stranger connections")
    assert "refused connection" in output
