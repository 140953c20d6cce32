"""Worker script: device collectives of known sizes, then a pause while the test reads the daemons' counts.

Each rank runs CASES on stand-in device buffers (what each copies to and from its device is known
from the cases alone: tests/gpu/test_standin.py::test_the_daemons_show_each_ranks_device_copies
works it out), writes `ready-<rank>` into --out, and waits for `go` there before it shuts down, so
that `smddp status` and the metrics are read while the job runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

# (kind, float32 elements): all-reduces whole and asynchronous, a broadcast from rank 0, an all-gather.
CASES = [("allreduce", 1 << 18), ("allreduce_async", 1 << 16), ("broadcast", 1 << 14), ("allgather", 1 << 12)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["SMDDP_DEVICE_RUNTIME"] = "standin"

    import smddp

    smddp.init()
    rank = smddp.rank()
    rt = smddp.client().device_runtime()
    got: dict[str, float] = {}
    for kind, n in CASES:
        x = rt.asarray(np.full(n, rank + 1.0, np.float32))
        if kind == "allreduce":
            got[kind] = float(smddp.allreduce(x, timeout=60).get()[0])
        elif kind == "allreduce_async":
            got[kind] = float(smddp.allreduce_async(x).wait(60).get()[0])
        elif kind == "broadcast":
            got[kind] = float(smddp.broadcast(x, root=0).get()[0])
        else:
            got[kind] = float(smddp.allgather(x).get().sum())
    rt.synchronize()
    with open(os.path.join(args.out, f"ready-{rank}.json"), "w") as f:
        json.dump(got, f)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(args.out, "go")):
        if time.monotonic() > deadline:
            return 3  # the test never said go: it failed on its side
        time.sleep(0.05)
    smddp.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
