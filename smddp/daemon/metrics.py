"""Prometheus /metrics for one daemon, read from its Stats at scrape time (nothing counted twice)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from smddp.daemon.stats import LATENCY_BUCKETS

if TYPE_CHECKING:
    from smddp.daemon.node import NodeDaemon


class DaemonCollector:
    """A prometheus_client collector over a live NodeDaemon."""

    def __init__(self, daemon: NodeDaemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        d = self.daemon
        d.count_plane()  # what the engine did since its last tick, so a scrape agrees with `smddp status`
        snap = d.stats.snapshot()
        node = str(d.node)
        done = CounterMetricFamily(
            "smddp_collectives", "Collectives completed by this daemon", labels=["node", "kind", "dtype"]
        )
        for key, n in snap["by_kind"].items():
            kind, dtype = key.split("/")
            done.add_metric([node, kind, dtype], n)
        yield done
        nbytes = CounterMetricFamily(
            "smddp_peer_bytes", "Bytes exchanged with each peer daemon", labels=["node", "peer", "direction"]
        )
        for direction in ("in", "out"):
            for peer, n in snap[f"bytes_{direction}"].items():
                nbytes.add_metric([node, str(peer), direction], n)
        yield nbytes
        reduced = CounterMetricFamily(
            "smddp_reduced_bytes", "Input bytes summed by the daemon", labels=["node"]
        )
        reduced.add_metric([node], snap["reduce_bytes"])
        yield reduced
        copies = CounterMetricFamily(
            "smddp_device_copy_bytes",
            "Bytes each local rank copied between its device and smddp's memory (d2h: in, h2d: back)",
            labels=["node", "rank", "direction"],
        )
        for c in d.device_counts():
            copies.add_metric([node, str(c["rank"]), "d2h"], float(c["d2h_bytes"]))
            copies.add_metric([node, str(c["rank"]), "h2d"], float(c["h2d_bytes"]))
        yield copies
        busy = CounterMetricFamily(
            "smddp_reduce_seconds", "Seconds spent in reduction kernels", labels=["node"]
        )
        busy.add_metric([node], snap["reduce_seconds"])
        yield busy
        latency = HistogramMetricFamily(
            "smddp_collective_latency_seconds",
            "Time from a collective's first frame to its completion here, by size class",
            labels=["node", "size"],
        )
        for size, h in snap["latency"].items():
            cumulative, buckets = 0, []
            for bound, count in zip((*LATENCY_BUCKETS, float("inf")), h["counts"], strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            latency.add_metric([node, size], buckets, h["sum"])
        yield latency
        report = d.local_report()
        inflight = GaugeMetricFamily(
            "smddp_collectives_in_flight", "Collectives in progress", labels=["node"]
        )
        inflight.add_metric([node], report["collectives"]["in_flight"])
        yield inflight
        queues = GaugeMetricFamily("smddp_queue_depth", "Work and send queues", labels=["node", "queue"])
        queues.add_metric([node, "local_tasks"], report["queues"]["local_tasks"])
        queues.add_metric([node, "server_tasks"], report["queues"]["server_tasks"])
        for p in report["peers"]:
            queues.add_metric([node, f"send_to_{p['node']}"], p["send_queue"])
        yield queues
        errors = CounterMetricFamily(
            "smddp_errors", "Refused connections, stalls, failures", labels=["node", "kind"]
        )
        for kind, n in snap["errors"].items():
            errors.add_metric([node, kind], n)
        yield errors
        attempt = GaugeMetricFamily(
            "smddp_job_attempt",
            "Which attempt of the job this is (0: the first; smddp-launch --max-restarts)",
            labels=["node"],
        )
        attempt.add_metric([node], d.cfg.restart_count)
        yield attempt


def serve_metrics(daemon: NodeDaemon, host: str, port: int) -> None:
    """Serve /metrics on host:port in a background thread (prometheus_client's own server)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(DaemonCollector(daemon))
    start_http_server(port, addr=host, registry=registry)
