"""Exports torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, ...) to one worker, then execs its command."""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import IO


def torchrun_env(
    world_rank: int, daemons: int, per_node: int, master_addr: str, master_port: int, run_id: str = "smddp"
) -> dict[str, str]:
    """The variables torchrun sets, for the worker at MPI world rank `world_rank`.

    smddp-launch starts the daemons first (world ranks 0..N-1), then the workers in node order, G per
    node, so worker rank = world rank - N: the same rank smddp's bootstrap assigns.
    """
    rank = world_rank - daemons
    if rank < 0:
        raise ValueError(f"world rank {world_rank} is a daemon's (there are {daemons} daemons)")
    world = daemons * per_node
    node, local = divmod(rank, per_node)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(daemons),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "NODE_RANK": str(node),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        # torchrun's job id: what torch.distributed.is_torchelastic_launched() (and so Lightning) looks for.
        "TORCHELASTIC_RUN_ID": run_id,
    }


def world_rank_from(env: Mapping[str, str]) -> int:
    """This process's MPI world rank, from what Open MPI (or PMIx) put in its environment."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if key in env:
            return int(env[key])
    raise ValueError("not started by mpirun: OMPI_COMM_WORLD_RANK and PMIX_RANK are unset")


def _die_with_parent() -> None:
    """In the child: if this wrapper dies, the worker gets SIGKILL too (Linux)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pump(src: IO[bytes], dst: IO[bytes], prefix: bytes) -> None:
    """Copy lines from the worker to our own stream, each behind the prefix."""
    for line in iter(src.readline, b""):
        dst.write(prefix + line)
        dst.flush()
    src.close()


def run_tagged(command: list[str], prefix: str) -> int:
    """Run the worker as a child whose stdout and stderr lines carry its rank; pass signals on.

    The exit status is the worker's (128 + n if a signal n killed it), as if it had been exec'd.
    """
    try:
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_die_with_parent
        )
    except OSError as e:
        print(f"smddp worker_env: cannot run {command[0]}: {e.strerror}", file=sys.stderr)
        return 127
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda n, _f: child.send_signal(n))
    tag = prefix.encode()
    assert child.stdout is not None and child.stderr is not None
    pumps = [
        threading.Thread(target=_pump, args=(child.stdout, sys.stdout.buffer, tag), daemon=True),
        threading.Thread(target=_pump, args=(child.stderr, sys.stderr.buffer, tag), daemon=True),
    ]
    for t in pumps:
        t.start()
    code = child.wait()
    for t in pumps:
        t.join(timeout=5)
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m smddp.launcher.worker_env")
    p.add_argument("--daemons", type=int, required=True)
    p.add_argument("--per-node", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--tag-output", action="store_true", help="prefix every output line with [rank R]")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command after --")
    try:
        env = torchrun_env(
            world_rank_from(os.environ),
            args.daemons,
            args.per_node,
            args.master_addr,
            args.master_port,
            os.environ.get("SMDDP_JOB_ID") or "smddp",
        )
    except ValueError as e:
        print(f"smddp worker_env: {e}", file=sys.stderr)
        return 2
    os.environ.update(env)
    if args.tag_output:
        return run_tagged(command, f"[rank {env['RANK']}] ")
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"smddp worker_env: cannot run {command[0]}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
