"""Worker script for the observability tests: a steady stream of collectives, optionally one late rank."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import smddp


def run_torch(iterations: int) -> None:
    """The same collectives as torch calls them on its default group: the C++ backend's, straight to the
    engine's table (no Python a collective), which must leave the same timeline."""
    import torch
    import torch.distributed as dist

    import smddp.torch

    dist.init_process_group("smddp")
    assert smddp.torch.backend_kind() == "native", smddp.torch.backend_kind()
    x = torch.ones(200_000)
    for _ in range(iterations):
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
    dist.broadcast(torch.ones(10, dtype=torch.float64), src=dist.get_world_size() - 1)
    out = torch.empty(3 * dist.get_world_size(), dtype=torch.int32)
    dist.all_gather_into_tensor(out, torch.ones(3, dtype=torch.int32))
    dist.all_reduce(torch.ones(10, dtype=torch.float64))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between collectives")
    ap.add_argument("--late-rank", type=int, default=-1)
    ap.add_argument("--late-s", type=float, default=0.0)
    ap.add_argument(
        "--until-file",
        default="",
        help="after the iterations, go on until this file exists: a test's calls then never outlive the job",
    )
    ap.add_argument("--quiet-file", default="", help="rank 0 writes it when no collective is left")
    ap.add_argument("--linger-s", type=float, default=0.0, help="then every rank waits this long")
    ap.add_argument("--torch", action="store_true", help="the same collectives through torch's C++ backend")
    args = ap.parse_args()
    smddp.init()
    rank = smddp.rank()
    if args.torch:
        run_torch(args.iterations)
    else:
        x = np.ones(200_000, np.float32)
        for _ in range(args.iterations):
            smddp.allreduce(x, op=smddp.AVG)
            time.sleep(args.pause)
        # Rank 0 looks for the file and every rank takes its answer, so that all stop at the same call.
        stop = np.zeros(1, np.int32)
        while args.until_file and not stop[0]:
            smddp.allreduce(x, op=smddp.AVG)
            time.sleep(args.pause)
            stop[0] = rank == 0 and os.path.exists(args.until_file)
            smddp.broadcast(stop, root=0)
        smddp.broadcast(np.ones(10), root=smddp.size() - 1)
        smddp.allgather(np.ones(3, np.int32))
        if rank == args.late_rank:
            time.sleep(args.late_s)
        smddp.allreduce(np.ones(10), timeout=120)
    if args.quiet_file and rank == 0:
        with open(args.quiet_file, "w") as f:
            f.write(str(time.time()))
    time.sleep(args.linger_s)
    smddp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
