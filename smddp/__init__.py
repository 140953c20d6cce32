"""smddp: data-parallel gradient averaging with a parameter-server shard on every node."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

# The client's package (light: its names come on first use) before `def client()` below, which then
# holds the name `smddp.client`; imported later, the package would take it over.
import smddp.client as _client_package
from smddp import errors
from smddp.errors import NotInitializedError
from smddp.proto.dtypes import ReduceOp

if TYPE_CHECKING:
    from smddp.client import collectives as _c
    from smddp.client.session import Client, ClientConfig, Handle

__version__ = "0.1.0"

SUM = ReduceOp.SUM
AVG = ReduceOp.AVG
MIN = ReduceOp.MIN
MAX = ReduceOp.MAX

__all__ = [
    "AVG",
    "MAX",
    "MIN",
    "SUM",
    "Client",
    "ClientConfig",
    "Handle",
    "ReduceOp",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_async",
    "allreduce_parts_async",
    "barrier",
    "barrier_async",
    "broadcast",
    "broadcast_async",
    "broadcast_parts_async",
    "errors",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "reduce_scatter",
    "reduce_scatter_async",
    "shutdown",
    "size",
]


def __getattr__(name: str) -> Any:
    """The client's names (Client, ClientConfig, Handle), as smddp.client gives them: on first use, so
    that the daemon and the launcher, which use no client, start without it (and numpy)."""
    if name in _client_package.__all__:
        value = getattr(_client_package, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _NotYet:
    """What `_c` is until the first init(): every collective called before it says so (as one called
    after shutdown() does)."""

    def __getattr__(self, name: str) -> Any:
        raise NotInitializedError("smddp is not initialized: call smddp.init() first")


if not TYPE_CHECKING:
    _c = _NotYet()


class _Default:
    """The process's default client, which the module-level calls use (as torch.distributed's default group)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.client: Client | None = None
        self.used = False  # MPI is finalized after bootstrap, so a process joins one job once

    def get(self) -> Client:
        c = self.client
        if c is None:
            raise NotInitializedError("smddp is not initialized: call smddp.init() first")
        return c


_default = _Default()


def init(config: ClientConfig | None = None, env: Mapping[str, str] | None = None) -> None:
    """Join the job: find this node's daemon (placed there by smddp-launch, or under torchrun by
    `dist.init_process_group("smddp")`) and connect to it. `env`: where to read this worker's place
    (SMDDP_RANK, ...) instead of os.environ."""
    with _default.lock:
        if _default.client is not None:
            return
        if _default.used:
            raise NotInitializedError("smddp.init() after shutdown(): a process can join one job only")
        _default.used = True
        global _c
        from smddp.client import collectives as _c
        from smddp.client.session import Client, ClientConfig

        _default.client = Client.connect(config or ClientConfig.from_env(), env)
        # A script that forgets shutdown() still leaves cleanly (pending work gets a bounded wait).
        atexit.register(shutdown, 30.0)


def shutdown(timeout: float | None = None) -> None:
    """Wait for pending collectives and leave the job; later calls raise NotInitializedError."""
    with _default.lock:
        c, _default.client = _default.client, None
    if c is not None:
        c.shutdown(timeout)


def is_initialized() -> bool:
    return _default.client is not None


def client() -> Client:
    """The default client, for front ends that need more than the module-level calls."""
    return _default.get()


def rank() -> int:
    return _default.get().rank


def size() -> int:
    return _default.get().size


def local_rank() -> int:
    return _default.get().local_rank


def local_size() -> int:
    return _default.get().local_size


def allreduce_async(buf: Any, op: ReduceOp = SUM, *, stream: Any = None) -> Handle:
    """Start an in-place all-reduce of `buf`; the handle's wait() returns `buf`.

    `buf` may be host memory or CUDA memory (CuPy, torch, __cuda_array_interface__, DLPack);
    `stream` (device buffers only) is the stream `buf` is produced on and its result used on.
    """
    return _c.allreduce_async(_default.get(), buf, op, stream)


def allreduce(buf: Any, op: ReduceOp = SUM, timeout: float | None = None, *, stream: Any = None) -> Any:
    """All-reduce `buf` in place across every rank and return it."""
    return _c.allreduce(_default.get(), buf, op, timeout, stream)


def allreduce_parts_async(parts: Any, op: ReduceOp = SUM) -> Handle:
    """All-reduce the concatenation of `parts` (host arrays of one dtype), each copied straight into
    shared memory (a framework's fusion buffer without a packing copy); wait() returns a new 1-D array."""
    return _c.allreduce_parts_async(_default.get(), parts, op)


def broadcast_parts_async(parts: Any, root: int = 0) -> Handle:
    """Root's `parts`, concatenated, on every rank: wait() returns a new 1-D array (see allreduce_parts_async)."""
    return _c.broadcast_parts_async(_default.get(), parts, root)


def broadcast_async(buf: Any, root: int = 0, *, stream: Any = None) -> Handle:
    return _c.broadcast_async(_default.get(), buf, root, stream)


def broadcast(buf: Any, root: int = 0, timeout: float | None = None, *, stream: Any = None) -> Any:
    """Overwrite `buf` on every rank with root's `buf`; returns `buf`."""
    c = _default.get()
    return _c.waited(c, lambda: _c.broadcast_async(c, buf, root, stream), timeout)


def allgather_async(buf: Any, out: Any = None, *, stream: Any = None) -> Handle:
    return _c.allgather_async(_default.get(), buf, out, stream)


def allgather(buf: Any, out: Any = None, timeout: float | None = None, *, stream: Any = None) -> Any:
    """Every rank's `buf` stacked in rank order: a new array of shape (size, *buf.shape), or `out`."""
    c = _default.get()
    return _c.waited(c, lambda: _c.allgather_async(c, buf, out, stream), timeout)


def reduce_scatter_async(buf: Any, op: ReduceOp = SUM, out: Any = None, *, stream: Any = None) -> Handle:
    return _c.reduce_scatter_async(_default.get(), buf, op, out, stream)


def reduce_scatter(
    buf: Any, op: ReduceOp = SUM, out: Any = None, timeout: float | None = None, *, stream: Any = None
) -> Any:
    """Reduce `buf` across ranks and return this rank's 1/size part (rank r gets part r)."""
    c = _default.get()
    return _c.waited(c, lambda: _c.reduce_scatter_async(c, buf, op, out, stream), timeout)


def barrier_async() -> Handle:
    return _c.barrier_async(_default.get())


def barrier(timeout: float | None = None) -> None:
    """Return once every rank has entered the barrier."""
    _c.barrier(_default.get(), timeout)
