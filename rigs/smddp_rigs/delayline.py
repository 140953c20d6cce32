"""The simulated cluster's delay line: `python -m smddp_rigs.delayline --ports p0,p1 --delay-us 500`."""

# This kernel has no netem, so a SimCluster with ClusterConfig.delay_ms runs this in its switch
# namespace instead of a bridge: a learning switch over one AF_PACKET socket per port that holds every
# frame for the delay (rigs/smddp_rigs/_delayline.c has the details). The process runs until SIGTERM or
# SIGINT, then prints its counters to stderr (and to --stats as JSON) and exits 0.

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import resource
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

#: One-way delays above this are refused: a typo, not a network (TCP's retransmit timers start at 200 ms).
MAX_DELAY_US = 1_000_000.0
_IFNAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")


class DelayLineError(RuntimeError):
    """The delay line cannot run: bad arguments, or the compiled extension is missing."""


@dataclass(frozen=True)
class DelayLineConfig:
    """What to forward: the switch ports (interface names in this namespace) and the one-way delay."""

    ports: tuple[str, ...]
    delay_us: float
    queue_mib: int = 64  # frames held at once, at most; a full queue stops reading (the kernel drops)
    stats: str | None = None  # write the counters here as JSON at exit
    # SCHED_FIFO: the line stands in for switch hardware, which does not wait for the simulated hosts'
    # processes to give up a core. It sleeps between frames, and the kernel's RT throttling (95% of a
    # core by default) bounds it even if it did not.
    realtime: bool = True

    def __post_init__(self) -> None:
        if len(self.ports) < 2:
            raise DelayLineError(f"a switch needs at least 2 ports, not {list(self.ports)}")
        if len(set(self.ports)) != len(self.ports):
            raise DelayLineError(f"ports repeat: {list(self.ports)}")
        bad = [p for p in self.ports if not _IFNAME_RE.match(p)]
        if bad:
            raise DelayLineError(f"not interface names: {bad}")
        if not 0 <= self.delay_us <= MAX_DELAY_US:
            raise DelayLineError(f"delay must be 0..{MAX_DELAY_US:g} us, not {self.delay_us:g}")
        if not 1 <= self.queue_mib <= 4096:
            raise DelayLineError(f"queue must be 1..4096 MiB, not {self.queue_mib}")

    @property
    def delay_ns(self) -> int:
        return round(self.delay_us * 1000)


def parse_args(argv: Sequence[str]) -> DelayLineConfig:
    p = argparse.ArgumentParser(
        prog="python -m smddp_rigs.delayline",
        description="A learning Ethernet switch that delays every frame (run in a SimCluster's switch namespace).",
    )
    p.add_argument("--ports", required=True, help="comma-separated interfaces: p0,p1,...,uplink")
    p.add_argument("--delay-us", type=float, required=True, help="one-way delay added to every frame")
    p.add_argument("--queue-mib", type=int, default=64, help="most frame bytes held at once (default 64)")
    p.add_argument("--stats", default=None, help="write the counters here as JSON at exit")
    p.add_argument(
        "--no-realtime",
        dest="realtime",
        action="store_false",
        help="stay in the normal scheduling class (default: SCHED_FIFO priority 1 where permitted)",
    )
    a = p.parse_args(list(argv))
    ports = tuple(x.strip() for x in a.ports.split(",") if x.strip())
    try:
        return DelayLineConfig(
            ports=ports, delay_us=a.delay_us, queue_mib=a.queue_mib, stats=a.stats, realtime=a.realtime
        )
    except DelayLineError as e:
        p.error(str(e))
        raise  # p.error exits; this keeps type checkers sure a config is returned


def load_extension() -> ModuleType:
    """The compiled forwarder, or DelayLineError saying how to get it."""
    try:
        return importlib.import_module("smddp_rigs._delayline")
    except ImportError as e:
        raise DelayLineError(
            f"the compiled delay line smddp_rigs._delayline is not built ({e}); it needs Linux and a "
            "C compiler: `pip install -e .` or `python setup.py build_ext --inplace`"
        ) from e


def summarize(counters: dict[str, int], delay_us: float, cpu_s: float = 0.0) -> dict[str, Any]:
    """The counters plus the mean lateness of sends behind their due time and the CPU time spent."""
    late = counters.get("late_count", 0)
    return {
        "delay_us": delay_us,
        **counters,
        "late_mean_us": counters.get("late_sum_ns", 0) / late / 1000 if late else 0.0,
        "cpu_s": cpu_s,
    }


def run(cfg: DelayLineConfig, ready_fd: int = -1) -> dict[str, Any]:
    """Forward until SIGTERM or SIGINT; returns summarize()'s counters."""
    ext = load_extension()
    sched = "other"
    if cfg.realtime:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            sched = "fifo"
        except OSError as e:  # no CAP_SYS_NICE, or an RT budget of 0 in this cgroup: the normal class
            print(f"delayline: SCHED_FIFO refused ({e}); staying in SCHED_OTHER", file=sys.stderr)
    stop_r, stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Nothing to do here: the wake-up fd below already made stop_r readable, which ends ext.run().
        pass

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    # Written by CPython's C-level handler the moment a signal arrives, even while ext.run() holds no
    # GIL and sleeps in ppoll(): the forwarder's poll set includes stop_r.
    old_fd = signal.set_wakeup_fd(stop_w, warn_on_full_buffer=False)
    try:
        counters = ext.run(
            list(cfg.ports), cfg.delay_ns, stop_r, ready_fd=ready_fd, queue_bytes=cfg.queue_mib << 20
        )
    finally:
        signal.set_wakeup_fd(old_fd)
        for s, h in old.items():
            signal.signal(s, h)
        os.close(stop_r)
        os.close(stop_w)
    # The whole process's CPU time, start-up included (tens of ms): what the line cost the machine.
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {**summarize(counters, cfg.delay_us, ru.ru_utime + ru.ru_stime), "sched": sched}


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sys.stdout.flush()
        # "ready" goes to stdout once every port is open: SimCluster.up() waits for that line.
        out = run(cfg, ready_fd=sys.stdout.fileno())
    except (DelayLineError, OSError) as e:
        print(f"delayline: {e}", file=sys.stderr)
        return 1
    line = json.dumps(out, sort_keys=True)
    print(f"delayline: counters {line}", file=sys.stderr)
    if cfg.stats:
        Path(cfg.stats).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
