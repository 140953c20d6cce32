"""The delay line's pure parts: its command line, config checks, counters, and ClusterConfig.delay_ms."""

from __future__ import annotations

import os

import pytest
from smddp_rigs.delayline import (
    MAX_DELAY_US,
    DelayLineConfig,
    DelayLineError,
    parse_args,
    summarize,
)
from smddp_rigs.simcluster import ClusterConfig, SimClusterError

from tests.conftest import need_module


def test_parse_args_builds_the_config():
    cfg = parse_args(["--ports", "p0, p1,p2,uplink", "--delay-us", "500", "--stats", "/tmp/x.json"])
    assert cfg == DelayLineConfig(ports=("p0", "p1", "p2", "uplink"), delay_us=500.0, stats="/tmp/x.json")
    assert cfg.delay_ns == 500_000
    assert parse_args(["--ports", "a,b", "--delay-us", "0.25"]).delay_ns == 250
    assert cfg.realtime and not parse_args(["--ports", "a,b", "--delay-us", "1", "--no-realtime"]).realtime


@pytest.mark.parametrize(
    "argv",
    [
        ["--ports", "p0", "--delay-us", "500"],  # one port is no switch
        ["--ports", "p0,p0", "--delay-us", "500"],
        ["--ports", "p0,p1", "--delay-us", "-1"],
        ["--ports", "p0,p1", "--delay-us", str(MAX_DELAY_US * 2)],
        ["--ports", "p0,a-name-longer-than-15", "--delay-us", "1"],
        ["--ports", "p0,p1", "--delay-us", "1", "--queue-mib", "0"],
        ["--delay-us", "1"],
    ],
)
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_config_checks_without_argparse():
    with pytest.raises(DelayLineError, match="repeat"):
        DelayLineConfig(ports=("p0", "p0"), delay_us=1)
    assert DelayLineConfig(ports=("p0", "p1"), delay_us=0).delay_ns == 0


def test_summarize_adds_the_mean_lateness():
    out = summarize({"late_count": 4, "late_sum_ns": 200_000, "rx_frames": 4}, 500.0, 1.5)
    assert out == {
        "delay_us": 500.0,
        "late_count": 4,
        "late_sum_ns": 200_000,
        "rx_frames": 4,
        "late_mean_us": 50.0,
        "cpu_s": 1.5,
    }
    assert summarize({}, 1.0)["late_mean_us"] == 0.0


def test_cluster_config_delay():
    cfg = ClusterConfig(nodes=3, delay_ms=0.5, uplink=True)
    assert cfg.switch_ports() == ["p0", "p1", "p2", "uplink"]
    assert ClusterConfig(nodes=2).switch_ports() == ["p0", "p1"]
    assert ClusterConfig(nodes=2, delay_ms=0).delay_ms == 0
    for bad in (-0.1, 1000.5, float("nan")):
        with pytest.raises(SimClusterError, match="delay_ms"):
            ClusterConfig(nodes=2, delay_ms=bad)


def _extension():
    return need_module("smddp_rigs._delayline", "pip install -e . with a C compiler")


def test_extension_checks_its_arguments_before_opening_anything():
    ext = _extension()
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="ports"):
            ext.run(["p0"], 1000, r)
        with pytest.raises(ValueError, match="delay_ns"):
            ext.run(["p0", "p1"], -1, r)
        with pytest.raises(ValueError, match="queue_bytes"):
            ext.run(["p0", "p1"], 1000, r, queue_bytes=10)
        # An interface that does not exist is named (needs no privilege: the name is looked up first).
        with pytest.raises(OSError, match="no-such-if0"):
            ext.run(["no-such-if0", "lo"], 1000, r)
    finally:
        os.close(r)
        os.close(w)


def test_bench_topology_with_delay():
    from smddp.bench.runner import Topology

    t = Topology(nodes=4, per_node=1, sim=True, rate_mbit=1000.0, delay_ms=0.5)
    assert t.label().endswith(
        "1000 Mbit/s links (tbf burst 256kb), 0.5 ms one-way delay (userspace delay line)"
    )
    assert "delay" not in Topology(nodes=4, per_node=1, sim=True).label()
    with pytest.raises(ValueError, match="simulated"):
        Topology(nodes=2, delay_ms=0.5)


def test_t2_is_checked_on_the_delayed_setup_only():
    from smddp_rigs.bench.targets import SIM4D, T2_BYTES, checks

    from smddp.bench.runner import CaseResult, ImplRun

    def setup(times_ms: dict[str, list[float]]) -> dict:
        def run(impl: str, t: float) -> dict:
            case = CaseResult(T2_BYTES, "float32", "sum", iters=1, times=[t / 1e3], median_s=t / 1e3)
            return ImplRun(impl, {}, 4, "", {}, 1.0, [case]).to_json()

        return {
            "runs": {i: run(i, sorted(ts)[len(ts) // 2]) for i, ts in times_ms.items()},
            "rounds": {i: [run(i, t) for t in ts] for i, ts in times_ms.items()},
        }

    assert SIM4D.delay_ms == 0.5 and SIM4D.rate_mbit == 1000.0 and SIM4D.nodes == 4
    times = {"smddp": [5.0, 6.0, 7.0], "mpi": [9.0, 10.0, 11.0], "gloo": [8.0, 12.0, 8.0]}
    (t2,) = [c for c in checks({"setups": {"sim4d": setup(times)}}) if c.target == "T2"]
    # Against the best baseline's pooled median (gloo 8.0): 6 / 8.
    assert t2.value == pytest.approx(0.75) and not t2.met
    assert t2.per_round == pytest.approx([5 / 8, 6 / 10, 7 / 8])
    assert "0.5 ms one-way delay" in t2.name and "delay line" in t2.note
