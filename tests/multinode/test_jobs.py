"""smddp jobs across simulated nodes (network namespaces): every collective bit-exact, and real links."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from smddp_rigs.simcluster import ClusterConfig, SimCluster, cleanup_stale

from tests.conftest import BIN, REPO, job_env, need_root

pytestmark = pytest.mark.multinode

PREFIX = "smddpj"
SUBNET = "10.77.1"
CIDR = f"{SUBNET}.0/24"
CHECK = str(REPO / "tests" / "multiprocess" / "check_collectives.py")
BANDWIDTH = str(Path(__file__).parent / "check_bandwidth.py")


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[int, SimCluster]]:
    """One unshaped cluster per node count, built on first use and always torn down."""
    need_root("multi-node tests")
    cleanup_stale(PREFIX)
    made: dict[int, SimCluster] = {}
    try:
        yield made
    finally:
        for c in made.values():
            c.down()
        cleanup_stale(PREFIX)


def _cluster(clusters: dict[int, SimCluster], nodes: int) -> SimCluster:
    if nodes not in clusters:
        for c in clusters.values():  # one at a time: they share the prefix
            c.down()
        clusters.clear()
        clusters[nodes] = SimCluster(
            ClusterConfig(nodes=nodes, prefix=PREFIX, subnet=SUBNET, uplink=True)
        ).up()
    return clusters[nodes]


def launch(
    cluster: SimCluster, per_node: int, args: list[str], timeout: float = 300, extra: list[str] | None = None
) -> subprocess.CompletedProcess:
    cmd = [
        str(BIN / "smddp-launch"),
        *("-H", cluster.host_list(per_node)),
        *("--iface", cluster.config.cidr),
        *("--launch-agent", cluster.launch_agent_path()),
        *(extra or []),
        *("--", sys.executable, *args),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=job_env())


OFI = ["--fabric", "ofi", "--ofi-provider", "tcp"]
CASES = [(2, 1, []), (2, 2, []), (4, 1, []), (4, 2, []), (2, 2, OFI), (4, 1, OFI), (4, 2, OFI)]
# CI runs 2x1, 4x1 and 4x2 over TCP and 4x2 over libfabric; 2x2 (on both fabrics) and 4x1 over
# libfabric are `long`.
LONG = {(2, 2, False), (2, 2, True), (4, 1, True)}


@pytest.mark.parametrize(
    ("nodes", "per_node", "fabric"),
    [
        pytest.param(
            n,
            g,
            f,
            id=f"{n}x{g}{'-ofi' if f else ''}",
            marks=[pytest.mark.long] if (n, g, bool(f)) in LONG else [],
        )
        for n, g, f in CASES
    ],
)
def test_every_collective_across_nodes(clusters, nodes, per_node, fabric, tmp_path):
    """Every collective bit-exact across simulated nodes, over TCP sockets and over libfabric's tcp
    provider (--fabric ofi: each daemon's endpoint on its own namespace's interface)."""
    cluster = _cluster(clusters, nodes)
    world = nodes * per_node
    # (The 64 MiB cases stay in tests/multiprocess: here 8 workers would each rebuild 8 such inputs
    # for the reference; the bandwidth test below moves 64 MiB across 4 nodes.)
    args = [CHECK, "--out", str(tmp_path), "--nnodes", str(nodes)]
    proc = launch(cluster, per_node, args, timeout=600, extra=fabric)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    # The daemons listen on their own node's address on the chosen network, nowhere else.
    daemons = per_rank[0]["daemons"]
    assert [d["tcp_host"] for d in daemons] == [cluster.addr(i) for i in range(nodes)]
    assert [d["host"] for d in daemons] == cluster.hosts()
    records = [p["records"] for p in per_rank]
    bad = [(r, rec) for r, recs in enumerate(records) for rec in recs if not rec["ok"]]
    assert not bad, f"{len(bad)} results differ from the reference, first: {bad[:3]}"
    for i in range(len(records[0])):
        recs = [records[r][i] for r in range(world)]
        if recs[0]["case"]["kind"] != "reduce_scatter":
            assert len({rec["digest"] for rec in recs}) == 1, f"ranks disagree on {recs[0]['case']}"


def test_shaped_links_bound_a_64mib_allreduce(tmp_path):
    """4 nodes at 1 Gbit/s: the all-reduce cannot beat 2 (N-1)/N * S / rate, so its data crossed the links.
    Timed from the first rank's start to the last rank's end (check_bandwidth.py): rank 0's own time
    was up to its lateness out of the barrier shorter, and once came 2% under the bound (CI, 7050cad)."""
    need_root("multi-node tests")
    cleanup_stale(PREFIX + "b")
    nodes, rate_mbit, mib = 4, 1000, 64
    cfg = ClusterConfig(nodes=nodes, rate_mbit=rate_mbit, prefix=PREFIX + "b", subnet="10.77.2", uplink=True)
    out = tmp_path / "bw.json"
    with SimCluster(cfg) as cluster:
        proc = launch(cluster, 1, [BANDWIDTH, "--out", str(out), "--mib", str(mib)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["size"] == nodes
    size = mib * (1 << 20)
    bound = 2 * (nodes - 1) / nodes * size * 8 / (rate_mbit * 1e6)
    burst = 256 * 1024 * 8 / (rate_mbit * 1e6)  # tbf lets one burst through at line speed
    fastest = min(result["times"])
    print(
        f"64 MiB over {nodes} nodes at {rate_mbit} Mbit/s: median {statistics.median(result['times']):.3f} s, "
        f"bound {bound:.3f} s"
    )
    assert fastest >= bound - burst, (fastest, bound)
