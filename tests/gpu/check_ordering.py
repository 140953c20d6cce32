"""Worker script: is a torch Work's result there for every consumer? (issue 28's raw case)

Each round, every rank fills `inflight` tensors with values of its own, written by a kernel queued
behind a run of work on the current stream, starts `dist.all_reduce(x, async_op=True)` on each,
(or the blocking call) and then reads each result on the current stream through one consumer path:

- wait:     `work.wait()`, then read x
- future:   `work.get_future().wait()`, then read x
- value:    read the tensor the future's `wait()` returned
- then:     read x inside a `get_future().then()` callback, whose value is then waited for
- chained:  `get_future().then(...)` twice, read the last value
- blocking: the call without async_op (torch waits for the Work itself), then read x
- late:     the blocking call made through the group's backend (asyncOp false, completed in the
            caller's thread), keeping its Work; then read x in a `get_future().then()` callback,
            the future asked for only after the Work completed (an all-reduce of x and a spare
            tensor: of one tensor alone the backend returns no Work, as for host tensors)

A consumer that is not ordered after the result's copy to the device reads the rank's own input
(or a mix): every element is compared with the exact result. The same script runs on a GPU (`--device
cuda`) and on the stand-in runtime (under tests/gpu/run_standin.py, `--device standin`), whose
copies are delayed so that a missing order loses its race every time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

import smddp
import smddp.torch

PATHS = ("wait", "future", "value", "then", "chained", "blocking", "late")


class Cuda:
    """The current CUDA stream: a kernel that runs for a while, then the fill, both queued (the host does not wait)."""

    def __init__(self, local_rank: int) -> None:
        self.device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(self.device)

    def empty(self, n: int) -> torch.Tensor:
        return torch.empty(n, device=self.device)

    def produce(self, x: torch.Tensor, value: float) -> None:
        torch.cuda._sleep(3_000_000)  # a few milliseconds of work ahead of the fill
        x.fill_(value)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


class Standin:
    """The stand-in's current stream (torch on the host runs when a stream of the runtime gets there)."""

    def __init__(self) -> None:
        self.rt = smddp.client().device_runtime()

    def empty(self, n: int) -> torch.Tensor:
        return torch.empty(n)

    def produce(self, x: torch.Tensor, value: float) -> None:
        def fill() -> None:
            time.sleep(0.003)  # the run of work ahead of the fill
            x.fill_(value)

        self.rt.launch(self.rt.current_stream(0), fill)

    def sync(self) -> None:
        self.rt.synchronize()


KINDS = ("allreduce", "broadcast", "allgather", "reduce_scatter")


def start(kind: str, x: torch.Tensor, world: int, async_op: bool) -> tuple[Any, torch.Tensor]:
    """Start collective `kind` on input `x`; returns the Work (None for a blocking call) and the
    tensor its result lands in."""
    if kind == "allreduce":
        return dist.all_reduce(x, async_op=async_op), x
    if kind == "broadcast":
        return dist.broadcast(x, src=0, async_op=async_op), x
    if kind == "allgather":
        out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
        return dist.all_gather_into_tensor(out, x, async_op=async_op), out
    if kind == "reduce_scatter":
        out = torch.empty(x.numel() // world, dtype=x.dtype, device=x.device)
        return dist.reduce_scatter_tensor(out, x, async_op=async_op), out
    raise ValueError(kind)


def start_blocking(kind: str, x: torch.Tensor, world: int) -> tuple[Any, torch.Tensor]:
    """Start collective `kind` as torch's blocking call reaches the group's backend (asyncOp false:
    the backend completes it before returning), keeping the Work that torch would wait for and drop."""
    pg = dist.distributed_c10d._get_default_group()
    if kind == "allreduce":
        ar = dist.AllreduceOptions()
        ar.asyncOp = False
        # Two tensors: one alone takes the call's shortest path, which returns no Work to keep.
        return pg.allreduce([x, torch.zeros(1, dtype=x.dtype, device=x.device)], ar), x
    if kind == "broadcast":
        bc = dist.BroadcastOptions()
        bc.rootRank, bc.asyncOp = 0, False
        return pg.broadcast([x], bc), x
    if kind == "allgather":
        out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
        ag = c10d.AllgatherOptions()
        ag.asyncOp = False
        return pg._allgather_base(out, x, ag), out
    if kind == "reduce_scatter":
        out = torch.empty(x.numel() // world, dtype=x.dtype, device=x.device)
        rs = dist.ReduceScatterOptions()
        rs.asyncOp = False
        return pg._reduce_scatter_base(out, x, rs), out
    raise ValueError(kind)


def expected(kind: str, v: float, n: int, rank: int, world: int, like: torch.Tensor) -> torch.Tensor:
    """The exact result on `rank` when rank r's input is all v * (r + 1), in host memory.

    Host memory, so that a reader on any stream sees it whole: a `then()` callback runs on a pool
    stream that waits for the collective and for nothing on the current stream, where a device
    `want` would still be queued behind the producers of the other collectives in flight."""
    total = v * world * (world + 1) // 2
    if kind == "allreduce":
        return torch.full((n,), total, dtype=like.dtype, device="cpu")
    if kind == "broadcast":
        return torch.full((n,), v, dtype=like.dtype, device="cpu")
    if kind == "allgather":
        rows = [torch.full((n,), v * (r + 1), dtype=like.dtype, device="cpu") for r in range(world)]
        return torch.cat(rows)
    return torch.full((n // world,), total, dtype=like.dtype, device="cpu")


def consume(path: str, work: Any, out: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether every element the consumer reads on the current stream is the exact result."""

    def right(t: torch.Tensor) -> bool:
        # The last element first: a copy still landing writes it last, and the full comparison
        # below takes long enough to let a late copy finish meanwhile.
        return bool(t[-1].item() == want[-1].item()) and bool(torch.equal(t.cpu(), want))

    def value(f: Any) -> torch.Tensor:
        v = f.value()
        return v[0] if isinstance(v, list) else v  # [tensors] for in-place collectives

    if path == "blocking":
        return right(out)  # torch waited for the Work in the call
    if path == "wait":
        work.wait()
        return right(out)
    fut = work.get_future()
    if path == "late":  # a pool stream's read, ordered by the future alone
        return bool(fut.then(lambda f: right(out)).wait())
    if path == "future":
        fut.wait()
        return right(out)
    if path == "value":
        fut.wait()
        return right(value(fut))
    if path == "then":
        return bool(fut.then(lambda f: right(out)).wait())
    if path == "chained":
        first: Callable[[Any], torch.Tensor] = lambda f: value(f) * 1  # noqa: E731
        return bool(fut.then(first).then(lambda f: right(f.value())).wait())
    raise ValueError(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cuda", "standin"], required=True)
    ap.add_argument("--sizes", default="262144,4194304,16777216,67108864", help="bytes")
    ap.add_argument("--inflight", default="1,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--kinds", default="allreduce")
    args = ap.parse_args()
    if args.device == "cuda":
        os.environ["SMDDP_DEVICE_RUNTIME"] = "cupy"
    torch.set_num_threads(1)
    smddp.init()
    dist.init_process_group(backend="smddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev: Cuda | Standin = Cuda(smddp.local_rank()) if args.device == "cuda" else Standin()
    rows = []
    for kind in args.kinds.split(","):
        for size in (int(s) for s in args.sizes.split(",")):
            n = size // 4 // world * world  # a reduce-scatter's input splits evenly
            for inflight in (int(k) for k in args.inflight.split(",")):
                for path in args.paths.split(","):
                    wrong = 0
                    for rnd in range(args.rounds):
                        xs = [dev.empty(n) for _ in range(inflight)]
                        vals = [float(1 + i + rnd) for i in range(inflight)]
                        for x, v in zip(xs, vals, strict=True):
                            dev.produce(x, v * (rank + 1))
                        started = [
                            start_blocking(kind, x, world)
                            if path == "late"
                            else start(kind, x, world, path != "blocking")
                            for x in xs
                        ]
                        for (w, out), v in zip(started, vals, strict=True):
                            wrong += not consume(path, w, out, expected(kind, v, n, rank, world, out))
                        dev.sync()
                    rows.append(
                        {
                            "kind": kind,
                            "bytes": size,
                            "inflight": inflight,
                            "path": path,
                            "tried": args.rounds * inflight,
                            "wrong": wrong,
                        }
                    )
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "rows": rows}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
