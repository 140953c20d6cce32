"""One all-reduce the way a training step meets it (a barrier before each call): the blocking call, `allreduce_async(...).wait()` and torch's `dist.all_reduce` on the smddp backend, interleaved, in one smddp-launch job.

    python -m smddp_rigs.bench.calls [--np 4] [--size 4096] [--rounds 400]

Each rank times each call from the end of the barrier to its return. Printed per call: the median
over rounds of the slowest rank's time, and the median over ranks of each rank's own median, each
with its ratio to the blocking call. A rig
(issue 29's targets for the asynchronous calls), not one of the benchmarks behind BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CALLS = ("blocking", "async.wait", "torch")


def worker(out: str, size: int, rounds: int, warmup: int) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist

    import smddp
    import smddp.torch

    smddp.init()
    dist.init_process_group("smddp")
    rank = smddp.rank()
    a = np.ones(size // 4, np.float32)
    t = torch.ones(size // 4)
    run = {
        "blocking": lambda: smddp.allreduce(a),
        "async.wait": lambda: smddp.allreduce_async(a).wait(),
        "torch": lambda: dist.all_reduce(t),
    }
    times: dict[str, list[float]] = {c: [] for c in CALLS}
    for i in range(warmup + rounds):
        for c in CALLS:  # interleaved: every round has one of each
            smddp.barrier()
            t0 = time.perf_counter()
            run[c]()
            if i >= warmup:
                times[c].append(time.perf_counter() - t0)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(times, f)
    dist.destroy_process_group()
    smddp.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smddp_rigs.bench.calls", description=__doc__)
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--size", type=int, default=4096, help="bytes per all-reduce (float32)")
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.size, args.rounds, args.warmup)
    launch = str(Path(sys.executable).parent / "smddp-launch")
    with tempfile.TemporaryDirectory(prefix="smddp-calls-") as out:
        cmd = [launch, "-np", str(args.np), "--", sys.executable, "-m", "smddp_rigs.bench.calls"]
        cmd += [
            "--size",
            str(args.size),
            "--rounds",
            str(args.rounds),
            "--warmup",
            str(args.warmup),
            "--worker",
            out,
        ]
        subprocess.run(cmd, check=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(args.np)]
    med = {c: statistics.median(max(r[c][i] for r in ranks) for i in range(args.rounds)) for c in CALLS}
    # Each rank's own median too: the slowest rank of a round also carries the barrier's skew.
    own = {c: statistics.median(statistics.median(r[c]) for r in ranks) for c in CALLS}
    print(
        f"{args.np} workers on one host, {args.size} B float32, a barrier before each call, {args.rounds} rounds:"
    )
    for c in CALLS:
        print(
            f"  {c:11s} slowest rank: median {med[c] * 1e6:7.1f} us ({med[c] / med['blocking']:.2f}x blocking);"
            f" a rank's own: median {own[c] * 1e6:7.1f} us ({own[c] / own['blocking']:.2f}x blocking)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
