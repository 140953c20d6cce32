"""Host lists, hostfiles, Slurm allocations, and choosing the address to listen on."""

from __future__ import annotations

import socket

import pytest

from smddp.errors import ConfigError
from smddp.launcher.hosts import (
    Host,
    expand_nodelist,
    expand_tasks_per_node,
    parse_host_list,
    parse_hostfile,
    slurm_hosts,
)
from smddp.transport.netif import interfaces, resolve_bind_address, service_port


def test_host_list():
    assert parse_host_list("a:2,b:2") == [Host("a", 2), Host("b", 2)]
    assert parse_host_list("a, b:3") == [Host("a", 1), Host("b", 3)]
    for bad in ("", "a:0", "a:x", "a,a"):
        with pytest.raises(ConfigError):
            parse_host_list(bad)


def test_hostfile_both_formats():
    text = "# cluster\nnode1 slots=4 max_slots=8\nnode2:4   # mpich style\n\nnode3 slots=4\n"
    assert parse_hostfile(text) == [Host("node1", 4), Host("node2", 4), Host("node3", 4)]
    assert parse_hostfile("solo\n") == [Host("solo", 1)]
    with pytest.raises(ConfigError, match="hostfile:1"):
        parse_hostfile("a colour=blue")
    with pytest.raises(ConfigError, match="no hosts"):
        parse_hostfile("# nothing\n")


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("x[8-10]", ["x8", "x9", "x10"]),
        ("a[1-2]b,c", ["a1b", "a2b", "c"]),
    ],
)
def test_expand_nodelist(spec, names):
    assert expand_nodelist(spec) == names


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1", 4) == [2, 2, 2, 1]
    assert expand_tasks_per_node("4", 3) == [4, 4, 4]
    with pytest.raises(ConfigError):
        expand_tasks_per_node("2(x2)", 3)


def test_slurm_allocation():
    assert slurm_hosts({}) is None
    env = {"SLURM_JOB_NODELIST": "trn[1-2]", "SLURM_TASKS_PER_NODE": "8(x2)"}
    assert slurm_hosts(env) == [Host("trn1", 8), Host("trn2", 8)]
    env["SLURM_NTASKS_PER_NODE"] = "4"
    assert slurm_hosts(env) == [Host("trn1", 4), Host("trn2", 4)]


def test_bind_address():
    assert resolve_bind_address("", single_host=True) == "127.0.0.1"
    assert resolve_bind_address("lo", single_host=False) == "127.0.0.1"
    assert resolve_bind_address("127.0.0.0/8", single_host=False) == "127.0.0.1"
    assert resolve_bind_address("10.1.2.3", single_host=False) == "10.1.2.3"
    real = [i for i in interfaces() if i.up and not i.loopback]
    if real:
        assert resolve_bind_address("", single_host=False) == real[0].address
    for bad in ("no-such-if0", "203.0.113.0/24", "10.0.0.0/99"):
        with pytest.raises(ConfigError):
            resolve_bind_address(bad, single_host=False)


def test_service_port_is_never_one_the_kernel_hands_out():
    """MASTER_PORT must not be a port a daemon's listener (bound to port 0) can get meanwhile."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = (int(x) for x in f.read().split())
    ports = {service_port() for _ in range(50)}
    assert all(not lo <= p <= hi for p in ports), ports
    assert len(ports) > 1  # drawn, not a fixed port two jobs would fight over
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))  # and free
