"""A real Slurm on a SimCluster: munged with a key made for the run, slurmctld on node 0, a slurmd in every node."""

# Everything lives in one directory made for the run (under /run: munged refuses a key or socket
# below a directory that others can write, as /tmp is) and removed by stop():
#
#   munge.key, munge.sock, munged.*   one munged for all nodes: its socket is a file, and network
#                                     namespaces share the file system (AuthInfo=socket=...)
#   slurm.conf                        the cluster: SlurmctldHost = node 0, one NodeName per node
#                                     with its address, a partition of all of them; SLURM_CONF
#                                     names it for the daemons and for every client command
#   ctld/, slurmctld.log              slurmctld's state and log
#   slurmd-{node}/, .log              each slurmd's spool and log (%n: the node's name)
#   jobcomp.txt                       the job completion log (state and exit code of each job)
#
# Each daemon runs in its node's namespace with the node's host name (SimCluster.popen), so slurmd
# finds its NodeName by host name, as on a real node. proctrack/linuxproc tracks a job's processes
# by parentage: no cgroup hierarchy is needed. Accounting (sacct) needs slurmdbd and a database,
# which this rig does not run: job states come from squeue, `scontrol show job` and jobcomp.txt.

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from smddp_rigs.simcluster import SimCluster, SimClusterError, _end_pids
from smddp_rigs.sshd import find_program

#: How long start() waits for every node to be idle in sinfo.
SLURM_START_S = 60.0
# slurmd initializes its cgroup plugin even when nothing uses it (proctrack/linuxproc, task/none),
# and refuses to start without a file system on /sys/fs/cgroup; `ip netns exec` mounts a fresh /sys
# for the node, with nothing there. An empty tmpfs, in the node's own mount namespace, is enough.
_CGROUP_ROOT = 'mount -t tmpfs -o mode=755 cgroup_root /sys/fs/cgroup && exec "$@"'
#: How long a daemon gets after SIGTERM before SIGKILL.
STOP_S = 5.0


def _find(name: str) -> str:
    return find_program(name, "munge slurmctld slurmd slurm-client")


class SlurmCluster:
    """Slurm over every node of an up SimCluster; client commands run on node 0 (the login node)."""

    def __init__(self, cluster: SimCluster, cpus: int | None = None, partition: str = "smddp") -> None:
        self.cluster = cluster
        self.cpus = cpus or os.cpu_count() or 1  # what slurmd detects: every namespace sees all cores
        self.partition = partition
        self.dir: Path | None = None
        self._munged: subprocess.Popen[bytes] | None = None
        self._daemons: list[subprocess.Popen[bytes]] = []

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        try:
            self.dir = Path(tempfile.mkdtemp(prefix=f"{self.cluster.config.prefix}-slurm-", dir="/run"))
            self._start_munged()
            self._write_conf()
            self._write_cgroup_conf()
            (self.dir / "ctld").mkdir()
            log = self.dir / "slurmctld.log"
            self._daemons.append(self._popen(0, [_find("slurmctld"), "-D", "-i", "-f", str(self.conf)], log))
            for i in range(self.cluster.config.nodes):
                (self.dir / f"slurmd-{self.node(i)}").mkdir()
                log = self.dir / f"slurmd-{self.node(i)}.out"
                argv = ["/bin/sh", "-c", _CGROUP_ROOT, "sh", _find("slurmd"), "-D", "-f", str(self.conf)]
                self._daemons.append(self._popen(i, argv, log))
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the daemons (slurmd first, so no job is restarted), munged, and remove the directory."""
        for proc in reversed(self._daemons):
            _end_pids([proc.pid], STOP_S)
            proc.wait(timeout=STOP_S)
        self._daemons = []
        if self._munged is not None:
            _end_pids([self._munged.pid], STOP_S)
            self._munged.wait(timeout=STOP_S)
            self._munged = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- using it --------------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        return self._dir() / "slurm.conf"

    def node(self, i: int) -> str:
        return self.cluster.config.node_name(i)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a user on the login node: SLURM_CONF set, nothing of Slurm's else."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": str(self.conf), **extra}

    def run(
        self, argv: list[str], *, timeout: float = 30, cwd: str | os.PathLike[str] | None = None, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """A client command (sbatch, squeue, scontrol, scancel, sinfo) on node 0."""
        return self.cluster.exec(
            0, argv, capture_output=True, text=True, timeout=timeout, env=self.env(**env), cwd=cwd
        )

    def job_state(self, job: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, ...); {} once forgotten."""
        p = self.run(["scontrol", "--oneliner", "show", "job", job])
        if p.returncode:
            return {}
        return dict(w.split("=", 1) for w in p.stdout.split() if "=" in w)

    def wait_for(self, job: str, states: set[str], timeout: float) -> dict[str, str]:
        """Poll until the job is in one of `states`; returns its record."""
        deadline = time.monotonic() + timeout
        while True:
            rec = self.job_state(job)
            if rec.get("JobState") in states:
                return rec
            if time.monotonic() > deadline:
                raise SimClusterError(
                    f"job {job} not {sorted(states)} after {timeout:g}s: {rec.get('JobState')} "
                    f"(reason {rec.get('Reason')}); slurmctld: {self.log_tail()}"
                )
            time.sleep(0.25)

    def completion_log(self) -> str:
        try:
            return (self._dir() / "jobcomp.txt").read_text()
        except OSError:
            return ""

    def daemon_pids(self) -> set[int]:
        """munged, slurmctld (with its helper slurmscriptd) and every slurmd: what runs between jobs."""
        pids = {p.pid for p in self._daemons if p.poll() is None}
        if self._munged is not None and self._munged.poll() is None:
            pids.add(self._munged.pid)
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                pid, rest = stat.read_text().split(" ", 1)
                comm, fields = rest.rsplit(")", 1)
            except (OSError, ValueError):
                continue
            if comm.endswith("slurmscriptd") and int(fields.split()[1]) in pids:
                pids.add(int(pid))
        return pids

    def log_tail(self, name: str = "slurmctld.log") -> str:
        try:
            return (self._dir() / name).read_text(errors="replace").strip()[-2000:]
        except OSError:
            return "(no log)"

    # -- building --------------------------------------------------------------------------

    def _dir(self) -> Path:
        if self.dir is None:
            raise SimClusterError("Slurm is not started")
        return self.dir

    def _popen(self, i: int, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return self.cluster.popen(
                i,
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=self.env(),
                start_new_session=True,
            )

    def _start_munged(self) -> None:
        d = self._dir()
        key = d / "munge.key"
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        key.chmod(0o400)
        argv = [
            _find("munged"),
            "--foreground",
            "--force",  # as root, and without /etc/munge's ownership checks of a packaged install
            f"--key-file={key}",
            f"--socket={d / 'munge.sock'}",
            f"--pid-file={d / 'munged.pid'}",
            f"--log-file={d / 'munged.log'}",
            f"--seed-file={d / 'munged.seed'}",
        ]
        with open(d / "munged.out", "ab") as out:
            self._munged = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
            )
        deadline = time.monotonic() + 20
        while not (d / "munge.sock").exists():
            if self._munged.poll() is not None or time.monotonic() > deadline:
                raise SimClusterError(
                    f"munged did not start: {self.log_tail('munged.out')} {self.log_tail('munged.log')}"
                )
            time.sleep(0.05)

    def _write_conf(self) -> None:
        d, cfg = self._dir(), self.cluster.config
        nodes = [
            f"NodeName={self.node(i)} NodeAddr={cfg.node_addr(i)} CPUs={self.cpus} State=UNKNOWN"
            for i in range(cfg.nodes)
        ]
        names = ",".join(self.node(i) for i in range(cfg.nodes))
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=smddprig",
                    f"SlurmctldHost={self.node(0)}({cfg.node_addr(0)})",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={d / 'munge.sock'}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"StateSaveLocation={d / 'ctld'}",
                    f"SlurmdSpoolDir={d / 'slurmd-%n'}",
                    f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                    f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={d / 'slurmctld.log'}",
                    f"SlurmdLogFile={d / 'slurmd-%n.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SwitchType=switch/none",
                    "MpiDefault=none",
                    "SchedulerType=sched/builtin",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "ReturnToService=2",
                    "JobCompType=jobcomp/filetxt",
                    f"JobCompLoc={d / 'jobcomp.txt'}",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "MinJobAge=600",
                    "KillWait=10",
                    "InactiveLimit=0",
                    "SlurmctldTimeout=30",
                    "SlurmdTimeout=30",
                    "PropagateResourceLimits=NONE",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    *nodes,
                    f"PartitionName={self.partition} Nodes={names} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _write_cgroup_conf(self) -> None:
        # Beside slurm.conf, where Slurm looks for it. The v1 plugin named, not autodetected: the
        # autodetection wants systemd's cgroup hierarchy, which a node's fresh /sys lacks.
        (self._dir() / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + SLURM_START_S
        want = {self.node(i) for i in range(self.cluster.config.nodes)}
        while True:
            p = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"])
            idle = {ln.split()[0] for ln in p.stdout.splitlines() if ln.split()[1:] == ["idle"]}
            if idle >= want:
                return
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SimClusterError(
                    f"Slurm not up after {SLURM_START_S:g}s (idle: {sorted(idle)}; {p.stdout.strip()} "
                    f"{p.stderr.strip()}); slurmctld: {self.log_tail()}"
                )
            time.sleep(0.2)
