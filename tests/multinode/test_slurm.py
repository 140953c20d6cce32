"""deploy/slurm for real: munged, slurmctld and a slurmd per simulated node; sbatch smddp.sbatch, polled with
squeue and scontrol, over ssh and over the srun agent; scancel in the middle of a job."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from smddp_rigs.simcluster import ClusterConfig, SimCluster, cleanup_stale
from smddp_rigs.slurm import SlurmCluster
from smddp_rigs.sshd import SshNodes

from tests.conftest import BIN, REPO, job_env, need_programs, need_root, processes_in_nodes

pytestmark = pytest.mark.multinode

PREFIX = "smddpu"
NODES, PER_NODE = 4, 2
SBATCH = str(REPO / "deploy" / "slurm" / "smddp.sbatch")
SRUN_AGENT = str(REPO / "deploy" / "slurm" / "srun-agent")
CHECK = str(REPO / "tests" / "multiprocess" / "check_collectives.py")
OBS_WORKER = str(REPO / "tests" / "observability" / "obs_worker.py")


@dataclass
class Site:
    cluster: SimCluster
    ssh: SshNodes
    slurm: SlurmCluster


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    need_root("multi-node tests")
    need_programs(
        "munged",
        "slurmctld",
        "slurmd",
        "sbatch",
        "sshd",
        install="munge slurmctld slurmd slurm-client openssh-server",
    )
    cleanup_stale(PREFIX)
    cluster = SimCluster(ClusterConfig(nodes=NODES, prefix=PREFIX, subnet="10.77.9"))
    try:
        cluster.up()
        with SshNodes(cluster) as ssh, SlurmCluster(cluster) as slurm:
            yield Site(cluster, ssh, slurm)
    finally:
        cluster.down()
        cleanup_stale(PREFIX)


def submit(site: Site, workdir: Path, command: list[str], **env: str) -> str:
    """sbatch smddp.sbatch from the login node (node 0), sized by sbatch's own options as the recipe says."""
    e = job_env(SMDDP_VENV=str(BIN.parent), **env)
    p = site.slurm.run(
        [
            "sbatch",
            "--parsable",
            f"--nodes={NODES}",
            f"--ntasks-per-node={PER_NODE}",
            "--gpus-per-node=0",
            SBATCH,
            *command,
        ],
        cwd=workdir,
        **{k: e[k] for k in ("SMDDP_JOB_ID", "SMDDP_VENV", *env)},
    )
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().split(";")[0]


def wait_done(site: Site, job: str, timeout: float = 240) -> dict[str, str]:
    """Poll squeue until the job has left the queue, then its final record (scontrol show job)."""
    deadline = time.monotonic() + timeout
    while site.slurm.run(["squeue", "--noheader", "--jobs", job]).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued after {timeout:g}s"
        time.sleep(0.5)
    return site.slurm.job_state(job)


def processes_on_nodes(site: Site) -> list[str]:
    """Every process in the nodes but the servers the rigs started (sshd, slurmctld, slurmd)."""
    namespaces = [site.cluster.netns(i) for i in range(NODES)]
    return processes_in_nodes(
        namespaces, site.cluster.hosts(), site.ssh.server_pids() | site.slurm.daemon_pids()
    )


def assert_nothing_left(site: Site, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while (left := processes_on_nodes(site)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left running: {left}"


def check_results(site: Site, out: Path) -> None:
    world = NODES * PER_NODE
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    # The right ranks on the right nodes: PER_NODE consecutive ranks per node, in allocation order.
    assert [p["host"] for p in per_rank] == [h for h in site.cluster.hosts() for _ in range(PER_NODE)]
    assert [d["tcp_host"] for d in per_rank[0]["daemons"]] == [site.cluster.addr(i) for i in range(NODES)]
    bad = [(r, rec) for r, p in enumerate(per_rank) for rec in p["records"] if not rec["ok"]]
    assert not bad, f"{len(bad)} results differ from the reference, first: {bad[:3]}"


# CI: mpirun's own Slurm launcher and smddp's srun agent; ssh between the nodes (Open MPI's plm,
# which tests/multinode/test_ssh.py runs outside Slurm) is `long`.
@pytest.mark.parametrize("agent", ["srun", "srun-agent", pytest.param("ssh", marks=pytest.mark.long)])
def test_sbatch_the_recipe(site, agent, tmp_path, clean_host):
    """smddp.sbatch as docs/deploy.md says to submit it: mpirun's own Slurm launcher (srun, the
    default), the srun agent, or ssh between the nodes (SMDDP_MPI_ARGS="--prtemca plm ssh")."""
    env = {
        "srun": {},
        "srun-agent": {"SMDDP_LAUNCH_AGENT": SRUN_AGENT},
        "ssh": {"PRTE_MCA_plm_ssh_args": f"-F {site.ssh.ssh_config}", "SMDDP_MPI_ARGS": "--prtemca plm ssh"},
    }[agent]
    dtypes = {"srun": "int32,float16,float32", "srun-agent": "bfloat16,float64", "ssh": "uint8,int64"}[agent]
    command = [
        "python",
        CHECK,
        "--out",
        str(tmp_path),
        "--nnodes",
        str(NODES),
        "--dtypes",
        dtypes,
        "--inflight",
        "16",
    ]
    job = submit(site, tmp_path, command, **env)
    rec = wait_done(site, job)
    output = (tmp_path / f"smddp-{job}.out").read_text(errors="replace")
    assert rec.get("JobState") == "COMPLETED" and rec.get("ExitCode") == "0:0", (rec, output[-3000:])
    assert rec["NodeList"] == f"{PREFIX}-n[0-{NODES - 1}]" and rec["BatchHost"] == f"{PREFIX}-n0"
    hosts = " ".join(site.cluster.hosts())
    assert f"smddp.sbatch: job {job}: {NODES} nodes ({hosts}), {PER_NODE} workers per node" in output, output
    # The recipe's own choice of network: the route from the first node to the next.
    assert f"smddp.sbatch: network for smddp: {site.cluster.config.cidr}" in output, output
    assert (
        f"JobId={job} " in site.slurm.completion_log() and "JobState=COMPLETED" in site.slurm.completion_log()
    )
    check_results(site, tmp_path)
    assert_nothing_left(site)


def test_scancel_ends_every_rank_and_daemon(site, tmp_path, clean_host):
    env = {"SMDDP_LAUNCH_AGENT": SRUN_AGENT}
    job = submit(site, tmp_path, ["python", OBS_WORKER, "--iterations", "1000000", "--pause", "0.01"], **env)
    site.slurm.wait_for(job, {"RUNNING"}, timeout=60)
    # Running for real: a daemon and its workers on every node.
    deadline = time.monotonic() + 60
    while True:
        procs = processes_on_nodes(site)
        nodes_with_daemon = {p.split(":")[0] for p in procs if "smddp-daemon" in p}
        if (
            len(nodes_with_daemon) == NODES
            and sum("obs_worker.py" in p and "worker_env" not in p for p in procs) >= NODES * PER_NODE
        ):
            break
        assert time.monotonic() < deadline, procs
        time.sleep(0.3)
    p = site.slurm.run(["scancel", job])
    assert p.returncode == 0, p.stderr
    rec = wait_done(site, job, timeout=60)
    assert rec.get("JobState") == "CANCELLED", rec
    assert_nothing_left(site, within=30)
