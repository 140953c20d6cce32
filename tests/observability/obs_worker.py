"""Worker script for the observability tests: a steady stream of collectives, optionally one late rank."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import smddp


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between collectives")
    ap.add_argument("--late-rank", type=int, default=-1)
    ap.add_argument("--late-s", type=float, default=0.0)
    ap.add_argument("--quiet-file", default="", help="rank 0 writes it when no collective is left")
    ap.add_argument("--linger-s", type=float, default=0.0, help="then every rank waits this long")
    args = ap.parse_args()
    smddp.init()
    rank = smddp.rank()
    x = np.ones(200_000, np.float32)
    for _ in range(args.iterations):
        smddp.allreduce(x, op=smddp.AVG)
        time.sleep(args.pause)
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
