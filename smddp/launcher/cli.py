"""Command lines: each parses flags into a frozen config and calls the library, nothing more."""

from __future__ import annotations

import argparse
import os
import sys

from smddp.errors import ConfigError
from smddp.launcher.hosts import Host


def _launch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smddp-launch",
        description="Run a data-parallel job: one smddp-daemon per node plus W workers, through mpirun.",
        usage="smddp-launch -np W [options] -- COMMAND [ARGS ...]",
    )
    p.add_argument(
        "-np", "--np", type=int, default=0, help="number of worker processes W (default: one per host slot)"
    )
    p.add_argument("-H", "--hosts", default="", help="hosts and their worker slots: host1:G,host2:G")
    p.add_argument("--hostfile", default="", help="Open MPI (host slots=G) or MPICH (host:G) hostfile")
    p.add_argument("--iface", default="", help="network for smddp and mpirun traffic: interface name or CIDR")
    p.add_argument(
        "--launch-agent", default="", help="how mpirun starts processes on other hosts (default: ssh)"
    )
    p.add_argument(
        "--local-nodes",
        type=int,
        default=1,
        help="run N daemons on this host, each owning W/N workers, talking over loopback TCP",
    )
    p.add_argument("--fusion-mb", type=float, default=64.0, help="fusion buffer size for front ends (MiB)")
    p.add_argument("--chunk-kb", type=int, default=1024, help="pipelining chunk (KiB)")
    p.add_argument("--threads", type=int, default=2, help="reduction threads per daemon")
    p.add_argument(
        "--replicate-kb",
        type=int,
        default=256,
        help="small all-reduces (KiB x (nodes - 1) at most this) skip the second network step; 0 = never",
    )
    p.add_argument(
        "--pipeline-kb",
        type=int,
        default=8192,
        help="in jobs of several nodes, workers send larger host all-reduces as pipelined pieces of this size (KiB); 0 = never",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="default timeout of a blocking call (s)")
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=20.0,
        help="a daemon silent this long counts as lost (frozen, link down) (s)",
    )
    p.add_argument(
        "--stall-warning-s",
        type=float,
        default=60.0,
        help="log collectives that wait longer, and for whom (s)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics: node n serves on PORT+n")
    p.add_argument(
        "--timeline",
        default=os.environ.get("SMDDP_TIMELINE", ""),
        help="write one Chrome/Perfetto trace of every collective on every rank and daemon to FILE",
    )
    p.add_argument("--log-level", default=os.environ.get("SMDDP_LOG_LEVEL", "WARNING"))
    p.add_argument("--mpi-args", default="", help="extra arguments for mpirun, as one string")
    p.add_argument("--mpirun", default="", help="the mpirun to use (default: the one beside this Python)")
    p.add_argument("--dry-run", action="store_true", help="print the mpirun command and exit")
    p.add_argument(
        "--no-tag-output", action="store_true", help="do not prefix each worker's output lines with [rank R]"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after --")
    return p


def launch_main(argv: list[str] | None = None) -> int:
    import shlex

    from smddp.launcher.mpirun import LaunchConfig, launch

    args = _launch_parser().parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        hosts = _hosts(args)
        cfg = LaunchConfig(
            np=args.np,
            hosts=tuple(hosts),
            iface=args.iface,
            launch_agent=args.launch_agent,
            command=tuple(command),
            local_nodes=args.local_nodes,
            fusion_mb=args.fusion_mb,
            chunk_kb=args.chunk_kb,
            threads=args.threads,
            replicate_kb=args.replicate_kb,
            pipeline_kb=args.pipeline_kb,
            timeout_s=args.timeout,
            heartbeat_timeout_s=args.heartbeat_timeout,
            stall_warning_s=args.stall_warning_s,
            metrics_port=args.metrics_port,
            timeline=args.timeline,
            tag_output=not args.no_tag_output,
            log_level=args.log_level,
            mpi_args=tuple(shlex.split(args.mpi_args)),
            dry_run=args.dry_run,
            mpirun=args.mpirun,
        )
        return launch(cfg)
    except ConfigError as e:
        print(f"smddp-launch: {e}", file=sys.stderr)
        return 2


def _hosts(args: argparse.Namespace) -> list[Host]:
    """-H, else --hostfile, else the Slurm allocation we run inside, else this host alone."""
    from smddp.launcher.hosts import parse_host_list, parse_hostfile, slurm_hosts

    if args.hosts and args.hostfile:
        raise ConfigError("give -H or --hostfile, not both")
    if args.hosts:
        return parse_host_list(args.hosts)
    if args.hostfile:
        try:
            with open(args.hostfile) as f:
                return parse_hostfile(f.read(), args.hostfile)
        except OSError as e:
            raise ConfigError(f"cannot read --hostfile {args.hostfile}: {e.strerror}") from None
    if args.local_nodes == 1:
        return slurm_hosts(os.environ) or []
    return []


def daemon_main(argv: list[str] | None = None) -> int:
    from smddp.daemon import DaemonConfig, run

    p = argparse.ArgumentParser(
        prog="smddp-daemon", description="The smddp node daemon (started by smddp-launch)."
    )
    p.add_argument("--workers-per-node", type=int, default=1, help="G: the workers of each node")
    p.add_argument("--chunk-kb", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--replicate-kb",
        type=int,
        default=256,
        help="all-reduces of at most this many KiB x (nodes - 1) take one network step (0 = never)",
    )
    p.add_argument(
        "--iface",
        default=os.environ.get("SMDDP_IFACE", ""),
        help="interface name, CIDR or address to listen on for the other daemons",
    )
    p.add_argument("--socket-dir", default="")
    p.add_argument("--connect-timeout", type=float, default=120.0)
    p.add_argument("--heartbeat-timeout", type=float, default=20.0)
    p.add_argument("--stall-warning", type=float, default=60.0)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--timeline-dir", default="")
    p.add_argument("--log-level", default=os.environ.get("SMDDP_LOG_LEVEL", "WARNING"))
    p.add_argument(
        "--reduce-kernel",
        choices=["auto", "compiled", "numpy"],
        default=os.environ.get("SMDDP_REDUCE_KERNEL", "auto"),
        help="how float16/bfloat16 are summed: the compiled kernel, numpy, or auto (compiled where built)",
    )
    args = p.parse_args(argv)
    try:
        cfg = DaemonConfig(
            local_size=args.workers_per_node,
            chunk_bytes=args.chunk_kb * 1024,
            threads=args.threads,
            replicate_bytes=args.replicate_kb * 1024,
            iface=args.iface,
            socket_dir=args.socket_dir,
            job_id_hex=os.environ.get("SMDDP_JOB_ID", ""),
            connect_timeout_s=args.connect_timeout,
            heartbeat_timeout_s=args.heartbeat_timeout,
            stall_warning_s=args.stall_warning,
            metrics_port=args.metrics_port,
            timeline_dir=args.timeline_dir,
            log_level=args.log_level,
            reduce_kernel=args.reduce_kernel,
        )
    except ValueError as e:
        print(f"smddp-daemon: {e}", file=sys.stderr)
        return 2
    return run(cfg)


def smddp_main(argv: list[str] | None = None) -> int:
    import smddp

    p = argparse.ArgumentParser(prog="smddp", description="smddp tools.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("launch", help="same as smddp-launch", add_help=False)
    sub.add_parser("daemon", help="same as smddp-daemon", add_help=False)
    sub.add_parser("version", help="print the version")
    st = sub.add_parser("status", help="look inside the running jobs on this host")
    st.add_argument("--job", default="", help="job id (or a unique prefix); without it, list the jobs")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--watch", nargs="?", type=float, const=2.0, default=0.0, help="redraw every N seconds")
    st.add_argument("--socket-dir", default="")
    tl = sub.add_parser("timeline", help="draw a job's timeline (smddp-launch --timeline) as a PNG")
    tl.add_argument("trace", help="the trace smddp-launch --timeline wrote")
    tl.add_argument("--png", required=True, help="where to write the picture")
    tl.add_argument("--first", type=int, default=0, help="first collective (sequence number) to draw")
    tl.add_argument("--last", type=int, default=0, help="last collective to draw")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "launch":
        return launch_main(argv[1:])
    if argv and argv[0] == "daemon":
        return daemon_main(argv[1:])
    args = p.parse_args(argv)
    if args.cmd == "version":
        print(f"smddp {smddp.__version__}")
    elif args.cmd == "timeline":
        from smddp.launcher.render import timeline_png

        try:
            n = timeline_png(args.trace, args.png, args.first, args.last)
        except (OSError, ValueError, KeyError, ConfigError) as e:
            print(f"smddp timeline: {e}", file=sys.stderr)
            return 1
        print(f"{args.png}: {n} phases drawn")
    elif args.cmd == "status":
        from smddp.errors import SmddpError
        from smddp.launcher.status import StatusConfig, status

        try:
            return status(
                StatusConfig(job=args.job, json=args.json, watch=args.watch, socket_dir=args.socket_dir)
            )
        except KeyboardInterrupt:
            return 0
        except SmddpError as e:
            print(f"smddp status: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(smddp_main())
