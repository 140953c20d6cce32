"""Worker script: times a large all-reduce over shaped links and records it (rank 0 writes the file)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import smddp


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    smddp.init()
    x = np.ones(args.mib * (1 << 20) // 4, np.float32)
    smddp.allreduce(x)  # warm-up: arenas touched, connections busy once
    marks = np.zeros((2, args.repeats), np.float64)
    for i in range(args.repeats):
        x[:] = 1.0
        smddp.barrier()
        marks[0, i] = time.perf_counter()
        smddp.allreduce(x, op=smddp.SUM)
        marks[1, i] = time.perf_counter()
    ok = bool(np.all(x == smddp.size()))
    # Each all-reduce's span: from the first rank's start to the last rank's end (perf_counter is
    # CLOCK_MONOTONIC, one clock for every process here). One rank's own time is shorter by however
    # much later than the others it left the barrier: the others' data was already on its way.
    every = np.asarray(smddp.allgather(marks))
    times = [float(every[:, 1, i].max() - every[:, 0, i].min()) for i in range(args.repeats)]
    daemons = [d.tcp_host for d in smddp.client().job.daemons]
    if smddp.rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times, "ok": ok, "size": smddp.size(), "daemons": daemons}, f)
    smddp.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
