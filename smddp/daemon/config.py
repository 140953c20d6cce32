"""The daemon's frozen configuration, filled by the CLI from flags (defaults: smddp.settings)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from smddp.errors import ConfigError
from smddp.settings import KiB, default


@dataclass(frozen=True)
class DaemonConfig:
    """Knobs of one smddp-daemon; the settable ones are declared (with their docs) in smddp.settings."""

    local_size: int = default("local_size")
    chunk_bytes: int = default("chunk_kb") * KiB
    threads: int = default("threads")  # 0: auto (compute_threads)
    iface: str = default("iface")
    socket_dir: str = default("socket_dir")  # "" -> default_socket_dir()
    job_id_hex: str = default("job_id")  # "" -> a random id chosen at bootstrap
    connect_timeout_s: float = default("connect_timeout_s")
    join_timeout_s: float = default("join_timeout_s")
    heartbeat_timeout_s: float = default("heartbeat_timeout_s")
    stall_warning_s: float = default("stall_warning_s")
    stall_timeout_s: float = default("stall_timeout_s")
    timeline_dir: str = default("timeline_dir")
    metrics_port: int = default("metrics_port")
    log_level: str = default("log_level")
    replicate_bytes: int = default("replicate_kb") * KiB
    fabric: str = default("fabric")
    ofi_provider: str = default("ofi_provider")
    libfabric: str = default("libfabric")
    restart_count: int = default("restart_count")
    ledger: str = default("ledger")  # smddp-launch's ledger (transport/ledger.py); "": none
    secret_file: str = default("secret_file")  # "": daemon 0 makes the secret
    rendezvous_fd: int = default("rendezvous_fd")  # -1: bootstrap over MPI (transport/relay.py otherwise)
    # Fixed, not settings: internal bounds of the daemon's own housekeeping.
    result_segment_bytes: int = 256 << 20  # result arena growth step (pages are touched lazily)
    handshake_timeout_s: float = 10.0  # a connection that has not authenticated by then is dropped
    shutdown_timeout_s: float = 30.0  # how long to wait for peers' BYE at the end
    failure_linger_s: float = 30.0  # after a failure, how long local workers get to leave

    def compute_threads(self, cores: int | None = None) -> int:
        """The reduction threads this daemon runs: `threads`, or for 0 the cores of this host (its CPU
        affinity) that its workers leave, at least 2 and at most 8."""
        if self.threads:
            return self.threads
        return auto_threads(len(os.sched_getaffinity(0)) if cores is None else cores, self.local_size)

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_bytes <= 64 << 20:
            raise ConfigError("chunk_bytes must be between 4 KiB and 64 MiB")
        if not 0 <= self.replicate_bytes <= 1 << 30:
            raise ConfigError("replicate_bytes must be between 0 and 1 GiB")
        if self.local_size < 1:
            raise ConfigError("workers per node must be at least 1")
        if self.threads < 0:
            raise ConfigError("threads must be at least 1 (or 0: auto)")
        if not 0.2 <= self.heartbeat_timeout_s <= 3600:
            raise ConfigError("heartbeat timeout must be between 0.2 s and 1 hour")
        if self.stall_timeout_s < 0:
            raise ConfigError("--stall-timeout must not be negative (0: no limit)")
        if self.connect_timeout_s <= 0 or self.join_timeout_s <= 0:
            raise ConfigError("--connect-timeout and --join-timeout must be positive")


@dataclass(frozen=True, slots=True)
class PlaneConfig:
    """What the engine's data plane is built with (smddp._engine.LocalPlane; smddp/engine/local_plane.h's
    PlaneConfig, read field by field by name)."""

    node: int  # this daemon's node
    local_size: int  # its workers
    world: int  # ranks in the job
    first_rank: int  # its first worker's global rank
    nnodes: int
    chunk_bytes: int  # the pipelining chunk
    rank_names: tuple[str, ...]  # local rank i before it connects, as messages name it
    me: str  # this daemon, as messages name it ("node 0 (host, ranks 0-3)")
    spin_us: float  # link threads and the progress thread spin this long, then sleep
    push_timeout_s: float  # a done ring full this long: its worker is stuck
    threads: int  # compute threads sharing the chunks of large collectives (0: none)
    replicate_bytes: int = 0  # collectives up to this size are replicated on every node
    node_names: tuple[str, ...] = ()  # node j in messages (one per node; several nodes only)
    heartbeat_s: float = 0.0  # between daemons: a link silent this long is down (0: no heartbeats)
    trace: bool = False  # keep each collective's phases for the timeline (take_traces)
    fabric: str = "tcp"  # "tcp", or "ofi" (libfabric from ofi_library, provider ofi_provider)
    ofi_library: str = ""
    ofi_provider: str = "efa"
    # How take_completions classes what completed: size classes' upper limits in bytes and latency
    # buckets' upper bounds in seconds, both ascending (smddp.daemon.stats declares them).
    size_limits: tuple[int, ...] = ()
    latency_buckets: tuple[float, ...] = ()


# Memory bandwidth, not cores, bounds the reductions beyond about 8 threads; below 2 a large
# collective's chunks would not overlap with the next one's local work.
AUTO_THREADS_MIN, AUTO_THREADS_MAX = 2, 8


def auto_threads(cores: int, local_size: int) -> int:
    """Reduction threads for a daemon on a host of `cores` usable cores that runs `local_size` workers:
    the cores the workers leave (a GPU's worker mostly waits on its device, but its input pipeline
    does not), between AUTO_THREADS_MIN and AUTO_THREADS_MAX."""
    return max(AUTO_THREADS_MIN, min(AUTO_THREADS_MAX, cores - local_size))
