"""Command lines: each parses flags into a frozen config and calls the library, nothing more."""

from __future__ import annotations

import argparse
import json
import os
import sys

from smddp import settings
from smddp.errors import ConfigError
from smddp.launcher.hosts import Host


def _launch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smddp-launch",
        description="Run a data-parallel job: one smddp-daemon per node plus W workers, through mpirun.",
        usage="smddp-launch -np W [options] -- COMMAND [ARGS ...]",
        epilog="Every setting, its environment variable and default: docs/configuration.md.",
    )
    settings.add_flags(p, settings.LAUNCH)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after --")
    return p


def launch_main(argv: list[str] | None = None) -> int:
    import shlex

    from smddp.launcher.mpirun import LaunchConfig, launch

    try:
        args = _launch_parser().parse_args(argv)
    except ConfigError as e:  # a bad value in a setting's environment variable
        print(f"smddp-launch: {e}", file=sys.stderr)
        return 2
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
            forward_env=args.forward_env,
            command=tuple(command),
            local_nodes=args.local_nodes,
            fusion_mb=args.fusion_mb,
            chunk_kb=args.chunk_kb,
            threads=args.threads,
            replicate_kb=args.replicate_kb,
            fabric=args.fabric,
            ofi_provider=args.ofi_provider,
            libfabric=args.libfabric,
            pipeline_kb=args.pipeline_kb,
            timeout_s=args.timeout_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            connect_timeout_s=args.connect_timeout_s,
            join_timeout_s=args.join_timeout_s,
            stall_warning_s=args.stall_warning_s,
            stall_timeout_s=args.stall_timeout_s,
            metrics_port=args.metrics_port,
            timeline=args.timeline,
            tag_output=args.tag_output,
            log_level=args.log_level,
            mpi_args=tuple(shlex.split(args.mpi_args)),
            dry_run=args.dry_run,
            mpirun=args.mpirun,
            max_restarts=args.max_restarts,
            restart_delay_s=args.restart_delay_s,
            restart_on=args.restart_on,
            min_nodes=args.min_nodes,
            host_wait_s=args.host_wait_s,
            secret_file=os.path.abspath(args.secret_file) if args.secret_file else "",
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
        prog="smddp-daemon",
        description="The smddp node daemon (started by smddp-launch, or by the first worker of each node under torchrun).",
        epilog="Every setting, its environment variable and default: docs/configuration.md.",
    )
    settings.add_flags(p, settings.DAEMON)
    try:
        args = p.parse_args(argv)
        cfg = DaemonConfig(
            local_size=args.local_size,
            chunk_bytes=args.chunk_kb * settings.KiB,
            threads=args.threads,
            replicate_bytes=args.replicate_kb * settings.KiB,
            fabric=args.fabric,
            ofi_provider=args.ofi_provider,
            libfabric=args.libfabric,
            iface=args.iface,
            socket_dir=args.socket_dir,
            job_id_hex=settings.from_env(settings.DAEMON)["job_id"],
            restart_count=settings.from_env(settings.DAEMON)["restart_count"],
            ledger=settings.from_env(settings.DAEMON)["ledger"],
            secret_file=args.secret_file,
            rendezvous_fd=args.rendezvous_fd,
            connect_timeout_s=args.connect_timeout_s,
            join_timeout_s=args.join_timeout_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            stall_warning_s=args.stall_warning_s,
            stall_timeout_s=args.stall_timeout_s,
            metrics_port=args.metrics_port,
            timeline_dir=args.timeline_dir,
            log_level=args.log_level,
        )
    except ConfigError as e:
        print(f"smddp-daemon: {e}", file=sys.stderr)
        return 2
    return run(cfg)


def _torch_backend(build: bool, as_json: bool) -> int:
    try:
        from smddp.torch.native import report
    except ImportError as e:
        print(f"smddp torch-backend: torch is not importable here: {e}", file=sys.stderr)
        return 1
    r = report(build)
    if as_json:
        print(json.dumps(r))
    else:
        abi = "C++11 ABI" if r["cxx11_abi"] else "pre-C++11 ABI"
        print(f"torch {r['torch']} ({abi}), Python {r['python']}, SMDDP_TORCH_BACKEND={r['asked']}")
        where = ("prebuilt at " if r["prebuilt"] else "built at ") + r["module"] if r["module"] else ""
        print(f"C++ backend: {where or 'not built (' + r['build_dir'] + ')'}")
        print(f"a group gets: {r['group_gets']} ({r['why']})")
    if r["error"]:
        print(r["error"], file=sys.stderr)  # ("smddp: ...")
    return 1 if r["error"] or r["group_gets"] == "none" else 0


def smddp_main(argv: list[str] | None = None) -> int:
    import smddp

    p = argparse.ArgumentParser(prog="smddp", description="smddp tools.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("launch", help="same as smddp-launch", add_help=False)
    sub.add_parser("daemon", help="same as smddp-daemon", add_help=False)
    sub.add_parser("version", help="print the version")
    st = sub.add_parser("status", help="look inside the running jobs on this host")
    st.add_argument(
        "--job",
        default="",
        help="job id (or a unique prefix); without it, the one job's table, or the list of several",
    )
    st.add_argument("--list", action="store_true", help="list the jobs even when there is one")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--watch", nargs="?", type=float, const=2.0, default=0.0, help="redraw every N seconds")
    st.add_argument("--socket-dir", default="")
    tl = sub.add_parser("timeline", help="draw a job's timeline (smddp-launch --timeline) as a PNG")
    tl.add_argument("trace", help="the trace smddp-launch --timeline wrote")
    tl.add_argument("--png", required=True, help="where to write the picture")
    tl.add_argument("--first", type=int, default=0, help="first collective (sequence number) to draw")
    tl.add_argument("--last", type=int, default=0, help="last collective to draw")
    tb = sub.add_parser(
        "torch-backend",
        help="which torch backend an smddp group gets here, and why; --build makes the C++ one ahead of jobs",
    )
    tb.add_argument(
        "--build",
        action="store_true",
        help="build the C++ backend for this torch now, where it is not built (an image's, a shared cache's)",
    )
    tb.add_argument("--json", action="store_true", help="machine-readable output")
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
    elif args.cmd == "torch-backend":
        return _torch_backend(args.build, args.json)
    elif args.cmd == "status":
        from smddp.errors import SmddpError
        from smddp.launcher.status import StatusConfig, status

        try:
            return status(
                StatusConfig(
                    job=args.job, json=args.json, list=args.list, watch=args.watch, socket_dir=args.socket_dir
                )
            )
        except KeyboardInterrupt:
            return 0
        except SmddpError as e:
            print(f"smddp status: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(smddp_main())
