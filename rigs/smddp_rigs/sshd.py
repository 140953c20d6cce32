"""A real OpenSSH server on every node of a SimCluster, with keys made for the run: mpirun's own ssh launcher, for real."""

# What a user's cluster has and the namespace cluster lacks is an sshd per host: this adds one.
# Everything lives in one directory made for the run (removed by stop()):
#
#   host_key, host_key.pub        the nodes' host key (one for all: they are one machine's namespaces)
#   id_ed25519, id_ed25519.pub    the launcher's key pair; authorized_keys holds the public half
#   known_hosts                   every node's name and address with the host key, so the client
#                                 checks the key strictly (StrictHostKeyChecking yes)
#   ssh_config                    Host entries mapping node names to addresses (the root namespace has
#                                 no /etc/hosts entry for them), the key, the known_hosts, BatchMode
#   sshd-{node}.conf, .log, .pid  each node's server: its address only, keys only, no PAM
#
# A client uses it with `ssh -F ssh_config NODE`; mpirun with PRTE_MCA_plm_ssh_args="-F ssh_config"
# (ssh_env()), which is PRRTE's own knob for the arguments of its default ssh launcher.

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from smddp_rigs.simcluster import SimCluster, SimClusterError, _end_pids

#: Where the run's keys go: root's and mode 755 all the way up, as sshd's StrictModes wants.
KEY_PARENT = "/run"
#: How long start() waits for a node's sshd to accept connections.
SSHD_START_S = 20.0


def find_program(name: str, install: str = "openssh-server openssh-client") -> str:
    """A server program's absolute path (sbin first: PATH may lack it); says what to install if none."""
    for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if os.access(path := f"{d}/{name}", os.X_OK):
            return path
    found = shutil.which(name)
    if not found:
        raise SimClusterError(f"{name} not found: install {install} (apt)")
    return found


def keygen(path: Path, comment: str) -> None:
    """A new ed25519 key pair without a passphrase at `path` and `path`.pub."""
    subprocess.run(
        [find_program("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


class SshNodes:
    """sshd on every node of an up cluster (one with uplink=True for a launcher in the root namespace)."""

    def __init__(self, cluster: SimCluster, port: int = 22) -> None:
        self.cluster = cluster
        self.port = port
        self.dir: Path | None = None
        self._servers: dict[int, subprocess.Popen[bytes]] = {}
        self._revoked: set[int] = set()  # nodes whose sshd no longer accepts the run's key

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> SshNodes:
        """Make the keys and configuration, start every node's sshd and wait until each accepts."""
        try:
            # Not under /tmp: with StrictModes (as on a real host) sshd refuses an authorized_keys
            # below a directory that others can write, and /tmp is one.
            self.dir = Path(tempfile.mkdtemp(prefix=f"{self.cluster.config.prefix}-ssh-", dir=KEY_PARENT))
            self._keygen("host_key")
            self._keygen("id_ed25519")
            shutil.copy(self.dir / "id_ed25519.pub", self.dir / "authorized_keys")
            self._write_client_files()
            for i in range(self.cluster.config.nodes):
                self.start_node(i)
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, i: int) -> None:
        """(Re)start node i's sshd and wait until it accepts connections."""
        d = self._dir()
        name = self.cluster.config.node_name(i)
        conf = d / f"sshd-{name}.conf"
        conf.write_text(self._sshd_config(i))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege-separation directory
        with open(d / f"sshd-{name}.log", "ab") as log:
            self._servers[i] = self.cluster.popen(
                i,
                [find_program("sshd"), "-D", "-e", "-f", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + SSHD_START_S
        while not self._accepts(i):
            proc = self._servers[i]
            if proc.poll() is not None:
                raise SimClusterError(f"sshd on {name} exited ({proc.returncode}): {self.log_tail(i)}")
            if time.monotonic() > deadline:
                raise SimClusterError(f"sshd on {name} not accepting after {SSHD_START_S:g}s")
            time.sleep(0.05)

    def stop_node(self, i: int) -> None:
        """Node i's sshd goes away (the node stays up): connections to it are refused."""
        proc = self._servers.pop(i, None)
        if proc is not None:
            _end_pids([proc.pid], 2.0)
            proc.wait(timeout=5)

    def stop(self) -> None:
        """Stop every sshd and remove the keys and configuration; idempotent."""
        for i in list(self._servers):
            self.stop_node(i)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> SshNodes:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- what clients use --------------------------------------------------------------------

    @property
    def ssh_config(self) -> Path:
        return self._dir() / "ssh_config"

    @property
    def private_key(self) -> Path:
        return self._dir() / "id_ed25519"

    def ssh_env(self) -> dict[str, str]:
        """Environment for an mpirun whose ssh launcher reaches the nodes (PRRTE's plm_ssh_args)."""
        return {"PRTE_MCA_plm_ssh_args": f"-F {self.ssh_config}"}

    def ssh_argv(self, i: int, *command: str) -> list[str]:
        """ssh to node i with this run's configuration."""
        return ["ssh", "-F", str(self.ssh_config), self.cluster.config.node_name(i), *command]

    def revoke_key(self, i: int) -> None:
        """Node i's sshd no longer accepts the run's key (restarted with an empty authorized_keys)."""
        d = self._dir()
        (d / f"empty_keys-{i}").write_text("")
        self.stop_node(i)
        self._revoked.add(i)
        self.start_node(i)

    def restore_node(self, i: int) -> None:
        """Node i's sshd back as start() made it: running, with the run's key."""
        self.stop_node(i)
        self._revoked.discard(i)
        self.start_node(i)

    def server_pids(self) -> set[int]:
        """The listening sshd of every node still serving."""
        return {p.pid for p in self._servers.values() if p.poll() is None}

    def log_tail(self, i: int) -> str:
        try:
            text = (self._dir() / f"sshd-{self.cluster.config.node_name(i)}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text.strip()[-1500:] or "(empty log)"

    # -- building --------------------------------------------------------------------------

    def _dir(self) -> Path:
        if self.dir is None:
            raise SimClusterError("sshd nodes are not started")
        return self.dir

    def _keygen(self, name: str) -> None:
        keygen(self._dir() / name, f"smddp-rig-{name}")

    def _write_client_files(self) -> None:
        d, cfg = self._dir(), self.cluster.config
        host_pub = (d / "host_key.pub").read_text().split()[:2]
        known, entries = [], []
        for i in range(cfg.nodes):
            name, addr = cfg.node_name(i), cfg.node_addr(i)
            known.append(f"{name},{addr} {' '.join(host_pub)}")
            entries.append(f"Host {name}\n    HostName {addr}\n    HostKeyAlias {name}\n")
        (d / "known_hosts").write_text("\n".join(known) + "\n")
        (d / "ssh_config").write_text(
            "".join(entries)
            + "Host *\n"
            + f"    Port {self.port}\n"
            + f"    IdentityFile {d / 'id_ed25519'}\n"
            + "    IdentitiesOnly yes\n"
            + f"    UserKnownHostsFile {d / 'known_hosts'}\n"
            + "    StrictHostKeyChecking yes\n"
            + "    BatchMode yes\n"
            + "    ConnectTimeout 10\n"
            + "    LogLevel ERROR\n"
        )

    def _sshd_config(self, i: int) -> str:
        d, cfg = self._dir(), self.cluster.config
        name = cfg.node_name(i)
        keys = d / (f"empty_keys-{i}" if i in self._revoked else "authorized_keys")
        return (
            f"ListenAddress {cfg.node_addr(i)}:{self.port}\n"
            f"HostKey {d / 'host_key'}\n"
            f"PidFile {d / f'sshd-{name}.pid'}\n"
            f"AuthorizedKeysFile {keys}\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\n"
            "UsePAM no\n"
            "StrictModes yes\n"
            "PermitUserEnvironment no\n"
            "PrintMotd no\n"
            "LogLevel VERBOSE\n"
        )

    def _accepts(self, i: int) -> bool:
        # Probed from inside the node: the root namespace may have no route into the cluster.
        probe = (
            "import socket,sys\n"
            f"s=socket.create_connection(({self.cluster.config.node_addr(i)!r},{self.port}),timeout=1)\n"
            "sys.exit(0 if s.recv(4)==b'SSH-' else 1)\n"
        )
        try:
            return (
                self.cluster.exec(
                    i, [sys.executable, "-c", probe], capture_output=True, timeout=10
                ).returncode
                == 0
            )
        except subprocess.TimeoutExpired:
            return False
