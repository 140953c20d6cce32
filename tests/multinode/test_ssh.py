"""Multi-node jobs through a real sshd on every node and mpirun's own ssh launcher (no launch agent)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from smddp_rigs.simcluster import ClusterConfig, SimCluster, cleanup_stale
from smddp_rigs.sshd import SshNodes

from tests.conftest import BIN, REPO, job_env, need_programs, need_root, processes_in_nodes

pytestmark = pytest.mark.multinode

PREFIX = "smddph"
CHECK = str(REPO / "tests" / "multiprocess" / "check_collectives.py")
NODES = 4
#: A job that cannot start on a host ends within this (ssh is refused at once; mpirun, the probe).
FAIL_BOUND_S = 60.0


@pytest.fixture(scope="module")
def ssh_cluster() -> Iterator[tuple[SimCluster, SshNodes]]:
    need_root("multi-node tests")
    need_programs("sshd", "ssh", "ssh-keygen", install="openssh-server openssh-client")
    cleanup_stale(PREFIX)
    cluster = SimCluster(ClusterConfig(nodes=NODES, prefix=PREFIX, subnet="10.77.6", uplink=True))
    try:
        cluster.up()
        with SshNodes(cluster) as ssh:
            yield cluster, ssh
    finally:
        cluster.down()
        cleanup_stale(PREFIX)


def activated_env(ssh: SshNodes, **extra: str) -> dict[str, str]:
    """The environment of a user who activated the virtual environment and runs smddp-launch: its bin
    first on PATH, VIRTUAL_ENV set, and mpirun's ssh given this run's ssh_config (keys, known hosts)."""
    env = job_env(**ssh.ssh_env(), **extra)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(BIN.parent)
    return env


def launch(cluster: SimCluster, env: dict[str, str], args: list[str], timeout: float = 300):
    """smddp-launch -H over the nodes, no launch agent: mpirun starts prted on each through ssh."""
    cmd = [str(BIN / "smddp-launch"), "-H", cluster.host_list(1), "--iface", cluster.config.cidr, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def left_on_nodes(cluster: SimCluster, ssh: SshNodes) -> list[str]:
    """Processes in the nodes other than their listening sshd: what a job or a login left running."""
    return processes_in_nodes([cluster.netns(i) for i in range(NODES)], cluster.hosts(), ssh.server_pids())


def assert_nothing_left(cluster: SimCluster, ssh: SshNodes) -> None:
    deadline = time.monotonic() + 10
    while (left := left_on_nodes(cluster, ssh)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left running: {left}"


def test_remote_login_shell_lacks_the_environment(ssh_cluster):
    """The premise: a login on a node does not find this virtual environment's python."""
    cluster, ssh = ssh_cluster
    p = subprocess.run(
        ssh.ssh_argv(1, "hostname; command -v python || true"), capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 0, p.stderr
    name, *python = p.stdout.split()
    assert name == cluster.hosts()[1]
    assert python != [str(BIN / "python")], (
        "the login shell already has the venv: the test would prove nothing"
    )


def test_collectives_over_ssh(ssh_cluster, tmp_path, clean_host):
    """A subset of the collective matrix across 4 nodes, bit-exact, with a bare `python` that only the
    forwarded PATH makes the virtual environment's; user variables go where --forward-env says."""
    cluster, ssh = ssh_cluster
    env = activated_env(ssh, SMDDP_CHECK_FORWARDED="smddp", CHECK_USER_VAR="mine")
    args = ["--forward-env", "CHECK_USER_*", "--", "python", CHECK, "--out", str(tmp_path)]
    args += ["--nnodes", str(NODES), "--dtypes", "int64,bfloat16,float32", "--inflight", "16"]
    proc = launch(cluster, env, args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NODES)]
    assert [p["host"] for p in per_rank] == cluster.hosts()
    for p in per_rank:
        assert p["executable"] == str(BIN / "python")
        assert p["env"] == {
            "VIRTUAL_ENV": str(BIN.parent),
            "SMDDP_CHECK_FORWARDED": "smddp",
            "CHECK_USER_VAR": "mine",
        }
    assert [d["tcp_host"] for d in per_rank[0]["daemons"]] == [cluster.addr(i) for i in range(NODES)]
    bad = [(r, rec) for r, p in enumerate(per_rank) for rec in p["records"] if not rec["ok"]]
    assert not bad, f"{len(bad)} results differ from the reference, first: {bad[:3]}"
    for i in range(len(per_rank[0]["records"])):
        recs = [p["records"][i] for p in per_rank]
        if recs[0]["case"]["kind"] != "reduce_scatter":
            assert len({rec["digest"] for rec in recs}) == 1, f"ranks disagree on {recs[0]['case']}"
    assert_nothing_left(cluster, ssh)


@pytest.mark.parametrize("fault", ["sshd_down", "key_refused"])
def test_unreachable_host_is_named(ssh_cluster, fault, clean_host):
    """A node whose sshd is down, or refuses the key: the job fails within a bound, naming the host
    and why, and nothing is left running on any node."""
    cluster, ssh = ssh_cluster
    bad = 2
    if fault == "sshd_down":
        ssh.stop_node(bad)
        why = "Connection refused"
    else:
        ssh.revoke_key(bad)
        why = "Permission denied (publickey)"
    try:
        t0 = time.monotonic()
        proc = launch(cluster, activated_env(ssh), ["--", "python", str(REPO / "examples" / "mlp_numpy.py")])
        took = time.monotonic() - t0
    finally:
        ssh.restore_node(bad)
    assert proc.returncode != 0
    assert took < FAIL_BOUND_S, took
    host = cluster.hosts()[bad]
    # smddp-launch's own line names the host and ssh's reason (mpirun's says only "failed to report back").
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("smddp-launch:")]
    assert any(host in ln and why in ln for ln in lines), proc.stderr[-3000:]
    assert not any(h in ln for ln in lines for h in cluster.hosts() if h != host), lines
    assert_nothing_left(cluster, ssh)
