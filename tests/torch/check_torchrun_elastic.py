"""Worker script under torchrun --nnodes MIN:MAX: each rendezvous round records its smddp job; a round smaller than --want keeps all-reducing until torch elastic restarts it for the node that joins."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import smddp
import smddp.torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--want", type=int, required=True, help="the world size of the round that finishes")
    ap.add_argument(
        "--wait-s", type=float, default=120.0, help="how long a smaller round waits to be restarted"
    )
    args = ap.parse_args()
    dist.init_process_group("smddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    client = smddp.client()
    job = client.job
    x = torch.full((1024,), float(rank + 1))
    dist.all_reduce(x)
    record = {
        "job": job.job_hex,
        "world": world,
        "node": int(os.environ["GROUP_RANK"]),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "sum_ok": bool(torch.all(x == world * (world + 1) / 2)),
        "daemon_pid": job.daemons[client.node].pid,
    }
    with open(os.path.join(args.out, f"round{world}-rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if world < args.want:
        # Training on the nodes there are, until the agent restarts this round for the one that joins.
        deadline = time.monotonic() + args.wait_s
        while time.monotonic() < deadline:
            y = torch.ones(1024)
            dist.all_reduce(y)
            time.sleep(0.02)
        return 3  # never restarted: the test fails on this status
    for _ in range(20):
        y = torch.ones(4096)
        dist.all_reduce(y)
        assert torch.all(y == world)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
