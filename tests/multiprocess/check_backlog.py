"""Worker script: more collectives in flight than the channel's rings hold, none waited for until all
have started, complete bit-exact; past the timeout, a start that waits for them says why."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import smddp

#: More than a ring's 256 slots: before the fix, the done ring filled with DONEs nobody took, the
#: daemon stopped reading the submit ring, and the next start waited for room until the job failed.
MANY = 600


def expected(world: int, i: int, n: int) -> np.ndarray:
    """The sum over ranks of each rank's buffer i (rank r holds i + r + its index, as float64)."""
    return sum(np.arange(n, dtype=np.float64) + i + r for r in range(world))


def flood(rank: int, world: int, out: dict) -> None:
    """MANY asynchronous all-reduces started, the ranks staggered, then waited for in reverse order."""
    time.sleep(0.1 * rank)
    n = 257
    bufs = [np.arange(n, dtype=np.float64) + i + rank for i in range(MANY)]
    handles = [smddp.allreduce_async(b) for b in bufs]
    bad = [
        i
        for i in reversed(range(MANY))
        if not np.array_equal(handles[i].wait(timeout=120), expected(world, i, n))
    ]
    out["numpy_bad"] = bad
    # Started and never waited for: the handles dropped; a blocking call after them still completes,
    # and so do they (their results land in the buffers).
    drops = [np.full(8, float(rank + i)) for i in range(MANY)]
    for d in drops:
        smddp.allreduce_async(d)
    y = np.full(4, float(rank))
    smddp.allreduce(y, timeout=120)
    out["after_drops_ok"] = bool(np.all(y == sum(range(world))))


def flood_torch(rank: int, world: int, out: dict) -> None:
    """The same through torch's smddp backend: Works kept, and Works dropped unwaited."""
    import torch
    import torch.distributed as dist

    import smddp.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("smddp")
    ts = [torch.full((33,), float(i + rank)) for i in range(MANY)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    want = [float(sum(i + r for r in range(world))) for i in range(MANY)]
    out["torch_bad"] = [i for i in range(MANY) if not bool(torch.all(ts[i] == want[i]))]
    dropped = [torch.full((5,), float(i + rank)) for i in range(MANY)]
    for t in dropped:
        dist.all_reduce(t, async_op=True)  # the Work dropped at once
    dist.barrier()
    z = torch.ones(3)
    dist.all_reduce(z)
    out["torch_after_drops_ok"] = bool(torch.all(z == world))
    dist.destroy_process_group()


def late_rank(rank: int, world: int, out: dict, timeout: float) -> None:
    """The last rank comes late: the others start as many as the channel keeps in flight, and the
    next start raises CollectiveTimeoutError after the job's timeout, naming the cause; the late rank
    then joins the ones that went, and they complete."""
    from smddp import _engine

    if rank == world - 1:
        time.sleep(timeout * 2.5)
    # The late rank starts only those the others could: a start of its beyond them would wait for good.
    bufs = [np.full(16, float(rank + i)) for i in range(_engine.MAX_IN_FLIGHT if rank == world - 1 else 400)]
    handles = []
    t0 = time.monotonic()
    try:
        for b in bufs:
            handles.append(smddp.allreduce_async(b))
        out["late_start"] = "all started"
    except smddp.errors.CollectiveTimeoutError as e:
        out["late_start"] = f"timeout after {time.monotonic() - t0:.2f}s: {e}"
    out["late_started"] = len(handles)
    out["max_in_flight"] = _engine.MAX_IN_FLIGHT
    out["late_bad"] = [
        i
        for i, h in enumerate(handles)
        if not np.all(h.wait(timeout=120) == sum(r + i for r in range(world)))
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", choices=["flood", "late"], required=True)
    ap.add_argument("--timeout", type=float, default=0.0, help="the job's --timeout (the late case)")
    args = ap.parse_args()
    smddp.init()
    rank, world = smddp.rank(), smddp.size()
    out: dict = {}
    if args.case == "flood":
        flood(rank, world, out)
        flood_torch(rank, world, out)
    else:
        late_rank(rank, world, out, args.timeout)
    smddp.shutdown()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
