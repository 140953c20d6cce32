"""The node daemon: one per node, server shard for every fusion buffer; never imports the client."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import stat

from smddp.daemon.config import DaemonConfig, default_socket_dir
from smddp.daemon.node import NodeDaemon
from smddp.errors import BootstrapError, ConfigError
from smddp.proto.frames import Role
from smddp.transport.bootstrap import bootstrap
from smddp.transport.netif import resolve_bind_address

__all__ = ["DaemonConfig", "NodeDaemon", "private_dir", "run"]

_PR_SET_PDEATHSIG = 1


def private_dir(path: str) -> str:
    """Create (or check) a directory only its owner can enter; refuse one anyone else could use."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ConfigError(f"{path} is not a directory owned by uid {os.getuid()}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def die_with_parent() -> None:
    """Ask the kernel to kill us when our launcher (mpirun's local daemon) dies: no orphaned daemons."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: mpirun's own teardown is all we have
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def run(cfg: DaemonConfig) -> int:
    """Bootstrap with the job's workers and serve until the job ends; the exit status is the result."""
    die_with_parent()
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format=f"[smddp-daemon %(levelname)s {socket.gethostname()} pid {os.getpid()}] %(message)s",
    )
    held: dict[str, object] = {}

    def open_endpoint(node: int, job_hex: str, single_host: bool) -> tuple[str, int, str]:
        host = resolve_bind_address(cfg.iface, single_host)
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((host, 0))
        tcp.listen(128)
        base = private_dir(cfg.socket_dir or default_socket_dir())
        jobdir = private_dir(os.path.join(base, f"job-{job_hex}-n{node}"))
        path = os.path.join(jobdir, "daemon.sock")
        if os.path.exists(path):
            os.unlink(path)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(path)
        unix.listen(128)
        held.update(tcp=tcp, unix=unix, dir=jobdir)
        return host, tcp.getsockname()[1], path

    try:
        me = bootstrap(Role.DAEMON, open_endpoint, cfg.job_id_hex)
    except BootstrapError as e:
        logging.getLogger("smddp.daemon").error("bootstrap failed: %s", e)
        return 2
    daemon = NodeDaemon(
        cfg,
        me.job,
        me.node,
        held["tcp"],  # type: ignore[arg-type]
        held["unix"],  # type: ignore[arg-type]
        str(held["dir"]),
    )
    return daemon.serve()
