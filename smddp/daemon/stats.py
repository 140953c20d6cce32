"""What a daemon has done and is doing: counters, rates, latencies and errors for status and metrics."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from smddp.proto.dtypes import DType, Kind

# Latency histograms are kept per size class, the way users reason about collectives. The engine
# classes each completion (its plane is built with SIZE_LIMITS and LATENCY_BUCKETS) and hands over
# sums, so that no Python runs per collective.
SIZE_CLASSES = ((64 << 10, "<=64KiB"), (1 << 20, "<=1MiB"), (16 << 20, "<=16MiB"), (None, ">16MiB"))
SIZE_LIMITS = tuple(limit for limit, _ in SIZE_CLASSES if limit is not None)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_KIND_LABELS = {k.value: k.label for k in Kind}
_DTYPE_LABELS = {d.value: d.label for d in DType}


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def add(self, bucket: int, count: int, seconds: float) -> None:
        """`count` latencies in `bucket` (an index into LATENCY_BUCKETS; its length: slower than all),
        summing to `seconds`."""
        self.counts[bucket] += count
        self.total += seconds
        self.n += count


class Stats:
    """Thread-safe counters of one daemon; `snapshot()` gives a plain dict."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.collectives: collections.Counter[tuple[str, str]] = collections.Counter()
        self.bytes_in: collections.Counter[int] = collections.Counter()
        self.bytes_out: collections.Counter[int] = collections.Counter()
        self.frames_in = 0
        self.frames_out = 0
        self.reduce_bytes = 0
        self.reduce_seconds = 0.0
        self.latency: dict[str, Histogram] = {name: Histogram() for _, name in SIZE_CLASSES}
        self.errors: collections.Counter[str] = collections.Counter()
        self.last_errors: collections.deque[tuple[float, str]] = collections.deque(maxlen=10)
        # (time, bytes in per peer, bytes out per peer) samples for current rates
        self._samples: collections.deque[tuple[float, dict[int, int], dict[int, int]]] = collections.deque(
            maxlen=6
        )

    def add_in(self, peer: int, nbytes: int) -> None:
        with self._lock:
            self.bytes_in[peer] += nbytes
            self.frames_in += 1

    def add_out(self, peer: int, nbytes: int) -> None:
        with self._lock:
            self.bytes_out[peer] += nbytes
            self.frames_out += 1

    def add_reduce(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.reduce_bytes += nbytes
            self.reduce_seconds += seconds

    def done(self, kind: int, dtype: int, size_class: int, bucket: int, count: int, seconds: float) -> None:
        """`count` collectives of `kind` and `dtype` (wire codes) completed, in size class `size_class`
        (an index into SIZE_CLASSES) and latency bucket `bucket`, their latencies summing to `seconds`."""
        with self._lock:
            self.collectives[(_KIND_LABELS[kind], _DTYPE_LABELS[dtype])] += count
            self.latency[SIZE_CLASSES[size_class][1]].add(bucket, count, seconds)

    def error(self, kind: str, text: str) -> None:
        with self._lock:
            self.errors[kind] += 1
            self.last_errors.append((time.time(), text))

    def sample(self) -> None:
        """Called about once a second: the window that current rates are computed over."""
        with self._lock:
            self._samples.append((time.monotonic(), dict(self.bytes_in), dict(self.bytes_out)))

    def rates(self) -> tuple[dict[int, float], dict[int, float]]:
        """Bytes per second in and out per peer over the last few seconds."""
        with self._lock:
            if len(self._samples) < 2:
                return {}, {}
            (t0, in0, out0), (t1, in1, out1) = self._samples[0], self._samples[-1]
        dt = max(t1 - t0, 1e-9)
        rin = {p: (in1.get(p, 0) - in0.get(p, 0)) / dt for p in in1}
        rout = {p: (out1.get(p, 0) - out0.get(p, 0)) / dt for p in out1}
        return rin, rout

    def snapshot(self) -> dict:
        rin, rout = self.rates()
        with self._lock:
            return {
                "collectives": sum(self.collectives.values()),
                "by_kind": {f"{k}/{d}": n for (k, d), n in sorted(self.collectives.items())},
                "bytes_in": dict(self.bytes_in),
                "bytes_out": dict(self.bytes_out),
                "rate_in": rin,
                "rate_out": rout,
                "frames_in": self.frames_in,
                "frames_out": self.frames_out,
                "reduce_bytes": self.reduce_bytes,
                "reduce_seconds": self.reduce_seconds,
                "latency": {
                    name: {"counts": list(h.counts), "sum": h.total, "n": h.n}
                    for name, h in self.latency.items()
                },
                "errors": dict(self.errors),
                "last_errors": [{"time": t, "text": text} for t, text in self.last_errors],
            }
