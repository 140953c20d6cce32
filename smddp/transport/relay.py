"""The daemons' bootstrap relayed through a key-value store (torchrun's c10d store) by the worker that started each daemon."""

# Under torchrun there is no MPI world for the daemons: the first worker of each node starts its
# node's daemon with one end of a socket pair, and relays the daemon's bootstrap collectives
# (allgather, bcast: transport/bootstrap.py) through the store torch hands the backend. The daemon
# never talks to the store (it imports no torch, and the store is not authenticated); the worker
# never interprets what it relays. On the pair, one JSON object per line:
#
#   worker -> daemon   {"node": n, "nnodes": N, "job": "hex id"}    once, first (the daemon may have
#                                                                   been started well before: it waits
#                                                                   for this as long as the worker lives)
#   daemon -> worker   {"op": "allgather", "value": V}              -> {"values": [V0, ... VN-1]}
#                      {"op": "bcast", "root": r, "value": V}      -> {"value": Vr}
#                      {"op": "done"}                               the bootstrap is over
#                      {"op": "failed", "why": "..."}              it failed here (every daemon agrees why)
#   worker -> daemon   {"error": "why"}                             instead of an answer: a peer failed
#
# In the store, collective number k of node n is the key "{prefix}{k}/{n}" holding {"v": V} (a bcast:
# "{prefix}{k}/root"); a node whose daemon failed, or whose worker lost it, puts {"error": "why"}
# under "{prefix}failed", which every node's wait looks at too: all fail with that cause at once
# instead of waiting for their timeout.

from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from smddp.errors import BootstrapCancelled, BootstrapError
from smddp.proto.handshake import is_job_hex

#: The longest line either side accepts (an endpoint list of thousands of nodes fits many times).
MAX_LINE = 1 << 22
#: The longest pause between two looks at the store for a key (a bootstrap has three collectives).
POLL_S = 0.02


class KVStore(Protocol):
    """What the relay needs of a store; torch.distributed's Store (TCPStore, PrefixStore) has it."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


class LineConn:
    """One end of the socket pair: JSON lines, each read within a deadline."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._buf = b""

    def send(self, obj: Any) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, timeout: float | None) -> Any:
        """The next line as JSON; None at end of stream; BootstrapError on silence (for `timeout`
        seconds; None: wait until the other end speaks or closes) or garbage."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                raise BootstrapError(f"{self.peer} sent a line longer than {MAX_LINE} bytes")
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not select.select([self.sock], [], [], left)[0]:
                raise BootstrapError(f"{self.peer} said nothing for {timeout:g}s during the bootstrap")
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                return None
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            raise BootstrapError(f"{self.peer} sent something that is not JSON: {line[:80]!r}") from None

    def close(self) -> None:
        self.sock.close()


class RelayComm:
    """The daemon's side: bootstrap collectives asked of the worker that started it (DaemonComm)."""

    def __init__(self, fd: int, timeout: float) -> None:
        """Wait for the worker's greeting for as long as it lives (it may have started this daemon ahead
        of its job); `timeout` bounds each later answer. BootstrapCancelled if it hangs up first."""
        self._conn = LineConn(socket.socket(fileno=fd), "the worker that started this daemon")
        self._timeout = timeout
        hello = self._conn.recv(None)
        if hello is None:
            self._conn.close()
            raise BootstrapCancelled("the worker that started this daemon gave it no job")
        try:
            self.rank, self.size = int(hello["node"]), int(hello["nnodes"])
            self.job = str(hello.get("job", ""))
        except (TypeError, KeyError, ValueError, AttributeError):
            raise BootstrapError(
                f"a malformed greeting from the worker that started this daemon: {hello!r:.80}"
            ) from None
        if not 0 <= self.rank < self.size:
            raise BootstrapError(f"node {self.rank} of {self.size}: not a node of the job")
        if self.job and not is_job_hex(self.job):
            raise BootstrapError(
                f"a malformed job id from the worker that started this daemon: {self.job[:40]!r}"
            )

    def _ask(self, request: dict[str, Any], key: str) -> Any:
        self._conn.send(request)
        answer = self._conn.recv(self._timeout)
        if not isinstance(answer, dict):
            raise BootstrapError("the worker that started this daemon went away during the bootstrap")
        if "error" in answer:
            raise BootstrapError(str(answer["error"]))
        if key not in answer:
            raise BootstrapError(
                f"a malformed answer from the worker that started this daemon: {answer!r:.80}"
            )
        return answer[key]

    def allgather(self, value: Any) -> list[Any]:
        values = self._ask({"op": "allgather", "value": value}, "values")
        if not isinstance(values, list) or len(values) != self.size:
            raise BootstrapError(f"a malformed allgather answer: {values!r:.80}")
        return values

    def bcast(self, value: Any, root: int) -> Any:
        return self._ask({"op": "bcast", "root": root, "value": value}, "value")

    def close(self) -> None:
        try:
            self._conn.send({"op": "done"})
        finally:
            self._conn.close()

    def abort(self, why: str) -> None:
        try:
            self._conn.send({"op": "failed", "why": why})
        except OSError:
            pass  # the worker is gone: nobody to tell
        finally:
            self._conn.close()


class StoreRelay:
    """The worker's side: answers its daemon's bootstrap collectives through `store`.

    `describe` names the daemon in errors (its exit status, once it has ended)."""

    def __init__(
        self, store: KVStore, prefix: str, node: int, nnodes: int, timeout: float, job: str = ""
    ) -> None:
        self.job = job  # the job's id, for a daemon started before it was known ("": it has one)
        self.store = store
        self.prefix = prefix
        self.node = node
        self.nnodes = nnodes
        self.timeout = timeout
        self.step = 0

    def _key(self, step: int, node: int | str) -> str:
        return f"{self.prefix}{step}/{node}"

    def _get(self, key: str, who: str) -> Any:
        """The value under `key`, or the failure any node published, whichever comes first."""
        failed = f"{self.prefix}failed"
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        try:
            while not self.store.check([key]):
                if self.store.check([failed]):
                    key = failed
                    break
                if time.monotonic() > deadline:
                    raise BootstrapError(
                        f"{who} did not take part in the smddp bootstrap within {self.timeout:g}s"
                    )
                time.sleep(pause)
                pause = min(pause * 2, POLL_S)
            raw = self.store.get(key)
        except BootstrapError:
            raise
        except Exception as e:  # torch's store raises its own DistStoreError / RuntimeError
            raise BootstrapError(f"the store failed during the smddp bootstrap: {e}") from None
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not ("v" in obj or "error" in obj):
            raise BootstrapError(f"the store holds a malformed bootstrap value for {who}: {raw[:80]!r}")
        if "error" in obj:
            raise BootstrapError(str(obj["error"]))
        return obj["v"]

    def fail(self, why: str) -> None:
        """Publish `why` as the bootstrap's failure, so that every node ends with it at once."""
        try:
            self.store.set(f"{self.prefix}failed", json.dumps({"error": why}).encode())
        except Exception:  # the store is gone too: the others' own timeouts bound them
            pass

    def serve(self, conn: LineConn, describe: Callable[[], str]) -> None:
        """Relay until the daemon says done. Raises BootstrapError (after telling the other nodes)
        when the daemon ends, goes silent or asks nonsense, or another node failed."""
        conn.send({"node": self.node, "nnodes": self.nnodes, **({"job": self.job} if self.job else {})})
        while True:
            try:
                req = conn.recv(self.timeout)
            except BootstrapError as e:
                why = f"the smddp-daemon of node {self.node}: {e}"
                self.fail(why)
                raise BootstrapError(why) from None
            if req is None:
                why = f"the smddp-daemon of node {self.node} {describe()} during the bootstrap"
                self.fail(why)
                raise BootstrapError(why)
            op = req.get("op") if isinstance(req, dict) else None
            if op == "done":
                return
            if op == "failed":
                why = str(req.get("why"))
                self.fail(why)
                raise BootstrapError(why)
            if op not in ("allgather", "bcast"):
                why = f"the smddp-daemon of node {self.node} asked for {req!r:.80} during the bootstrap"
                self.fail(why)
                raise BootstrapError(why)
            try:
                if op == "allgather":
                    self.store.set(
                        self._key(self.step, self.node), json.dumps({"v": req.get("value")}).encode()
                    )
                    answer: dict[str, Any] = {
                        "values": [
                            self._get(self._key(self.step, n), f"node {n}") for n in range(self.nnodes)
                        ]
                    }
                else:
                    root = int(req.get("root", 0))
                    if root == self.node:
                        self.store.set(
                            self._key(self.step, "root"), json.dumps({"v": req.get("value")}).encode()
                        )
                    answer = {"value": self._get(self._key(self.step, "root"), f"node {root}")}
            except BootstrapError as e:
                # Another node failed: its cause goes to this daemon, which ends with it, and is this
                # worker's error too (not the daemon's ending, which is only its consequence).
                with contextlib.suppress(OSError):  # the daemon may be gone already
                    conn.send({"error": str(e)})
                raise
            self.step += 1
            conn.send(answer)
