"""DDP step time on smddp or gloo, and (on smddp) how much gradient reduction overlaps backward.

    smddp-launch -np 4 --local-nodes 2 -- python examples/torch/bench_ddp.py --backend smddp
    smddp-launch -np 4 --local-nodes 2 -- python examples/torch/bench_ddp.py --backend gloo

Rank 0 prints one JSON line of medians over --steps timed steps. On smddp it also records when
each gradient bucket was handed to smddp and when it completed (ProcessGroupSmddp.trace), and
times backward without reduction (`no_sync`) and the reduction alone (the same buckets, no
backward running), so that overlap = backward alone + reduction alone - DDP backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import smddp
import smddp.torch


def model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def med(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 2)  # ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["smddp", "gloo"], default="smddp")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    smddp.init()  # the launcher's daemons wait for every worker, whichever backend trains
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = DDP(model(args.width, args.depth), bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, 256), torch.randint(0, 10, (args.batch,))
    pg = dist.group.WORLD
    trace_on = isinstance(pg, smddp.torch.ProcessGroupSmddp)
    step_t: list[float] = []
    bwd_t: list[float] = []
    overlap: list[dict[str, float]] = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        if trace_on:
            pg.trace = []  # type: ignore[union-attr]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i < args.warmup:
            continue
        step_t.append(t3 - t0)
        bwd_t.append(t2 - t1)
        if trace_on:
            ev = [e for e in pg.trace if e.name == "all_reduce" and t1 <= e.submitted <= t2]  # type: ignore[union-attr]
            last = max(e.submitted for e in ev)  # the last bucket is ready: gradient computation is over
            overlap.append(
                {
                    "buckets": len(ev),
                    "first_submit_ms": (ev[0].submitted - t1) * 1e3,
                    "last_submit_ms": (last - t1) * 1e3,
                    "backward_ms": (t2 - t1) * 1e3,
                    "done_before_last_submit": sum(1 for e in ev if e.done is not None and e.done < last),
                }
            )
    out: dict[str, Any] = {
        "backend": args.backend,
        "world": world,
        "params": sum(p.numel() for p in net.parameters()),
        "step_ms": med(step_t),
        "backward_ms": med(bwd_t),
    }
    # Backward alone (no reduction), then the reduction alone: buckets of the sizes DDP makes, nothing
    # else running. Overlap hides up to min(both); hidden = alone + reduction - DDP backward.
    alone: list[float] = []
    for _ in range(args.steps):
        dist.barrier()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        with net.no_sync():
            t1 = time.perf_counter()
            loss.backward()
            alone.append(time.perf_counter() - t1)
    params = list(reversed(list(net.parameters())))
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, int(args.bucket_mb * (1 << 20))]
    buckets, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    bufs = [torch.ones(sum(params[i].numel() for i in b)) for b in buckets]
    red: list[float] = []
    for _ in range(args.steps):
        dist.barrier()
        t1 = time.perf_counter()
        for w in [dist.all_reduce(b, async_op=True) for b in bufs]:
            w.wait()
        red.append(time.perf_counter() - t1)
    out["buckets"] = len(bufs)
    out["backward_alone_ms"] = med(alone)
    out["reduction_alone_ms"] = med(red)
    out["hidden_ms"] = round(out["backward_alone_ms"] + out["reduction_alone_ms"] - out["backward_ms"], 2)
    if trace_on:
        keys = ["buckets", "first_submit_ms", "last_submit_ms", "backward_ms", "done_before_last_submit"]
        out["trace_median"] = {k: round(statistics.median(o[k] for o in overlap), 2) for k in keys}
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
