"""Worker script: a wait() that times out leaves the collective in flight and the job usable."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import smddp


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    smddp.init()
    rank, world = smddp.rank(), smddp.size()
    out: dict = {}
    x = np.full(1000, rank + 1.0)
    if rank == world - 1:
        time.sleep(1.5)  # the last rank is late, so the others' short waits run out
    h = smddp.allreduce_async(x)
    t0 = time.monotonic()
    try:
        h.wait(timeout=0.2)
        out["first_wait"] = "completed"
    except smddp.errors.CollectiveTimeoutError as e:
        out["first_wait"] = f"timeout after {time.monotonic() - t0:.2f}s: {e}"
        out["done_after_timeout"] = h.done()
    out["second_wait_ok"] = bool(np.all(h.wait(timeout=60) == world * (world + 1) / 2))
    y = np.full(10, float(rank))
    smddp.allreduce(y, op=smddp.MAX, timeout=60)
    out["later_ok"] = bool(np.all(y == world - 1))
    smddp.shutdown()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
