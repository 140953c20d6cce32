"""One node's all-reduce as copies on one thread: the staging copies smddp makes against cross memory attach (a copy fewer), interleaved.

    python -m smddp_rigs.bench.copies [--workers 4] [--sizes 16M,48M] [--chunk 256K] [--rounds 5] [--huge]

What a copy fewer would buy on this host, measured before building it (docs/performance.md, "A
copy fewer, and the other ways round the copies, measured"). Each of `--workers` child processes
holds a buffer of each size, as a rank holds its gradients. Each way runs one step at a time (one
thread's work, on one core), the two ways in turn:

- staging (what smddp does): each rank copies its buffer into its shared slot in its own process,
  the slots are summed into a result here, each rank copies the result back;
- cma (not built): no slot; a chunk (`--chunk`) of every buffer read by `process_vm_readv` into
  memory that stays in the cache, summed there, and the sum written into every buffer by
  `process_vm_writev`: the ranks' memory is touched once each way, by the kernel.

The ranks' buffers are on 4 KiB pages (torch's CPU allocator asks for no huge pages), or with
--huge on huge pages where the kernel gives them (numpy's large arrays ask for them): the kernel
pins every page it copies, which costs per page. Both ways sum with the daemon's kernel and leave,
in every buffer, the left-to-right float32 sum of the ranks' values (checked to the bit against
one computed here). Printed per size: the median time of each way over the rounds, and cma /
staging. Nothing of smddp's runs but its kernel: it times the copies alone.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from smddp.bench.flags import parse_size
from smddp.bench.report import fmt_size
from smddp.proto.dtypes import DType, ReduceOp
from smddp_rigs import _engine_testing


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _vm_call(name: str) -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, name)
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return fn


@dataclass(frozen=True)
class CopiesConfig:
    workers: int = 4
    sizes: tuple[int, ...] = (16 << 20, 48 << 20)
    chunk: int = 256 << 10
    rounds: int = 5
    huge: bool = False  # the ranks' buffers on huge pages


def _holder(
    conn: Connection,
    sizes: tuple[int, ...],
    seed: int,
    huge: bool,
    slot: dict[int, np.ndarray],
    result: dict[int, np.ndarray],
) -> None:
    """A rank's stand-in: its buffers (filled from `seed`), their addresses sent up; on each request,
    its buffer of that size refilled (the same values every round), copied into its shared slot or
    back from the shared result (smddp's copy in and copy out, a memcpy in the rank's own process),
    or its digest sent."""
    base = {n: _values(seed, n) for n in sizes}
    bufs = {n: _private(n, huge) for n in sizes}
    for n, b in bufs.items():
        np.copyto(b, base[n])
    conn.send({n: b.ctypes.data for n, b in bufs.items()})
    while True:
        msg = conn.recv()
        if msg is None:
            return
        what, n = msg
        if what == "refill":
            np.copyto(bufs[n], base[n])
        elif what == "in":
            np.copyto(slot[n], bufs[n])
        elif what == "out":
            np.copyto(bufs[n], result[n])
        else:
            conn.send(bufs[n].tobytes())
            continue
        conn.send(True)


def _values(seed: int, n: int) -> np.ndarray:
    """Rank `seed`'s values for a buffer of `n` bytes."""
    return np.random.default_rng(seed).standard_normal(n // 4).astype(np.float32)


def _private(n: int, huge: bool) -> np.ndarray:
    """`n` bytes of float32 private to this process, on huge pages where the kernel gives them
    (numpy's own large arrays ask for them) or on 4 KiB pages (torch's allocator asks for none)."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, np.float32)


def _shared(n: int) -> np.ndarray:
    """`n` bytes of float32 in memory every process forked after this shares (as an arena segment)."""
    return np.frombuffer(mmap.mmap(-1, n), np.float32)


class _Ranks:
    """The child processes holding the buffers, their addresses, and the shared slots and result."""

    def __init__(self, cfg: CopiesConfig) -> None:
        ctx = mp.get_context("fork")
        self.slots = [{n: _shared(n) for n in cfg.sizes} for _ in range(cfg.workers)]
        self.result = {n: _shared(n) for n in cfg.sizes}
        self.conns: list[Connection] = []
        self.procs = []
        for w in range(cfg.workers):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_holder, args=(child, cfg.sizes, w, cfg.huge, self.slots[w], self.result), daemon=True
            )
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.addrs = [c.recv() for c in self.conns]
        self.pids = [int(p.pid or 0) for p in self.procs]
        # Looked up here, once, not in the timed calls.
        self.readv, self.writev = _vm_call("process_vm_readv"), _vm_call("process_vm_writev")

    def ask(self, what: str, n: int) -> list[object]:
        """Every rank in turn (one copy at a time: one thread's work, as the ways are compared)."""
        got = []
        for c in self.conns:
            c.send((what, n))
            got.append(c.recv())
        return got

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(timeout=10)


def _staging(ranks: _Ranks, n: int) -> None:
    """smddp's way, one copy at a time: every rank copies its buffer into its slot, the slots are
    summed into the result, every rank copies the result back."""
    ranks.ask("in", n)
    _sum([s[n] for s in ranks.slots], ranks.result[n])
    ranks.ask("out", n)


def _cma(ranks: _Ranks, n: int, chunk: int, inputs: list[np.ndarray], acc: np.ndarray) -> None:
    """No slot: each chunk of every buffer read into the cache, summed there, written back to all."""
    for off in range(0, n, chunk):
        m = min(chunk, n - off)
        xs = [x[: m // 4] for x in inputs]
        for w, pid in enumerate(ranks.pids):
            _move(ranks.readv, pid, ranks.addrs[w][n] + off, m, xs[w])
        _sum(xs, acc[: m // 4])
        for w, pid in enumerate(ranks.pids):
            _move(ranks.writev, pid, ranks.addrs[w][n] + off, m, acc)


def _sum(xs: list[np.ndarray], out: np.ndarray) -> None:
    """The daemon's kernel (one pass over every input), both ways."""
    _engine_testing.reduce(int(DType.FLOAT32), int(ReduceOp.SUM), xs, out, 0)


def _move(fn: Any, pid: int, remote: int, n: int, local: np.ndarray) -> None:
    here = _IoVec(local.ctypes.data, n)
    there = _IoVec(remote, n)
    got = fn(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
    if got != n:
        err = ctypes.get_errno()
        raise OSError(err, f"{fn.__name__} of {n} bytes from pid {pid}: {os.strerror(err)} (moved {got})")


def run(cfg: CopiesConfig) -> dict[str, dict[str, float]]:
    """Median seconds of each way per size, the ways interleaved round by round; raises if their
    sums differ anywhere by a bit."""
    if cfg.workers < 2 or cfg.chunk <= 0 or cfg.chunk % 4 or any(n % 4 for n in cfg.sizes):
        raise ValueError("at least 2 workers, and a chunk and sizes that are whole float32s")
    ranks = _Ranks(cfg)
    out: dict[str, dict[str, float]] = {}
    try:
        for n in cfg.sizes:
            inputs = [np.zeros(cfg.chunk // 4, np.float32) for _ in range(cfg.workers)]
            acc = np.zeros(cfg.chunk // 4, np.float32)
            times: dict[str, list[float]] = {"staging": [], "cma": []}
            digests: dict[str, list[object]] = {}
            for _ in range(cfg.rounds):
                for way in ("staging", "cma"):
                    ranks.ask("refill", n)
                    t0 = time.perf_counter()
                    if way == "staging":
                        _staging(ranks, n)
                    else:
                        _cma(ranks, n, cfg.chunk, inputs, acc)
                    times[way].append(time.perf_counter() - t0)
                    digests[way] = ranks.ask("digest", n)
            want = _values(0, n)
            for w in range(1, cfg.workers):
                want += _values(w, n)  # left to right, in float32: the kernel's fold
            for way, got in digests.items():
                if any(g != want.tobytes() for g in got):
                    raise AssertionError(f"{n} bytes: {way} left another sum than the ranks' values make")
            out[str(n)] = {way: statistics.median(ts) for way, ts in times.items()}
    finally:
        ranks.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m smddp_rigs.bench.copies", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sizes", default="16M,48M")
    ap.add_argument("--chunk", default="256K")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--huge",
        action="store_true",
        help="the ranks' buffers on huge pages (numpy's large arrays ask for them)",
    )
    a = ap.parse_args(argv)
    cfg = CopiesConfig(
        workers=a.workers,
        sizes=tuple(parse_size(s) for s in a.sizes.split(",")),
        chunk=parse_size(a.chunk),
        rounds=a.rounds,
        huge=a.huge,
    )
    res = run(cfg)
    pages = "huge pages" if cfg.huge else "4 KiB pages"
    print(
        f"{cfg.workers} ranks' buffers on {pages}, one thread, chunks of {cfg.chunk >> 10} KiB, median of {cfg.rounds}:"
    )
    for n, t in res.items():
        ratio = t["cma"] / t["staging"]
        print(
            f"  {fmt_size(int(n))}: staging {t['staging'] * 1e3:.2f} ms, cma {t['cma'] * 1e3:.2f} ms,"
            f" cma/staging {ratio:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
