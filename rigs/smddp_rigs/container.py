"""The container image's start-up, run in SimCluster nodes as each pod would run it: the MPIJob path without Kubernetes."""

# What a container of deploy/docker's image has that a namespace node lacks is its own /etc/ssh (the
# image's: Debian's sshd_config and ssh_config with smddp's drop-ins, no host keys until the
# entrypoint makes them) and the job's key pair mounted at ~/.ssh (the MPI Operator's Secret). Each
# command run "in the container" of node i therefore starts with two bind mounts, private to it and
# to what it starts (the node's command already runs in a mount namespace of its own):
#
#   {dir}/etc-ssh-{i}  -> /etc/ssh      Debian's default configs + deploy/docker/{sshd,ssh}_config
#   {dir}/secret       -> /root/.ssh    id_ed25519 (0600), id_ed25519.pub, authorized_keys
#
# and then runs deploy/docker/entrypoint.sh, the image's ENTRYPOINT, with the image's environment
# (VIRTUAL_ENV and PATH of the venv: here the development venv stands in for /opt/smddp/venv).
# Nothing on the host changes, except that an empty /root/.ssh is made as the mount point if there
# is none (and removed again by stop()).

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

from smddp_rigs.simcluster import SimCluster, SimClusterError, _end_pids
from smddp_rigs.sshd import KEY_PARENT, keygen

#: How long start() waits for every node's sshd.
SSHD_START_S = 30.0
SECRET_MOUNT = Path("/root/.ssh")
# $1: the node's /etc/ssh, $2: the Secret; then the command.
_MOUNTS = 'mount --bind "$1" /etc/ssh && mount --bind "$2" /root/.ssh && shift 2 && exec "$@"'


class ContainerNodes:
    """deploy/docker/entrypoint.sh in `sshd` mode in every node of an up SimCluster; launch() runs its
    `launch` mode in one of them."""

    def __init__(self, cluster: SimCluster, deploy: Path, venv: Path) -> None:
        self.cluster = cluster
        self.entrypoint = deploy / "docker" / "entrypoint.sh"
        self.deploy = deploy
        self.venv = venv
        self.dir: Path | None = None
        self._servers: dict[int, subprocess.Popen[bytes]] = {}
        self._made_mount_point = False

    def start(self) -> ContainerNodes:
        try:
            if not SECRET_MOUNT.exists():
                SECRET_MOUNT.mkdir(mode=0o700)
                self._made_mount_point = True
            self.dir = Path(tempfile.mkdtemp(prefix=f"{self.cluster.config.prefix}-ctr-", dir=KEY_PARENT))
            secret = self.dir / "secret"
            secret.mkdir(mode=0o700)
            keygen(secret / "id_ed25519", "smddp-mpijob")
            shutil.copy(secret / "id_ed25519.pub", secret / "authorized_keys")
            for i in range(self.cluster.config.nodes):
                self._image_etc_ssh(i)
                self._servers[i] = self.popen(i, ["sshd"], stdout_path=self.dir / f"sshd-{i}.log")
            self._wait_for_sshd()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for i in list(self._servers):
            proc = self._servers.pop(i)
            _end_pids([proc.pid], 2.0)
            proc.wait(timeout=5)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self._made_mount_point:
            try:
                SECRET_MOUNT.rmdir()
            except OSError:
                pass
            self._made_mount_point = False

    def __enter__(self) -> ContainerNodes:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def image_env(self, **extra: str) -> dict[str, str]:
        """The image's ENV (Dockerfile.cpu), with the development venv as /opt/smddp/venv."""
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env.update(VIRTUAL_ENV=str(self.venv), PATH=f"{self.venv / 'bin'}:{os.environ.get('PATH', '')}")
        env.update(PYTHONUNBUFFERED="1", **extra)
        return env

    def argv(self, i: int, args: list[str]) -> list[str]:
        """entrypoint.sh ARGS in node i's container."""
        d = self._dir()
        inner = ["/bin/sh", "-c", _MOUNTS, "sh", str(d / f"etc-ssh-{i}"), str(d / "secret")]
        return self.cluster.node_argv(i, [*inner, str(self.entrypoint), *args])

    def popen(self, i: int, args: list[str], stdout_path: Path, **env: str) -> subprocess.Popen[bytes]:
        with open(stdout_path, "ab") as out:
            return subprocess.Popen(
                self.argv(i, args),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=self.image_env(**env),
                start_new_session=True,
            )

    def run(self, i: int, args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(i, args), capture_output=True, text=True, timeout=timeout, env=self.image_env(**env)
        )

    def server_pids(self) -> set[int]:
        return {p.pid for p in self._servers.values() if p.poll() is None}

    def log(self, i: int) -> str:
        try:
            return (self._dir() / f"sshd-{i}.log").read_text(errors="replace")
        except OSError:
            return ""

    # -- building ---------------------------------------------------------------------------

    def _dir(self) -> Path:
        if self.dir is None:
            raise SimClusterError("container nodes are not started")
        return self.dir

    def _image_etc_ssh(self, i: int) -> None:
        """/etc/ssh as the image has it: the package's defaults, smddp's drop-ins, no host keys."""
        etc = self._dir() / f"etc-ssh-{i}"
        (etc / "sshd_config.d").mkdir(parents=True)
        (etc / "ssh_config.d").mkdir()
        defaults = Path("/usr/share/openssh/sshd_config")  # the package's pristine sshd_config
        shutil.copy(defaults if defaults.exists() else "/etc/ssh/sshd_config", etc / "sshd_config")
        shutil.copy("/etc/ssh/ssh_config", etc / "ssh_config")
        if Path("/etc/ssh/moduli").exists():
            shutil.copy("/etc/ssh/moduli", etc / "moduli")
        shutil.copy(self.deploy / "docker" / "sshd_config", etc / "sshd_config.d" / "smddp.conf")
        shutil.copy(self.deploy / "docker" / "ssh_config", etc / "ssh_config.d" / "smddp.conf")

    def _wait_for_sshd(self) -> None:
        """Until every node's sshd sends its banner (the launch mode waits too; this is for the test)."""
        import time

        probe = (
            "import socket,sys\n"
            "s=socket.create_connection((sys.argv[1],22),timeout=1)\n"
            "sys.exit(0 if s.recv(4)==b'SSH-' else 1)\n"
        )
        deadline = time.monotonic() + SSHD_START_S
        for i in range(self.cluster.config.nodes):
            addr = self.cluster.config.node_addr(i)
            while True:
                p: Any = self.cluster.exec(i, [sys.executable, "-c", probe, addr], capture_output=True)
                if p.returncode == 0:
                    break
                if self._servers[i].poll() is not None:
                    raise SimClusterError(f"entrypoint.sh sshd on node {i} exited: {self.log(i)[-1500:]}")
                if time.monotonic() > deadline:
                    raise SimClusterError(
                        f"sshd on node {i} not up after {SSHD_START_S:g}s: {self.log(i)[-1500:]}"
                    )
                time.sleep(0.1)
