"""The daemon's frozen configuration, filled by the CLI from flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DaemonConfig:
    """Knobs of one smddp-daemon; defaults suit a 2-16 core node."""

    local_size: int = 1  # workers per node (G); smddp-launch passes it
    chunk_bytes: int = 1 << 20  # the pipelining unit
    threads: int = 2  # reduction threads
    iface: str = ""  # interface name, CIDR or address to listen on; "" = loopback on one host, else the first real interface
    socket_dir: str = ""  # "" -> default_socket_dir()
    job_id_hex: str = ""  # "" -> a random id chosen at bootstrap
    result_segment_bytes: int = 256 << 20  # result arena growth step (pages are touched lazily)
    connect_timeout_s: float = 120.0  # all workers and peers must connect within this
    handshake_timeout_s: float = 10.0  # a connection that has not authenticated by then is dropped
    heartbeat_timeout_s: float = 20.0  # a peer (or worker's reader) silent this long has failed
    shutdown_timeout_s: float = 30.0  # how long to wait for peers' BYE at the end
    failure_linger_s: float = 30.0  # after a failure, how long local workers get to leave
    stall_warning_s: float = 60.0  # a collective waiting longer is logged with who it waits for
    timeline_dir: str = ""  # write this daemon's Chrome trace events here at exit ("" = off)
    metrics_port: int = 0  # serve Prometheus /metrics on this port (0 = off)
    log_level: str = "WARNING"
    # An all-reduce whose bytes x (nodes - 1) fit here goes replicated (one network step); 0 = never.
    replicate_bytes: int = 256 << 10
    reduce_kernel: str = "auto"  # 16-bit float reductions: "compiled", "numpy", or "auto" (compiled if built)

    def __post_init__(self) -> None:
        if self.reduce_kernel not in ("auto", "compiled", "numpy"):
            raise ValueError("reduce kernel must be auto, compiled or numpy")
        if not 4096 <= self.chunk_bytes <= 64 << 20:
            raise ValueError("chunk_bytes must be between 4 KiB and 64 MiB")
        if not 0 <= self.replicate_bytes <= 1 << 30:
            raise ValueError("replicate_bytes must be between 0 and 1 GiB")
        if self.local_size < 1:
            raise ValueError("workers per node must be at least 1")
        if self.threads < 1:
            raise ValueError("threads must be at least 1")
        if not 0.2 <= self.heartbeat_timeout_s <= 3600:
            raise ValueError("heartbeat timeout must be between 0.2 s and 1 hour")
