"""The wrapper of every worker: exports its place (torchrun's, SageMaker's and smddp's variables), runs it, reports how it ended."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import IO

# How long a wrapper whose worker ended without joining waits for its daemon to hear of it.
REPORT_TIMEOUT_S = 60.0


def worker_env(
    world_rank: int,
    nodes: int,
    per_node: int,
    master_addr: str,
    master_port: int,
    run_id: str = "smddp",
) -> dict[str, str]:
    """Every variable a worker gets, for the worker at rank `world_rank` of the workers' MPI world.

    smddp-launch starts the workers in a world of their own (the daemons run in another), G per node
    in node order, so the MPI rank is the smddp rank and the torchrun, SageMaker and Open MPI
    variables agree. docs/launching.md lists them all.
    """
    world = nodes * per_node
    if not 0 <= world_rank < world:
        raise ValueError(f"MPI rank {world_rank} is outside a job of {nodes} nodes x {per_node} workers")
    rank = world_rank
    node, local = divmod(rank, per_node)
    return {
        # torchrun's
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "NODE_RANK": str(node),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        # torchrun's job id: what torch.distributed.is_torchelastic_launched() (and so Lightning) looks for.
        "TORCHELASTIC_RUN_ID": run_id,
        # smddp's own: where the client finds its daemon
        "SMDDP_RANK": str(rank),
        "SMDDP_NODE": str(node),
        "SMDDP_LOCAL_RANK": str(local),
        "SMDDP_LOCAL_SIZE": str(per_node),
        "SMDDP_NNODES": str(nodes),
        "SMDDP_WORLD_SIZE": str(world),
        # SageMaker's launcher for smdistributed.dataparallel (its mpirun -x and smddprun); Hugging
        # Face's Trainer reads SMDATAPARALLEL_LOCAL_RANK in SageMaker data-parallel mode.
        "SMDATAPARALLEL_LOCAL_RANK": str(local),
        ("SMDATAPARALLEL_USE_SINGLENODE" if nodes == 1 else "SMDATAPARALLEL_USE_HOMOGENEOUS"): "1",
        "SMDATAPARALLEL_SERVER_ADDR": master_addr,
        "SMDATAPARALLEL_SERVER_PORT": str(master_port),
        # Open MPI's per-node view, as smddp's nodes have it: the same values on real hosts, and
        # consistent with LOCAL_RANK where --local-nodes puts several simulated nodes on one host
        # (MPI itself takes locality from PMIx, not from these).
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node),
        "OMPI_COMM_WORLD_NODE_RANK": str(local),  # Open MPI's: the rank among this node's processes
    }


def shell_status(code: int) -> int:
    """A Popen return code as a shell reports it (128 + n for a process that signal n killed)."""
    return code if code >= 0 else 128 - code


def world_rank_from(env: Mapping[str, str]) -> int:
    """This process's MPI world rank, from what Open MPI (or PMIx) put in its environment."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if key in env:
            return int(env[key])
    raise ValueError("not started by mpirun: OMPI_COMM_WORLD_RANK and PMIX_RANK are unset")


def _lifetime() -> ModuleType:
    """smddp/lifetime.py loaded by its path: this wrapper never imports the smddp package (numpy and all)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lifetime.py")
    spec = importlib.util.spec_from_file_location("_smddp_lifetime", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pump(src: IO[bytes], dst: IO[bytes], prefix: bytes) -> None:
    """Copy lines from the worker to our own stream, each behind the prefix."""
    for line in iter(src.readline, b""):
        dst.write(prefix + line)
        dst.flush()
    src.close()


class _Joined:
    """What the worker's client tells us over a pipe we hand it (smddp.client.session.WrapperPipe):
    "j" once it joined the job, "c<status>" when the job failed because another rank ended with
    that exit status, and "i<why>" when it failed for an infrastructure cause."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_inheritable(self.write_fd, True)
        self.token = f"{self.write_fd}:{os.fstat(self.write_fd).st_ino}"
        self.joined = threading.Event()
        self.cause: int | None = None
        self.infra: str | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        os.close(self.write_fd)  # the child holds it now: EOF once it (and its children) close it
        self._thread.start()

    def _watch(self) -> None:
        data = b""
        try:
            while chunk := os.read(self.read_fd, 64):
                data += chunk
                if data.startswith(b"j"):
                    self.joined.set()
                for line in data[1:].split(b"\n")[:-1]:  # whole lines only
                    if line[:1] == b"c" and line[1:].isdigit() and self.cause is None:
                        self.cause = int(line[1:])
                    elif line[:1] == b"i" and self.infra is None:
                        self.infra = line[1:].decode("utf-8", "replace")
                if len(data) > 4096:
                    break  # not our client talking: stop listening
        finally:
            os.close(self.read_fd)

    def settle(self) -> bool:
        """After the worker exited: did it join? (Its children may hold the pipe on: wait briefly.)"""
        self._thread.join(timeout=0.5)
        return self.joined.is_set()


def run_worker(command: list[str], prefix: str, report: Report | None) -> int:
    """Run the worker as a child (lines tagged with `prefix` if given); pass signals on.

    The exit status is the worker's (128 + n if a signal n killed it), as if it had been exec'd. A
    worker that ended without joining the job is reported to its node's daemon, so that ranks that
    wait for it fail at once, naming it, and a job of workers that never use smddp ends. A worker
    that joined and ended badly is reported too: its status is the cause's, which its daemon passes
    to every rank; a worker that failed because of another rank's end exits with that cause's status
    (whichever rank's exit mpirun sees first, the job's status is the cause's).
    """
    joined = _Joined() if report is not None else None
    env = dict(os.environ)
    if joined is not None:
        env["SMDDP_JOINED_FD"] = joined.token
    pipe = subprocess.PIPE if prefix else None
    try:
        child = subprocess.Popen(
            command,
            stdout=pipe,
            stderr=pipe,
            env=env,
            # In the child, between fork and exec: if this wrapper dies, the worker gets SIGKILL too.
            # Loaded here, in the parent: the forked child only calls it.
            preexec_fn=functools.partial(_lifetime().signal_on_parent_death, signal.SIGKILL),
            pass_fds=(joined.write_fd,) if joined is not None else (),
        )
    except OSError as e:
        print(f"smddp worker_env: cannot run {command[0]}: {e.strerror}", file=sys.stderr)
        code = 127
        if report is not None:
            report.send(code)
        return code
    if joined is not None:
        joined.start()
    if report is not None:
        # What a report needs (numpy among it: 0.2 s on an idle core, seconds on a loaded node) is
        # imported while the worker runs, not after it ended: a teardown's word must reach the
        # daemon within its EXIT_REPORT_WAIT_S, or the rank's end is taken for a crash.
        threading.Thread(target=_import_report, name="smddp-report-import", daemon=True).start()
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
    torn_down = threading.Event()  # told to end (teardown, scancel, the launcher gone): no report

    def forward(n: int, _f: object) -> None:
        if n in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            torn_down.set()
        child.send_signal(n)

    for sig in forwarded:
        signal.signal(sig, forward)
    pumps = []
    if prefix:
        tag = prefix.encode()
        assert child.stdout is not None and child.stderr is not None
        pumps = [
            threading.Thread(target=_pump, args=(child.stdout, sys.stdout.buffer, tag), daemon=True),
            threading.Thread(target=_pump, args=(child.stderr, sys.stderr.buffer, tag), daemon=True),
        ]
    for t in pumps:
        t.start()
    code = shell_status(child.wait())
    for sig in forwarded:  # from here a SIGTERM (mpirun's teardown) ends the wrapper itself
        signal.signal(sig, signal.SIG_DFL)
    joined_ok = joined is not None and joined.settle()
    lost = joined.infra if joined is not None else None  # why its rank lost its own daemon
    lost_daemon = lost is not None
    if code != 0 and report is not None and lost is not None:
        # Its daemon may be unable to say (frozen, gone): smddp-launch hears the cause from here,
        # first, so that it stops the daemons' world rather than wait for it to finish.
        report.infra(lost)
    # A wrapper told to end (mpirun tearing the job down because another rank ended first, or the
    # job cancelled) says so, to a daemon that is there now only: its rank's end is a consequence,
    # and without the word its daemon would take a rank gone without a status for a crash. It does
    # not wait on a daemon that is being torn down too (up to REPORT_TIMEOUT_S), nor report to one
    # its worker lost (a frozen daemon would hold the handshake for its whole timeout).
    if report is not None and joined is not None and not lost_daemon:
        if torn_down.is_set():
            if code != 0:
                report.send(code, wait=False, torn_down=True)
        elif not joined_ok:
            report.send(code)
        elif code != 0:
            report.send(code, wait=False)  # its daemon waits a moment for this before failing the job
    for t in pumps:
        t.join(timeout=5)
    if code != 0 and joined is not None and joined.cause is not None:
        return joined.cause
    return code


def _import_report() -> None:
    import smddp.launcher.exited  # noqa: F401


class Report:
    """Tells rank `rank`'s daemon that its process ended without joining (EXITED over a control connection)."""

    def __init__(self, rank: int, node: int, job_hex: str, timeout: float = REPORT_TIMEOUT_S) -> None:
        self.rank = rank
        self.node = node
        self.job_hex = job_hex
        self.timeout = timeout

    def infra(self, why: str) -> None:
        """Tell smddp-launch's ledger (SMDDP_LEDGER) that this rank failed for an infrastructure cause."""
        spec = os.environ.get("SMDDP_LEDGER", "")
        if not spec:
            return
        from smddp.transport.ledger import report_infra

        if not report_infra(spec, self.rank, why):
            print(
                f"smddp worker_env: rank {self.rank}: could not tell smddp-launch why it failed",
                file=sys.stderr,
            )

    def send(self, status: int, wait: bool = True, torn_down: bool = False) -> None:
        """Report `status` (`torn_down`: the wrapper was told to end); without `wait`, only to a
        daemon that is there now (not one still starting)."""
        # Imported only here: most workers join, and the wrapper should start in no time.
        from smddp.errors import SmddpError
        from smddp.launcher.exited import report_exited

        try:
            report_exited(
                self.job_hex, self.node, self.rank, status, self.timeout if wait else 0.0, torn_down
            )
        except SmddpError as e:
            if wait:  # without waiting, a daemon that has finished is no news
                print(f"smddp worker_env: rank {self.rank}: could not tell the daemon: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m smddp.launcher.worker_env")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--per-node", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--tag-output", action="store_true", help="prefix every output line with [rank R]")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    # The wrapper ends with whoever started it (mpirun, prted): an orphaned wrapper would keep its
    # worker running outside the job, where no teardown (mpirun's, or Slurm's on scancel, which
    # finds a job's processes by parentage) reaches it. SIGTERM: it is passed on to the worker.
    _lifetime().signal_on_parent_death(signal.SIGTERM, exit_if_orphaned=True)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command after --")
    job = os.environ.get("SMDDP_JOB_ID", "")
    try:
        env = worker_env(
            world_rank_from(os.environ),
            args.nodes,
            args.per_node,
            args.master_addr,
            args.master_port,
            job or "smddp",
        )
    except ValueError as e:
        print(f"smddp worker_env: {e}", file=sys.stderr)
        return 2
    os.environ.update(env)
    report = Report(int(env["SMDDP_RANK"]), int(env["SMDDP_NODE"]), job) if job else None
    prefix = f"[rank {env['RANK']}] " if args.tag_output else ""
    return run_worker(command, prefix, report)


if __name__ == "__main__":
    sys.exit(main())
