"""The engine binding's hot calls, each timed back to back in one job: a blocking fast all-reduce (WorkerChannel.run), allreduce_async(...).wait() (begin, then the record's wait), and the wait of a record that has finished (the binding's own cost, nothing under it).

    python -m smddp_rigs.bench.binding [--np 2] [--size 4096] [--calls 200] [--blocks 60]

Issue 59 asks that the bindings, rewritten on a binding library, be no slower in these calls than the
hand-written CPython ones. Every rank makes the same calls in the same order, in blocks of --calls
back to back (no barrier between calls: what is timed is the call, not a barrier's skew), the three
kinds' blocks interleaved; printed: for each call, the median over blocks of the per-call time, in
microseconds, of the slowest rank. Compare two builds by running this against each in turn, several
times, interleaved (the figures in the issue's note were taken so).
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

CALLS = ("run", "begin.wait", "finished.wait")


def _rank(out: str, size: int, calls: int, blocks: int) -> None:
    import numpy as np

    import smddp

    smddp.init()
    a = np.ones(size // 4, dtype=np.float32)
    done = smddp.allreduce_async(a)
    done.wait()
    times: dict[str, list[float]] = {c: [] for c in CALLS}
    for block in range(blocks + 2):  # the first two blocks warm up
        for c in CALLS:
            t0 = time.perf_counter()
            if c == "run":
                for _ in range(calls):
                    smddp.allreduce(a)
            elif c == "begin.wait":
                for _ in range(calls):
                    smddp.allreduce_async(a).wait()
            else:
                for _ in range(calls):
                    done.wait()
            took = (time.perf_counter() - t0) / calls
            if block >= 2:
                times[c].append(took * 1e6)
    Path(out, f"rank{smddp.rank()}.json").write_text(json.dumps(times))
    smddp.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--blocks", type=int, default=60)
    p.add_argument("--rank", help=argparse.SUPPRESS)  # a rank of the job: its output folder
    a = p.parse_args(argv)
    if a.rank:
        _rank(a.rank, a.size, a.calls, a.blocks)
        return 0
    launch = str(Path(sys.executable).parent / "smddp-launch")
    with tempfile.TemporaryDirectory() as out:
        cmd = [launch, "-np", str(a.np), "--local-nodes", "1", "--", sys.executable, "-m", "smddp_rigs.bench.binding",
               "--size", str(a.size), "--calls", str(a.calls), "--blocks", str(a.blocks), "--rank", out]  # fmt: skip
        subprocess.run(cmd, check=True, timeout=1800, env=os.environ.copy())
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(a.np)]
    for c in CALLS:
        slowest = [max(r[c][i] for r in ranks) for i in range(len(ranks[0][c]))]
        print(f"{c:14s} {statistics.median(slowest):8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
