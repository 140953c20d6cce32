"""The node daemon: one per node, server shard for every fusion buffer; never imports the client."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import stat
import time

from smddp.daemon.config import DaemonConfig
from smddp.daemon.fabric import choose_fabric, use_wheel_providers
from smddp.daemon.kernels import engine_kernels
from smddp.daemon.node import NodeDaemon
from smddp.errors import BootstrapCancelled, BootstrapError, ConfigError
from smddp.lifetime import signal_on_parent_death
from smddp.transport.bootstrap import (
    JOB_FILE,
    SECRET_FILE,
    DaemonComm,
    Job,
    MpiComm,
    bootstrap_daemons,
    default_socket_dir,
    job_description,
    job_dir,
    read_secret_file,
)
from smddp.transport.ledger import LedgerClient
from smddp.transport.netif import resolve_bind_address
from smddp.transport.relay import RelayComm

__all__ = ["DaemonConfig", "NodeDaemon", "private_dir", "run"]

START_FAILURE_LINGER_S = 2.0  # how long a daemon that cannot start waits before it ends (see run)


def private_dir(path: str) -> str:
    """Create (or check) a directory only its owner can enter; refuse one anyone else could use."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ConfigError(f"{path} is not a directory owned by uid {os.getuid()}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def run(cfg: DaemonConfig) -> int:
    """Bootstrap with the job's workers and serve until the job ends; the exit status is the result."""
    # The kernel ends us when our launcher dies: no orphaned daemons. Under smddp-launch that is
    # mpirun's local daemon, and SIGKILL (mpirun cleans up after us). Under torchrun it is the node's
    # first worker, and SIGTERM, whose handler removes the job's directory: nobody else would.
    relayed = cfg.rendezvous_fd >= 0
    signal_on_parent_death(signal.SIGTERM if relayed else signal.SIGKILL, exit_if_orphaned=True)
    # One line per event; the message itself starts with "node N (host, ranks ...)".
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format=f"[smddp-daemon %(levelname)s {socket.gethostname()} pid {os.getpid()}] %(message)s",
    )
    logging.getLogger("smddp").setLevel(cfg.log_level.upper())
    logging.getLogger("smddp.daemon").info("reduction kernels: %s", engine_kernels())
    use_wheel_providers(cfg.libfabric, os.environ)
    try:
        fabric = choose_fabric(cfg.fabric, cfg.ofi_provider, cfg.libfabric, os.environ)
    except ConfigError as e:
        # Before the bootstrap: every node's daemon says so and ends, and smddp-launch ends the job.
        # mpirun stops the others when the first one ends: it waits a moment first, so that every
        # node (they start together) has said what is wrong with it, not only the quickest.
        logging.getLogger("smddp.daemon").error("cannot start: %s", e)
        time.sleep(START_FAILURE_LINGER_S)
        return 2
    logging.getLogger("smddp.daemon").info(
        "fabric: %s%s (%s)",
        fabric.fabric,
        f" {fabric.provider}, libfabric {fabric.library}" if fabric.library else "",
        fabric.why,
    )
    held: dict[str, object] = {}

    def remove_dir() -> None:
        if "dir" in held:
            shutil.rmtree(str(held["dir"]), ignore_errors=True)

    def stopped_early(signum: int, _frame: object) -> None:
        # Stopped during the bootstrap (the worker that started us died): leave nothing behind.
        remove_dir()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped_early)

    def open_endpoint(node: int, job_hex: str, single_host: bool) -> tuple[str, int, str]:
        host = resolve_bind_address(cfg.iface, single_host)
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((host, 0))
        tcp.listen(128)
        base = private_dir(cfg.socket_dir or default_socket_dir())
        jobdir = private_dir(job_dir(base, job_hex, node))
        path = os.path.join(jobdir, "daemon.sock")
        if os.path.exists(path):
            os.unlink(path)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(path)
        unix.listen(128)
        held.update(tcp=tcp, unix=unix, dir=jobdir)
        return host, tcp.getsockname()[1], path

    try:
        comm: DaemonComm
        job_hex = cfg.job_id_hex
        if relayed:
            relay = RelayComm(cfg.rendezvous_fd, cfg.connect_timeout_s)
            # Started before its job was known (elastic.EarlyDaemon): the worker's greeting names it.
            job_hex = relay.job or job_hex
            comm = relay
        else:
            comm = MpiComm()
        try:
            user_secret = read_secret_file(cfg.secret_file) if cfg.secret_file else None
        except BootstrapError as e:
            comm.abort(str(e))  # under torchrun, every rank then ends with this cause
            raise
        me = bootstrap_daemons(comm, open_endpoint, cfg.local_size, job_hex, user_secret)
    except BootstrapCancelled as e:
        logging.getLogger("smddp.daemon").info("%s: ending", e)
        return 0
    except BootstrapError as e:
        logging.getLogger("smddp.daemon").error("bootstrap failed: %s", e)
        remove_dir()
        return 2
    jobdir = str(held["dir"])

    # Tell smddp-launch we are up, and later how we ended: mpirun alone may report a job that lost a
    # node as a success (transport/ledger.py).
    ledger = LedgerClient.connect(cfg.ledger, me.node) if cfg.ledger else None

    running: list[NodeDaemon] = []  # the daemon, once made: a stop says how its job had failed

    def stopped(signum: int, _frame: object) -> None:
        # mpirun stops the daemons with SIGTERM (another daemon failed, or smddp-launch ends the job):
        # nothing of the job may stay behind, not even on a host smddp-launch does not run on.
        shutil.rmtree(jobdir, ignore_errors=True)
        if ledger is not None:
            d = running[0] if running else None
            if d is not None and d.failure is not None:
                ledger.end(False, d.failure, infra=d.failure_infra)
            else:
                ledger.end(False, f"stopped by signal {signum} (mpirun tore the job down)")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    write_job_files(jobdir, me.job, me.node, cfg.restart_count)
    daemon = NodeDaemon(
        cfg,
        me.job,
        me.node,
        held["tcp"],  # type: ignore[arg-type]
        held["unix"],  # type: ignore[arg-type]
        jobdir,
        fabric,
    )
    running.append(daemon)
    if cfg.metrics_port:
        from smddp.daemon.metrics import serve_metrics

        serve_metrics(
            daemon, me.job.daemons[me.node].tcp_host, cfg.metrics_port + me.node
        )  # node n: port P + n
    status = daemon.serve()
    if ledger is not None:
        ledger.end(daemon.failure is None, daemon.failure or "", infra=daemon.failure_infra)
    return status


def write_job_files(jobdir: str, job: Job, node: int, attempt: int = 0) -> None:
    """What a worker and `smddp status` need to find and join this daemon: readable by this user
    alone (0600, in a 0700 directory), as the shell that runs it is; never in argv, environment or
    logs. The secret goes first and job.json last, renamed into place: a reader that sees job.json
    sees both whole."""
    # Under torchrun, which run of torch elastic this job is an attempt of ("" under smddp-launch).
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    info = json.dumps({**job_description(job, node), "attempt": attempt, "run": run}).encode()
    for name, data in ((SECRET_FILE, job.secret), (JOB_FILE, info)):
        tmp = os.path.join(jobdir, f".{name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(jobdir, name))
