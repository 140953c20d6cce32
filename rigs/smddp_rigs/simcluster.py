"""A simulated multi-node cluster on one Linux host: network namespaces on a bridge, optionally rate-limited and delayed."""

# Topology (all names derive from ClusterConfig.prefix, "smddp" below):
#
#   namespace smddp-sw:  bridge br0, ports p0..p{N-1} (+ "uplink" when ClusterConfig.uplink)
#   namespace smddp-n{i}: lo, eth0 = {subnet}.{10+i}/24, veth peer of p{i}; tbf on eth0 when rate_mbit is set
#   root namespace:      nothing, unless uplink: veth smddp-up = {subnet}.1/24, peer "uplink" on br0
#
# With ClusterConfig.delay_ms the switch namespace has no bridge: its ports are plain veths that a
# forwarder process (smddp_rigs.delayline, compiled in _delayline.c) switches between, holding
# every frame for delay_ms. This kernel has no netem qdisc, so the delay has to be made in userspace.
# A frame crosses the switch once on its way from one node to another, so delay_ms is the one-way
# delay between two nodes (and between a node and the root namespace's uplink), and a round trip
# takes 2 x delay_ms more than without it.
#
# The bridge lives in its own namespace so that, by default, the root namespace has no interface,
# address or route into the cluster (a test checks it cannot reach the nodes). An mpirun started
# in the root namespace does need that path, though: every prted it starts on a node phones home
# to mpirun's TCP listener, which is in the root namespace. ClusterConfig(uplink=True) adds that
# one veth; the nodes then reach the root namespace as {subnet}.1 and nothing else of it.
#
# Host names: network namespaces have no host name or /etc/hosts of their own. Every command that
# runs "on a node" (exec, popen, and the launch agent that mpirun uses as ssh) therefore goes
# through `ip netns exec NS unshare --mount --uts -- sh -c '...'`, which bind-mounts the cluster's
# hosts file (in the cluster's work directory) over /etc/hosts and sets the node's host name, both
# in private namespaces of that command only. So gethostname() says "smddp-n1", and the node names
# resolve to node addresses on every node. Distinct host names matter to Open MPI beyond looks: it
# decides which ranks share a node, and names its per-node session directories, by host name.
# The root namespace needs no name resolution: PRRTE only hands the -H names to the agent.
#
# Cross-namespace mpirun (Open MPI 5.0 / PRRTE 3, the PyPI build), found by experiment:
#   mpirun --allow-run-as-root -H smddp-n0:2,smddp-n1:2 -np 4 \
#       --prtemca plm_ssh_agent AGENT                  # our ssh stand-in (launch_agent_path())
#       --prtemca oob_tcp_if_include 10.77.0.0/24      # prted <-> mpirun over the uplink only
#       --mca btl_tcp_if_include 10.77.0.0/24          # rank <-> rank over the bridge only
#   (cluster.mpirun_args() returns the three options; `--mca plm_rsh_agent AGENT`, the Open MPI 4
#   spelling, is accepted too.) The two if_include options are not strictly needed here, because
#   the nodes have no default route and so fail at once on mpirun's other addresses, but they keep
#   the choice deterministic. Without the uplink, launching fails with "A daemon failed to report
#   back". With PRRTE's default routed_radix (64) mpirun runs the agent for every node itself;
#   with `--prtemca routed_radix 1` each prted starts the next node's from inside its own node,
#   which works as well (ip netns exec takes any namespace from anywhere). The agent passes the
#   caller's environment through (ssh would not), which lets prted find the venv's libraries.
#   A harmless "plm:ssh: Warning: setpgid(...) failed ... Permission denied" may be printed:
#   PRRTE's parent calls setpgid after the agent child has already exec'd.

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

#: Every `ip`/`tc` call is bounded; creating a namespace or link takes milliseconds.
IP_TIMEOUT_S = 15.0
#: Default bound for exec() when the caller gives none.
EXEC_TIMEOUT_S = 60.0
#: How long up() waits for the delay line to open its ports (a Python start-up on a loaded machine).
DELAYLINE_START_S = 20.0
#: How long down() waits for the delay line to exit after SIGTERM, then after SIGKILL.
DELAYLINE_STOP_S = 5.0
#: One-way delays above this are refused: a typo, not a network.
MAX_DELAY_MS = 1000.0
#: Where the CLI keeps what `up` created, so that a later `down` or `exec` can find it (tmpfs: a
#: reboot wipes it together with the namespaces it describes).
STATE_DIR = Path("/run/smddp-simcluster")

BRIDGE = "br0"
NODE_IF = "eth0"
SWITCH_UPLINK_IF = "uplink"
#: Linux interface names are at most 15 bytes; "{prefix}-up" is the one name the prefix shapes.
_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,11}$")

# Run inside `ip netns exec NS unshare --mount --uts --`: $1 hosts file, $2 host name, then argv.
# unshare's new mount namespace is private, so the bind mount never reaches the host's /etc/hosts.
_ENTER = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


class SimClusterError(RuntimeError):
    """A step of building or tearing down the simulated cluster failed."""


@dataclass(frozen=True)
class ClusterConfig:
    """What cluster to build; uplink=True also connects the root namespace (needed by mpirun).

    delay_ms: one-way delay added to every frame crossing the switch (a userspace delay line
    replaces the bridge; see the module's notes).
    """

    nodes: int
    rate_mbit: float | None = None
    burst: str = "256kb"
    prefix: str = "smddp"
    subnet: str = "10.77.0"
    uplink: bool = False
    delay_ms: float | None = None

    def __post_init__(self) -> None:
        # Node addresses are {subnet}.10 .. {subnet}.254.
        if not 1 <= self.nodes <= 245:
            raise SimClusterError(f"nodes must be 1..245, not {self.nodes}")
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise SimClusterError(f"rate_mbit must be positive, not {self.rate_mbit}")
        if self.delay_ms is not None and not 0 <= self.delay_ms <= MAX_DELAY_MS:
            raise SimClusterError(f"delay_ms must be 0..{MAX_DELAY_MS:g}, not {self.delay_ms}")
        if not _PREFIX_RE.match(self.prefix):
            raise SimClusterError(
                f"prefix {self.prefix!r}: 1-12 letters, digits or _, starting with a letter"
            )
        try:
            net = ipaddress.ip_network(f"{self.subnet}.0/24")
        except ValueError as e:
            raise SimClusterError(f"subnet {self.subnet!r} is not three octets of an IPv4 address") from e
        if not net.is_private:
            raise SimClusterError(f"subnet {self.subnet}.0/24 is not a private range")
        if not re.fullmatch(r"[0-9]+(\.[0-9]+)?[a-zA-Z]*", self.burst):
            raise SimClusterError(f"burst {self.burst!r} is not a tc size such as 256kb")

    @property
    def cidr(self) -> str:
        return f"{self.subnet}.0/24"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def uplink_if(self) -> str:
        return f"{self.prefix}-up"

    @property
    def uplink_addr(self) -> str:
        return f"{self.subnet}.1"

    def node_name(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    def switch_ports(self) -> list[str]:
        """The switch namespace's ports: p0..p{N-1}, then the uplink's if there is one."""
        return [f"p{i}" for i in range(self.nodes)] + ([SWITCH_UPLINK_IF] if self.uplink else [])

    def node_addr(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"


def _tool(name: str) -> str:
    # Absolute paths: the agent may run under a prted whose PATH lacks /usr/sbin.
    found = shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin") if os.access(p := f"{d}/{name}", os.X_OK)),
        None,
    )
    if not found:
        raise SimClusterError(f"{name} not found: install iproute2 / util-linux")
    return found


def _run(
    argv: Sequence[str], *, check: bool = True, timeout: float = IP_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise SimClusterError(f"{shlex.join(argv)} timed out after {timeout:g}s") from e
    if check and proc.returncode:
        raise SimClusterError(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_netns() -> list[str]:
    """Names of the named network namespaces (`ip netns list` prints "name (id: N)" lines)."""
    out = _run([_tool("ip"), "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_root_links() -> list[str]:
    """Interface names in the root namespace (this process's namespace)."""
    out = _run([_tool("ip"), "-j", "link", "show"]).stdout
    return [link["ifname"] for link in json.loads(out or "[]")]


def _pid_alive(pid: int) -> bool:
    # A zombie has left its namespaces already; its parent (often the caller, via popen()) reaps it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def netns_pids(ns: str) -> list[int]:
    """The processes in a namespace (this one excepted)."""
    out = _run([_tool("ip"), "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_netns_pids(ns: str, grace_s: float = 2.0) -> None:
    """End the processes still in a namespace, which would otherwise keep its veths alive."""
    _end_pids(netns_pids(ns), grace_s)


def _end_pids(pids: list[int], grace_s: float) -> None:
    """SIGTERM, and after `grace_s` SIGKILL, whichever of `pids` are still alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _pid_alive(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            return


def _delete_netns(ns: str) -> None:
    if ns not in list_netns():
        return
    _kill_netns_pids(ns)
    _run([_tool("ip"), "netns", "delete", ns])


def _delete_root_link(name: str) -> None:
    if name in list_root_links():
        # Deleting one end of a veth deletes its peer too; "Cannot find device" means a race with that.
        proc = _run([_tool("ip"), "link", "delete", "dev", name], check=False)
        if proc.returncode and name in list_root_links():
            raise SimClusterError(f"ip link delete {name} failed: {proc.stderr.strip()}")


def _state_file(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}.json"


def cleanup_stale(prefix: str) -> list[str]:
    """Remove the namespaces and root links named "{prefix}-..." that a crashed run left; returns their names."""
    if not _PREFIX_RE.match(prefix):
        raise SimClusterError(f"refusing to clean up with prefix {prefix!r}")
    removed: list[str] = []
    # Root links first: a root-side veth dies with its peer's namespace only once that is freed.
    for link in list_root_links():
        if link.startswith(f"{prefix}-"):
            _delete_root_link(link)
            removed.append(link)
    # Nodes before the switch, mirroring down(); deleting any order works, this one is tidier.
    stale = [ns for ns in list_netns() if ns.startswith(f"{prefix}-")]
    for ns in sorted(stale, key=lambda n: n == f"{prefix}-sw"):
        _delete_netns(ns)
        removed.append(ns)
    # The CLI's record and work directory of that cluster, if it was the CLI's.
    state = _state_file(prefix)
    if state.exists():
        try:
            workdir = json.loads(state.read_text()).get("workdir")
            if workdir and Path(workdir).parent == STATE_DIR:
                shutil.rmtree(workdir, ignore_errors=True)
        except (OSError, ValueError):
            pass
        state.unlink(missing_ok=True)
    try:
        STATE_DIR.rmdir()  # only when no other prefix's cluster is recorded there
    except OSError:
        pass
    return removed


# The launch agent. mpirun (PRRTE's ssh launcher) runs it as `AGENT [ssh options] HOST COMMAND...`;
# like sshd it joins COMMAND's words with spaces and hands the string to the login shell.
_AGENT_BODY = r"""
import os
import pwd
import sys

# ssh(1) options that take an argument; every other option letter is a flag.
WITH_ARG = set("BbcDEeFIiJLlmOoPpQRSWw")


def main(args):
    i = 0
    while i < len(args) and args[i].startswith("-") and len(args[i]) > 1:
        opt = args[i]
        i += 1
        if opt == "--":
            break
        for j, ch in enumerate(opt[1:], start=1):
            if ch in WITH_ARG:
                if j == len(opt) - 1:
                    i += 1  # "-p 22": the argument is the next word; "-p22", "-oX=y": in this one
                break
    if i >= len(args):
        sys.stderr.write("usage: agent [ssh options] HOST [COMMAND ...]\n")
        return 255
    host = args[i].rsplit("@", 1)[-1]  # user@host: the user is ignored, everything runs as the caller
    if host not in NODES:
        sys.stderr.write(f"agent: unknown host {host!r}; nodes: {sorted(set(n for n, _ in NODES.values()))}\n")
        return 255  # what ssh returns when it cannot reach the host
    ns, name = NODES[host]
    try:
        shell = pwd.getpwuid(os.getuid()).pw_shell
    except KeyError:
        shell = ""
    if not shell or not os.access(shell, os.X_OK):
        shell = "/bin/sh"
    words = args[i + 1:]
    command = [shell, "-c", " ".join(words)] if words else [shell, "-l"]
    argv = [IP, "netns", "exec", ns, UNSHARE, "--mount", "--uts", "--", "/bin/sh", "-c", ENTER, "sh", HOSTS, name]
    os.execv(IP, argv + command)


sys.exit(main(sys.argv[1:]))
"""


class SimCluster:
    """N network namespaces on one bridge; use as `with SimCluster(cfg) as c:` or up()/down()."""

    def __init__(self, config: ClusterConfig, workdir: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        # A caller-given workdir is the caller's to keep; one we make, down() removes.
        self._workdir: Path | None = Path(workdir) if workdir is not None else None
        self._own_workdir = workdir is None
        self._namespaces: list[str] = []  # created by us, in creation order
        self._root_links: list[str] = []
        self._is_up = False
        # The delay line's process (delay_ms): a Popen when we started it, else a pid from the CLI's state.
        self._delayline: subprocess.Popen[bytes] | None = None
        self._delayline_pid: int | None = None
        #: The delay line's counters (smddp_rigs.delayline.summarize), read when down() stopped it.
        self.delayline_stats: dict[str, Any] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def up(self) -> SimCluster:
        """Build the cluster; on any failure, remove what was built and re-raise."""
        if self._is_up:
            return self
        cfg = self.config
        if cfg.delay_ms is not None:
            from smddp_rigs.delayline import DelayLineError, load_extension

            try:
                load_extension()  # before anything is built: say at once why a delayed cluster cannot start
            except DelayLineError as e:
                raise SimClusterError(f"delay_ms={cfg.delay_ms:g}: {e}") from e
        self._check_free()
        try:
            if self._workdir is None:
                self._workdir = Path(tempfile.mkdtemp(prefix=f"{cfg.prefix}-simcluster-"))
            self._workdir.mkdir(parents=True, exist_ok=True)
            self._write_hosts_file()
            self._write_agent()
            self._build_network()
            if cfg.delay_ms is not None:
                self._start_delayline()
        except BaseException:
            self.down()
            raise
        self._is_up = True
        return self

    def down(self) -> None:
        """Remove everything up() created; idempotent, and safe after a partial up()."""
        errors: list[str] = []
        # The delay line first: its sockets are on the ports that the deletions below remove.
        try:
            self._stop_delayline()
        except Exception as e:
            errors.append(str(e))
        for link in reversed(self._root_links):
            try:
                _delete_root_link(link)
            except Exception as e:
                errors.append(str(e))
        # Nodes first, then the switch (created first): the reverse of up().
        for ns in reversed(self._namespaces):
            try:
                _delete_netns(ns)
            except Exception as e:
                errors.append(str(e))
        if self._own_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self._root_links, self._namespaces = [], []
        self._is_up = False
        if errors:
            raise SimClusterError("teardown incomplete: " + "; ".join(errors))

    def __enter__(self) -> SimCluster:
        return self.up()  # up() tears down itself if it fails, as __exit__ would not run then

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def lose(self, i: int) -> None:
        """Node i is lost, as if it lost power: every process in it SIGKILLed at once, then its
        namespace (and with it its link to the switch) deleted, so nothing reaches it any more."""
        ns = self.netns(i)
        pids = netns_pids(ns)
        for pid in pids:  # no SIGTERM first: nothing on a lost node gets to clean up or say goodbye
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        _delete_netns(ns)
        # A lost machine's disk goes with it; a simulated node's /tmp is this machine's. What its killed
        # PRRTE daemons left there (their session directories, with PMIx rendezvous files) would meet a
        # later process given the same pid: PMIx then fails that process's start ("the listener
        # thread failed to start"), which once failed an unrelated CI job here.
        for pid in pids:
            shutil.rmtree(os.path.join(tempfile.gettempdir(), f"prted.{pid}"), ignore_errors=True)

    def revive(self, i: int) -> None:
        """A fresh node i where a lost one was (a replacement machine with the same name and address):
        a new namespace and link, nothing running in it."""
        self._check_index(i)
        if self.config.delay_ms is not None:
            raise SimClusterError(
                "revive: not on a cluster with a delay line (its ports are the delay line's)"
            )
        if self.netns(i) in list_netns():
            raise SimClusterError(f"revive: node {i} ({self.netns(i)}) is not lost")
        self._add_node(i)

    def pids(self, i: int) -> list[int]:
        """The processes running in node i."""
        return netns_pids(self.netns(i))

    def set_link(self, i: int, up: bool) -> None:
        """Node i's link to the switch down (cut: nothing reaches it, its processes keep running) or up."""
        self._ip("-n", self.netns(i), "link", "set", "dev", NODE_IF, "up" if up else "down")

    # -- queries ---------------------------------------------------------------------------

    def hosts(self) -> list[str]:
        return [self.config.node_name(i) for i in range(self.config.nodes)]

    def addr(self, i: int) -> str:
        self._check_index(i)
        return self.config.node_addr(i)

    def netns(self, i: int) -> str:
        self._check_index(i)
        return self.config.node_name(i)  # a node's namespace has the node's name

    def index(self, node: str | int) -> int:
        """A node's index from its index, name or address."""
        if isinstance(node, int) or node.isdigit():
            i = int(node)
            self._check_index(i)
            return i
        for i in range(self.config.nodes):
            if node in (self.config.node_name(i), self.config.node_addr(i)):
                return i
        raise SimClusterError(f"no node {node!r}; nodes: {self.hosts()}")

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise SimClusterError("cluster is not up")
        return self._workdir

    def hosts_file_path(self) -> Path:
        return self.workdir / "hosts"

    def launch_agent_path(self) -> str:
        """An executable ssh stand-in: `agent [ssh options] HOST COMMAND...` runs COMMAND on HOST."""
        return str(self.workdir / "agent")

    def host_list(self, slots: int) -> str:
        """An mpirun -H value with `slots` slots on every node: "p-n0:2,p-n1:2"."""
        return ",".join(f"{h}:{slots}" for h in self.hosts())

    def mpirun_args(self) -> list[str]:
        """The mpirun options that launch across the nodes from the root namespace (needs uplink=True)."""
        if not self.config.uplink:
            raise SimClusterError("mpirun in the root namespace needs ClusterConfig(uplink=True)")
        return [
            # PRRTE's ssh launcher runs our agent instead of ssh (the Open MPI 4 name was plm_rsh_agent).
            *("--prtemca", "plm_ssh_agent", self.launch_agent_path()),
            # mpirun advertises all its addresses to prted; only the uplink one is reachable from a node.
            *("--prtemca", "oob_tcp_if_include", self.config.cidr),
            # Ranks would otherwise also try the host's other interfaces' addresses in their modex.
            *("--mca", "btl_tcp_if_include", self.config.cidr),
        ]

    # -- running commands on a node ----------------------------------------------------------

    def node_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs argv on node i, with the node's host name and hosts file."""
        return [
            _tool("ip"),
            *("netns", "exec", self.netns(i)),
            *(_tool("unshare"), "--mount", "--uts", "--"),
            *("/bin/sh", "-c", _ENTER, "sh", str(self.hosts_file_path()), self.config.node_name(i)),
            *argv,
        ]

    def exec(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """subprocess.run(argv) on node i; kwargs go to subprocess.run (timeout defaults to 60 s)."""
        kwargs.setdefault("timeout", EXEC_TIMEOUT_S)
        return subprocess.run(self.node_argv(i, argv), **kwargs)

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """subprocess.Popen(argv) on node i, for servers; down() ends whatever is still running."""
        return subprocess.Popen(self.node_argv(i, argv), **kwargs)

    # -- state for the CLI -----------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "workdir": str(self.workdir),
            "namespaces": list(self._namespaces),
            "root_links": list(self._root_links),
            "delayline_pid": self._delayline.pid if self._delayline is not None else self._delayline_pid,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SimCluster:
        """A handle on a cluster that another process brought up; down() removes it and its workdir."""
        c = cls(ClusterConfig(**state["config"]), workdir=state["workdir"])
        c._own_workdir = True
        c._namespaces = list(state["namespaces"])
        c._root_links = list(state["root_links"])
        c._delayline_pid = state.get("delayline_pid")
        c._is_up = True
        return c

    # -- building --------------------------------------------------------------------------

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.config.nodes:
            raise SimClusterError(f"node index {i} out of range 0..{self.config.nodes - 1}")

    def _check_free(self) -> None:
        """Refuse to start over names in use: down() would otherwise delete someone else's namespaces."""
        cfg = self.config
        wanted = {cfg.switch_ns, *self.hosts()}
        taken = sorted(wanted & set(list_netns()))
        if cfg.uplink and cfg.uplink_if in list_root_links():
            taken.append(cfg.uplink_if)
        if taken:
            raise SimClusterError(
                f"already in use: {taken}; remove a crashed run's leftovers with "
                f"cleanup_stale({cfg.prefix!r}) or `python -m smddp_rigs.simcluster down --prefix {cfg.prefix}`"
            )
        if cfg.uplink:
            # A root route to (part of) our /24 would make the uplink's own route ambiguous.
            ours = ipaddress.ip_network(cfg.cidr)
            for route in _run([_tool("ip"), "-4", "route", "show"]).stdout.splitlines():
                dst = route.split()[0] if route.strip() else "default"
                if dst == "default":
                    continue
                try:
                    net = ipaddress.ip_network(dst, strict=False)
                except ValueError:
                    continue
                if net.overlaps(ours) and net.prefixlen >= ours.prefixlen:
                    raise SimClusterError(f"the root namespace already routes into {cfg.cidr}: {route!r}")

    def _write_hosts_file(self) -> None:
        cfg = self.config
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if cfg.uplink:
            lines.append(f"{cfg.uplink_addr}\t{cfg.prefix}-root")
        lines += [f"{cfg.node_addr(i)}\t{cfg.node_name(i)}" for i in range(cfg.nodes)]
        self.hosts_file_path().write_text("\n".join(lines) + "\n")

    def _write_agent(self) -> None:
        cfg = self.config
        nodes: dict[str, tuple[str, str]] = {}
        for i in range(cfg.nodes):
            nodes[cfg.node_name(i)] = nodes[cfg.node_addr(i)] = (cfg.node_name(i), cfg.node_name(i))
        header = [
            f"#!{sys.executable}",
            '"""ssh stand-in for a smddp SimCluster; written by smddp_rigs.simcluster."""',
            f"NODES = {nodes!r}",
            f"HOSTS = {str(self.hosts_file_path())!r}",
            f"IP = {_tool('ip')!r}",
            f"UNSHARE = {_tool('unshare')!r}",
            f"ENTER = {_ENTER!r}",
        ]
        path = Path(self.launch_agent_path())
        path.write_text("\n".join(header) + "\n" + _AGENT_BODY)
        path.chmod(0o755)

    def _ip(self, *args: str) -> None:
        _run([_tool("ip"), *args])

    def _add_netns(self, ns: str) -> None:
        self._ip("netns", "add", ns)
        if ns not in self._namespaces:  # (a revived node's is already listed)
            self._namespaces.append(ns)  # recorded at once, so a failure right after still removes it
        self._ip("-n", ns, "link", "set", "dev", "lo", "up")

    def _switch_port_up(self, port: str) -> None:
        sw = self.config.switch_ns
        if self.config.delay_ms is None:
            self._ip("-n", sw, "link", "set", "dev", port, "master", BRIDGE, "up")
        else:
            self._ip("-n", sw, "link", "set", "dev", port, "up")  # the delay line's, not a bridge's

    def _add_node(self, i: int) -> None:
        """Node i's namespace, its link to the switch (a veth pair), its address, its line rate."""
        cfg = self.config
        ns, port = cfg.node_name(i), f"p{i}"
        self._add_netns(ns)
        # Created straight inside the two namespaces: no name ever appears in the root one.
        self._ip(
            "link",
            "add",
            "name",
            NODE_IF,
            "netns",
            ns,
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            cfg.switch_ns,
        )
        self._switch_port_up(port)
        self._ip("-n", ns, "addr", "add", f"{cfg.node_addr(i)}/24", "dev", NODE_IF)
        self._ip("-n", ns, "link", "set", "dev", NODE_IF, "up")
        if cfg.rate_mbit is not None:
            # Egress only, like a NIC's line rate: every transfer leaves some node, so each node's
            # sends are capped; receives are not (an incast can exceed one node's rate).
            _run(
                [
                    *(_tool("tc"), "-n", ns, "qdisc", "add", "dev", NODE_IF, "root", "tbf"),
                    *("rate", f"{cfg.rate_mbit:g}mbit", "burst", cfg.burst, "latency", "50ms"),
                ]
            )

    def _build_network(self) -> None:
        cfg = self.config
        sw = cfg.switch_ns
        self._add_netns(sw)
        if cfg.delay_ms is None:
            self._ip("-n", sw, "link", "add", "name", BRIDGE, "type", "bridge")
            self._ip("-n", sw, "link", "set", "dev", BRIDGE, "up")
        elif Path("/proc/sys/net/ipv6").exists():
            # The switch's ports are not bridge ports, so the switch namespace's own stack would send
            # IPv6 router and neighbour solicitations on them, which the delay line would then forward
            # to every node. "default" covers the ports created below.
            _run(
                [
                    *(_tool("ip"), "netns", "exec", sw, _tool("sysctl"), "-q", "-w"),
                    *("net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"),
                ]
            )
        for i in range(cfg.nodes):
            self._add_node(i)
        if cfg.uplink:
            self._ip(
                "link",
                "add",
                "name",
                cfg.uplink_if,
                "type",
                "veth",
                "peer",
                "name",
                SWITCH_UPLINK_IF,
                "netns",
                sw,
            )
            self._root_links.append(cfg.uplink_if)
            self._switch_port_up(SWITCH_UPLINK_IF)
            self._ip("addr", "add", f"{cfg.uplink_addr}/24", "dev", cfg.uplink_if)
            self._ip("link", "set", "dev", cfg.uplink_if, "up")

    def _start_delayline(self) -> None:
        """Start the forwarder in the switch namespace and wait until its ports are open."""
        cfg = self.config
        assert cfg.delay_ms is not None
        # The package's own parent on the path, so that a source checkout that is not installed works too.
        root = str(Path(__file__).resolve().parents[2])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        argv = [
            *(_tool("ip"), "netns", "exec", cfg.switch_ns),
            *(sys.executable, "-m", "smddp_rigs.delayline"),
            *("--ports", ",".join(cfg.switch_ports())),
            *("--delay-us", f"{cfg.delay_ms * 1000:g}"),
            *("--stats", str(self._delayline_stats_path())),
        ]
        log = self._delayline_log_path()
        with open(log, "wb") as err:
            # Its own session: a Ctrl-C meant for the caller must not stop the switch before down() does.
            self._delayline = proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                start_new_session=True,
            )
        assert proc.stdout is not None
        got = b""
        deadline = time.monotonic() + DELAYLINE_START_S
        try:
            while b"ready\n" not in got:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SimClusterError(
                        f"delay line not ready after {DELAYLINE_START_S:g}s: {self._delayline_log_tail()}"
                    )
                if select.select([proc.stdout], [], [], left)[0]:
                    chunk = os.read(proc.stdout.fileno(), 256)
                    if not chunk:
                        proc.wait(timeout=DELAYLINE_STOP_S)
                        raise SimClusterError(
                            f"delay line exited ({proc.returncode}) before it was ready: "
                            f"{self._delayline_log_tail()}"
                        )
                    got += chunk
        finally:
            proc.stdout.close()  # it writes nothing else there

    def _delayline_log_path(self) -> Path:
        return self.workdir / "delayline.log"

    def _delayline_stats_path(self) -> Path:
        return self.workdir / "delayline.json"

    def _delayline_log_tail(self) -> str:
        try:
            text = self._delayline_log_path().read_text(errors="replace").strip()
        except OSError:
            return "(no log)"
        return text[-2000:] or "(empty log)"

    def _stop_delayline(self) -> None:
        """SIGTERM the delay line, SIGKILL it if it has not exited within DELAYLINE_STOP_S; keep its counters."""
        proc, pid = self._delayline, self._delayline_pid
        self._delayline, self._delayline_pid = None, None
        if proc is not None:
            _end_pids([proc.pid], DELAYLINE_STOP_S)
            try:
                proc.wait(timeout=DELAYLINE_STOP_S)  # reap it, for its exit status
            except subprocess.TimeoutExpired:
                raise SimClusterError(f"delay line {proc.pid} survived SIGKILL") from None
        elif pid is not None:
            # Another process (the CLI's `up`) started it: end it by pid, if that pid is still it.
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                cmdline = b""
            if b"smddp_rigs.delayline" in cmdline:
                _end_pids([pid], DELAYLINE_STOP_S)
        else:
            return
        try:
            self.delayline_stats = json.loads(self._delayline_stats_path().read_text())
        except (OSError, ValueError, SimClusterError):
            self.delayline_stats = None
        # Anything but a clean exit on SIGTERM (a failed port, a crash, a SIGKILL) is worth an error.
        if proc is not None and proc.returncode != 0:
            raise SimClusterError(f"delay line exited with {proc.returncode}: {self._delayline_log_tail()}")


# -- command line ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m smddp_rigs.simcluster",
        description="A simulated multi-node cluster of network namespaces (needs root).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a cluster and leave it running until `down`")
    up.add_argument("--nodes", type=int, required=True)
    up.add_argument("--rate-mbit", type=float, default=None, help="cap each node's egress (tc tbf)")
    up.add_argument("--burst", default="256kb", help="tbf burst (default 256kb)")
    up.add_argument(
        "--delay-ms",
        type=float,
        default=None,
        help="one-way delay added to every frame (a userspace delay line replaces the bridge)",
    )
    up.add_argument("--subnet", default="10.77.0", help="first three octets (default 10.77.0)")
    up.add_argument(
        "--uplink", action="store_true", help="connect the root namespace as SUBNET.1 (for mpirun)"
    )
    down = sub.add_parser("down", help="remove the cluster and any leftovers with this prefix")
    ex = sub.add_parser("exec", help="run a command on a node: exec NODE -- CMD ...")
    ex.add_argument("node", help="node name, index or address")
    ex.add_argument("--timeout", type=float, default=3600.0, help="seconds before the command is killed")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    for sp in (up, down, ex):
        sp.add_argument("--prefix", default="smddp", help="names of namespaces and links (default smddp)")
    return p


def _load(prefix: str) -> SimCluster:
    path = _state_file(prefix)
    if not path.exists():
        raise SimClusterError(f"no cluster with prefix {prefix!r} is up ({path} missing)")
    return SimCluster.from_state(json.loads(path.read_text()))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "up":
            cfg = ClusterConfig(
                nodes=args.nodes,
                rate_mbit=args.rate_mbit,
                burst=args.burst,
                prefix=args.prefix,
                subnet=args.subnet,
                uplink=args.uplink,
                delay_ms=args.delay_ms,
            )
            if _state_file(cfg.prefix).exists():
                raise SimClusterError(f"a cluster with prefix {cfg.prefix!r} is up; run `down` first")
            STATE_DIR.mkdir(parents=True, exist_ok=True)
            # The work directory (hosts file, agent) must outlive this process: keep it beside the state.
            cluster = SimCluster(cfg, workdir=STATE_DIR / cfg.prefix)
            try:
                cluster.up()
                _state_file(cfg.prefix).write_text(json.dumps(cluster.state(), indent=2))
            except BaseException:
                cluster.down()
                shutil.rmtree(STATE_DIR / cfg.prefix, ignore_errors=True)
                raise
            for i, h in enumerate(cluster.hosts()):
                print(f"{h}\t{cluster.addr(i)}")
            print(f"agent\t{cluster.launch_agent_path()}")
            if cfg.delay_ms is not None:
                print(
                    f"delay\t{cfg.delay_ms:g} ms one-way (delay line pid {cluster.state()['delayline_pid']})"
                )
            if cfg.uplink:
                print(f"mpirun\t{shlex.join(cluster.mpirun_args())} -H {cluster.host_list(1)}")
            return 0
        if args.cmd == "down":
            if _state_file(args.prefix).exists():
                _load(args.prefix).down()
            cleanup_stale(args.prefix)  # also whatever a crashed `up` or library user left
            return 0
        # exec
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise SimClusterError("no command: exec NODE -- CMD ...")
        cluster = _load(args.prefix)
        try:
            return cluster.exec(cluster.index(args.node), command, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"simcluster: command timed out after {args.timeout:g}s", file=sys.stderr)
            return 124
    except SimClusterError as e:
        print(f"simcluster: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
