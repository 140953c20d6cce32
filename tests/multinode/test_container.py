"""deploy/docker/entrypoint.sh for real: `sshd` mode in every simulated node as each worker pod runs it,
`launch` mode in another as the MPIJob launcher pod does: the MPI Operator's path without Kubernetes."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from smddp_rigs.container import ContainerNodes
from smddp_rigs.simcluster import ClusterConfig, SimCluster, cleanup_stale

from tests.conftest import BIN, REPO, job_env, need_programs, need_root, processes_in_nodes

pytestmark = pytest.mark.multinode

PREFIX = "smddpk"
CHECK = str(REPO / "tests" / "multiprocess" / "check_collectives.py")
WORKERS, SLOTS = 3, 2  # worker pods 1..3 (the hostfile's), launcher pod 0


def _host_ssh_state() -> dict[str, str]:
    """The host's own /etc/ssh, which no container may change."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path("/etc/ssh").glob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def pods() -> Iterator[tuple[SimCluster, ContainerNodes]]:
    need_root("multi-node tests")
    need_programs("sshd", "ssh", "ssh-keygen", install="openssh-server openssh-client")
    cleanup_stale(PREFIX)
    cluster = SimCluster(ClusterConfig(nodes=WORKERS + 1, prefix=PREFIX, subnet="10.77.8"))
    try:
        cluster.up()
        with ContainerNodes(cluster, REPO / "deploy", BIN.parent) as ctr:
            yield cluster, ctr
    finally:
        cluster.down()
        cleanup_stale(PREFIX)


def test_launcher_pod_runs_a_job_across_the_worker_pods(pods, tmp_path, clean_host):
    cluster, ctr = pods
    before = _host_ssh_state()
    hostfile = tmp_path / "hostfile"  # as the MPI Operator writes /etc/mpi/hostfile
    hostfile.write_text("".join(f"{h} slots={SLOTS}\n" for h in cluster.hosts()[1:]))
    job = job_env()["SMDDP_JOB_ID"]  # (registered for the leftover check)
    args = ["launch", "--", "python", CHECK, "--out", str(tmp_path), "--nnodes", str(WORKERS)]
    args += ["--dtypes", "uint8,float16,float64", "--inflight", "16"]
    t0 = time.monotonic()
    proc = ctr.run(0, args, timeout=300, SMDDP_JOB_ID=job, SMDDP_HOSTFILE=str(hostfile))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"job through the entrypoint: {time.monotonic() - t0:.1f} s")
    world = WORKERS * SLOTS
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    # Ranks in hostfile order, SLOTS per worker pod; the launcher pod runs none.
    assert [p["host"] for p in per_rank] == [h for h in cluster.hosts()[1:] for _ in range(SLOTS)]
    assert [d["host"] for d in per_rank[0]["daemons"]] == cluster.hosts()[1:]
    # SMDDP_IFACE's default, eth0: the pods' network.
    assert [d["tcp_host"] for d in per_rank[0]["daemons"]] == [cluster.addr(i) for i in range(1, WORKERS + 1)]
    bad = [(r, rec) for r, p in enumerate(per_rank) for rec in p["records"] if not rec["ok"]]
    assert not bad, f"{len(bad)} results differ from the reference, first: {bad[:3]}"
    # Each pod made its own host keys at start, and the host's /etc/ssh is untouched.
    keys = {(ctr.dir / f"etc-ssh-{i}" / "ssh_host_ed25519_key.pub").read_text() for i in range(WORKERS + 1)}
    assert len(keys) == WORKERS + 1
    assert _host_ssh_state() == before
    # Nothing but each pod's sshd is left in the pods.
    deadline = time.monotonic() + 10
    namespaces = [cluster.netns(i) for i in range(WORKERS + 1)]
    while (
        left := processes_in_nodes(namespaces, cluster.hosts(), ctr.server_pids())
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
