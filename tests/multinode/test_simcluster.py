"""SimCluster: namespaces reach each other and nothing else, shaping holds, real mpirun spans nodes, teardown is complete."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from smddp_rigs.simcluster import (
    ClusterConfig,
    SimCluster,
    SimClusterError,
    cleanup_stale,
    list_netns,
    list_root_links,
)

from tests.conftest import BIN, REPO, need_root
from tests.multinode.netcheck import bulk_tcp

# Not the CLI's default prefix "smddp", so that the tests never touch a cluster someone brought up by hand.
PREFIX = "smddpt"
PY = sys.executable


def leftovers() -> list[str]:
    """Namespaces and root links of ours, from `ip netns list` and `ip link`."""
    ns = [n for n in list_netns() if n.startswith(f"{PREFIX}-")]
    return ns + [link for link in list_root_links() if link.startswith(f"{PREFIX}-")]


@pytest.fixture(scope="module", autouse=True)
def clean_slate():
    """Starts from nothing (a crashed earlier run may have left namespaces) and leaves nothing."""
    need_root("tests/multinode")
    cleanup_stale(PREFIX)
    yield
    cleanup_stale(PREFIX)


@pytest.fixture(autouse=True)
def nothing_left():
    """Every test's clusters must be gone when it ends, pass or fail; cleans up and fails if not."""
    yield
    left = leftovers()
    if left:
        cleanup_stale(PREFIX)
        pytest.fail(f"left behind: {left}")


# A server that answers every connection with "<its host name> <the peer's address>".
SERVER = r"""
import socket, sys
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
srv = socket.create_server((host, port))
srv.settimeout(30)
for _ in range(count):
    conn, peer = srv.accept()
    with conn:
        conn.sendall(f"{socket.gethostname()} {peer[0]}".encode())
"""

# Connects to each NAME:PORT (names resolve through the node's hosts file), retrying while servers start.
CLIENT = r"""
import json, socket, sys, time
port, out = int(sys.argv[1]), {}
for name in sys.argv[2:]:
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection((name, port), timeout=5) as s:
                out[name] = s.recv(200).decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
print(json.dumps({"me": socket.gethostname(), "replies": out}))
"""


@pytest.mark.parametrize("nodes", [2, 4])
def test_every_node_reaches_every_other_and_root_reaches_none(nodes):
    root_links_before = set(list_root_links())
    port = 7300 + nodes
    with SimCluster(ClusterConfig(nodes=nodes, prefix=PREFIX)) as c:
        assert c.hosts() == [f"{PREFIX}-n{i}" for i in range(nodes)]
        assert [c.addr(i) for i in range(nodes)] == [f"10.77.0.{10 + i}" for i in range(nodes)]
        servers = [
            c.popen(
                i, [PY, "-c", SERVER, c.addr(i), str(port), str(nodes - 1)], stderr=subprocess.PIPE, text=True
            )
            for i in range(nodes)
        ]
        try:
            for i in range(nodes):
                peers = [h for j, h in enumerate(c.hosts()) if j != i]
                res = c.exec(
                    i, [PY, "-c", CLIENT, str(port), *peers], capture_output=True, text=True, timeout=60
                )
                assert res.returncode == 0, res.stderr
                out = json.loads(res.stdout)
                assert out["me"] == c.hosts()[i]
                # The server names itself (so it ran on that node) and saw node i's address (so the
                # connection crossed the bridge rather than loopback).
                assert out["replies"] == {h: f"{h} {c.addr(i)}" for h in peers}
            for s in servers:
                _, err = s.communicate(timeout=30)
                assert s.returncode == 0, err
        finally:
            for s in servers:
                if s.poll() is None:
                    s.kill()
                    s.wait(timeout=10)

        # The root namespace cannot reach the nodes. Shown structurally rather than by sending a
        # packet, because a packet to 10.77.0.x from here would leave over the host's default route
        # into the real network: the cluster added no root interface, no root interface has an
        # address in the subnet or a peer in another namespace, and the kernel's route for a node
        # address is not one of ours.
        assert set(list_root_links()) == root_links_before
        addrs = json.loads(
            subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=15).stdout
        )
        for link in addrs:
            assert "link_netnsid" not in link, link["ifname"]
            for a in link.get("addr_info", []):
                assert not a["local"].startswith("10.77.0."), (link["ifname"], a["local"])
        for i in range(nodes):
            route = subprocess.run(
                ["ip", "-j", "route", "get", c.addr(i)], capture_output=True, text=True, timeout=15
            )
            if route.returncode == 0:  # "Network is unreachable" is an even clearer no
                assert json.loads(route.stdout)[0].get("dev") in root_links_before


@pytest.mark.parametrize("rate_mbit", [None, 100.0])
def test_rate_limit_bounds_transfer_time(rate_mbit):
    size = 20_000_000
    burst = 256 * 1024  # tc's "256kb" is KiB; the bucket starts full, so that much goes out free
    bound_s = (size - burst) * 8 / (100.0 * 1e6)  # 1.58 s at 100 Mbit/s
    with SimCluster(ClusterConfig(nodes=2, rate_mbit=rate_mbit, prefix=PREFIX)) as c:
        qdisc = c.exec(0, ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
        assert ("tbf" in qdisc and "rate 100Mbit" in qdisc) == (rate_mbit is not None), qdisc
        sent, got = bulk_tcp(c, 0, 1, size, port=7400)
    # The sender's clock stops at the receiver's digest of every byte.
    assert got["bytes"] == size and sent["ack"] == got["sha256"] == sent["sha256"]
    if rate_mbit is None:
        # Unshaped veths move 20 MB in tens of ms: the shaped case's time is the tbf's doing.
        assert sent["seconds"] < bound_s / 3, sent
    else:
        assert sent["seconds"] >= 0.95 * bound_s, sent
        assert sent["seconds"] < 10 * bound_s, sent  # shaped, not stalled


# Each rank reports where it ran and checks two allreduces; the array one is big enough to show up
# in the nodes' interface counters.
MPI_PROG = r"""
import json, os, socket, subprocess, sys
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
ns = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True, text=True, timeout=10)
total = comm.allreduce(comm.rank + 1)
buf = np.full(1 << 20, comm.rank + 1, dtype=np.float64)  # 8 MB
out = np.empty_like(buf)
comm.Allreduce(buf, out, op=MPI.SUM)
host = socket.gethostname()
info = {
    "rank": comm.rank,
    "size": comm.size,
    "netns": ns.stdout.strip(),
    "hostname": host,
    "processor": MPI.Get_processor_name(),
    "addr": socket.gethostbyname(host),
    "sum": total,
    "array_ok": bool((out == comm.size * (comm.size + 1) / 2).all()),
}
with open(os.path.join(sys.argv[1], f"rank{comm.rank}.json"), "w") as f:
    json.dump(info, f)
"""


def _tx_bytes(c: SimCluster, i: int) -> int:
    res = c.exec(i, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"], capture_output=True, text=True)
    return int(res.stdout)


# routed_radix 1 makes PRRTE's launch tree a chain: each node's prted runs the agent for the next.
@pytest.mark.parametrize(
    ("nodes", "per_node", "extra"), [(2, 2, []), (4, 1, []), (4, 1, ["--prtemca", "routed_radix", "1"])]
)
def test_real_mpirun_spans_namespaces(nodes, per_node, extra, tmp_path):
    world = nodes * per_node
    prog = tmp_path / "prog.py"
    prog.write_text(MPI_PROG)
    # uplink: every prted calls back to mpirun's listener in the root namespace (see the module's notes).
    with SimCluster(ClusterConfig(nodes=nodes, prefix=PREFIX, uplink=True)) as c:
        tx_before = [_tx_bytes(c, i) for i in range(nodes)]
        cmd = [str(BIN / "mpirun")]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd += ["-np", str(world), "-H", c.host_list(per_node), "--bind-to", "none", *c.mpirun_args(), *extra]
        # ob1 over TCP between nodes (shared memory within one), so the ranks' traffic is the bridge's.
        cmd += ["--mca", "pml", "ob1", "--mca", "btl", "tcp,sm,self"]
        cmd += [PY, str(prog), str(tmp_path)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
        elapsed = time.monotonic() - t0
        assert proc.returncode == 0, f"{elapsed:.1f}s\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        tx_after = [_tx_bytes(c, i) for i in range(nodes)]
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
        expected = {c.hosts()[i]: c.addr(i) for i in range(nodes)}

    for r in ranks:
        assert r["size"] == world
        assert r["sum"] == world * (world + 1) // 2
        assert r["array_ok"], r
        # The namespace the kernel says the rank ran in, its host name and its address all agree.
        assert r["netns"] == r["hostname"] == r["processor"], r
        assert r["addr"] == expected[r["netns"]], r
    # Ranks really ran on different nodes: per_node on each, by mpirun's by-slot placement in -H order.
    by_node = [r["netns"] for r in sorted(ranks, key=lambda r: r["rank"])]
    assert by_node == [h for h in expected for _ in range(per_node)]
    # And the 8 MB allreduce crossed the bridge: every node sent megabytes out of its eth0.
    for i in range(nodes):
        assert tx_after[i] - tx_before[i] > 2_000_000, (i, tx_before, tx_after)


def test_exception_inside_with_leaves_nothing_behind():
    cfg = ClusterConfig(nodes=3, rate_mbit=50, prefix=PREFIX, uplink=True)
    with pytest.raises(RuntimeError, match="boom"), SimCluster(cfg) as c:
        workdir = c.workdir
        # A process still running on a node must not keep its namespace (and veths) alive.
        c.popen(1, ["sleep", "300"])
        assert sorted(leftovers()) == sorted([f"{PREFIX}-up", f"{PREFIX}-sw", *c.hosts()])
        raise RuntimeError("boom")
    assert leftovers() == []
    assert not workdir.exists()
    c.down()  # idempotent
    assert leftovers() == []


def test_failed_up_removes_what_it_built():
    # tc rejects the burst after the namespaces and veths exist: up() must remove them and raise.
    cluster = SimCluster(ClusterConfig(nodes=2, rate_mbit=100, burst="12qq", prefix=PREFIX, uplink=True))
    with pytest.raises(SimClusterError, match="tc"):
        cluster.up()
    assert leftovers() == []


def test_up_refuses_names_in_use_and_keeps_the_other_cluster():
    with SimCluster(ClusterConfig(nodes=2, prefix=PREFIX)) as a:
        with pytest.raises(SimClusterError, match="already in use"):
            SimCluster(ClusterConfig(nodes=3, prefix=PREFIX)).up()
        res = a.exec(0, ["hostname"], capture_output=True, text=True)
        assert res.stdout.strip() == a.hosts()[0]
        assert set(a.hosts()) <= set(list_netns())


def test_cleanup_stale_removes_a_forgotten_cluster():
    c = SimCluster(ClusterConfig(nodes=2, prefix=PREFIX, uplink=True))
    c.up()
    c.popen(0, ["sleep", "300"])
    workdir = c.workdir
    del c  # as if the process that built it had crashed
    try:
        removed = cleanup_stale(PREFIX)
        assert set(removed) == {f"{PREFIX}-up", f"{PREFIX}-sw", f"{PREFIX}-n0", f"{PREFIX}-n1"}
        assert leftovers() == []
    finally:
        cleanup_stale(PREFIX)
        shutil.rmtree(workdir, ignore_errors=True)


def test_agent_parses_ssh_options_and_quotes_like_ssh():
    with SimCluster(ClusterConfig(nodes=2, prefix=PREFIX)) as c:
        agent = c.launch_agent_path()

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([agent, *args], capture_output=True, text=True, timeout=30)

        # ssh joins the command words with spaces and a shell parses the result: quotes inside the
        # words survive, and $(...) expands on the remote side.
        res = run(
            "-x",
            "-o",
            "BatchMode=yes",
            "-p22",
            "-T",
            "root@" + c.hosts()[1],
            'printf "%s|"',
            '"a  b"',
            "$(hostname)",
        )
        assert (res.returncode, res.stdout) == (0, f"a  b|{c.hosts()[1]}|"), res.stderr
        # By address, and name resolution on the node uses the cluster's hosts file.
        res = run(c.addr(0), "getent", "hosts", c.hosts()[1])
        assert res.returncode == 0 and res.stdout.split() == [c.addr(1), c.hosts()[1]], res.stderr
        res = run("-l", "root", c.hosts()[0], "exit 7")
        assert res.returncode == 7
        # From inside a node too, as a prted spawning the next level of PRRTE's launch tree would.
        res = c.exec(0, [agent, c.hosts()[1], "hostname"], capture_output=True, text=True)
        assert (res.returncode, res.stdout.strip()) == (0, c.hosts()[1]), res.stderr
        res = run("no-such-node", "true")
        assert res.returncode == 255 and "unknown host" in res.stderr


def test_cli_up_exec_down():
    base = [PY, "-m", "smddp_rigs.simcluster"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=60, cwd=REPO)

    try:
        up = cli("up", "--nodes", "2", "--rate-mbit", "10", "--uplink", "--prefix", PREFIX)
        assert up.returncode == 0, up.stderr
        assert f"{PREFIX}-n1\t10.77.0.11" in up.stdout
        again = cli("up", "--nodes", "2", "--prefix", PREFIX)
        assert again.returncode == 1 and "down" in again.stderr
        ex = cli(
            "exec", "--prefix", PREFIX, f"{PREFIX}-n1", "--", "sh", "-c", "hostname; tc qdisc show dev eth0"
        )
        assert ex.returncode == 0, ex.stderr
        assert ex.stdout.splitlines()[0] == f"{PREFIX}-n1" and "rate 10Mbit" in ex.stdout
        assert cli("exec", "--prefix", PREFIX, "10.77.0.10", "--", "sh", "-c", "exit 3").returncode == 3
        assert set(leftovers()) == {f"{PREFIX}-up", f"{PREFIX}-sw", f"{PREFIX}-n0", f"{PREFIX}-n1"}
        down = cli("down", "--prefix", PREFIX)
        assert down.returncode == 0, down.stderr
        assert leftovers() == []
        assert not Path(f"/run/smddp-simcluster/{PREFIX}.json").exists()
        assert not Path(f"/run/smddp-simcluster/{PREFIX}").exists()
        assert cli("down", "--prefix", PREFIX).returncode == 0  # idempotent
    finally:
        cli("down", "--prefix", PREFIX)
