"""Worker script: bad arguments are refused locally and leave the job working; a mismatch fails every rank."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import smddp
from smddp import errors


def refused(fn, *args, **kwargs) -> str:  # type: ignore[no-untyped-def]
    try:
        fn(*args, **kwargs)
    except errors.InvalidArgumentError as e:
        return f"{type(e).__name__}: {e}"
    return "NOT REFUSED"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=["count", "root", "early", "pieces"], default="count")
    args = ap.parse_args()
    out: dict = {}
    try:
        smddp.rank()
    except errors.NotInitializedError as e:
        out["before_init"] = str(e)
    smddp.init()
    rank, world = smddp.rank(), smddp.size()
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    out["refusals"] = {
        "non_contiguous": refused(smddp.allreduce, np.ones((4, 4), np.float32)[:, 1]),
        "int16": refused(smddp.allreduce, np.ones(4, np.int16)),
        "complex": refused(smddp.allreduce, np.ones(4, np.complex64)),
        "read_only": refused(smddp.allreduce, ro),
        "list": refused(smddp.allreduce, [1.0, 2.0]),
        "bad_op": refused(smddp.allreduce, np.ones(4, np.float32), op=7),
        "root_out_of_range": refused(smddp.broadcast, np.ones(4, np.float32), root=world),
        "root_negative": refused(smddp.broadcast, np.ones(4, np.float32), root=-1),
        "reduce_scatter_uneven": refused(smddp.reduce_scatter, np.ones(world + 1, np.float32)),
        "allgather_out_wrong_size": refused(
            smddp.allgather, np.ones(3, np.float32), out=np.ones(2, np.float32)
        ),
    }
    # Nothing was sent for any of those: the job still works and the sequence numbers still agree.
    x = np.full(8, rank + 1, np.float64)
    smddp.allreduce(x)
    out["after_refusals"] = x.tolist()
    try:
        # Nobody can be past this barrier while another rank still waits for the allreduce above, so
        # the mismatch below cannot fail that allreduce; it may fail the barrier on a slower rank.
        smddp.barrier(timeout=60)
        if args.mode == "early":
            # The last rank skips this all-reduce and shuts down: the others must hear so at once,
            # not wait out their timeout.
            if rank == world - 1:
                smddp.shutdown()
                out["mismatch"] = "LEFT EARLY"
                with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
                    json.dump(out, f)
                return 0
            t0 = time.monotonic()
            try:
                smddp.allreduce(np.zeros(6, np.float32), timeout=60)
            finally:
                out["seconds"] = time.monotonic() - t0
        elif args.mode == "count":
            # A mismatch: rank 0 reduces 10 elements, everyone else 12.
            smddp.allreduce(np.zeros(10 if rank == 0 else 12, np.float32), timeout=60)
        elif args.mode == "pieces":
            # Run with --pipeline-kb 4: rank 0's 16 KiB go as 4 pieces of 1024 elements, the others'
            # 8 KiB as 2 pieces of the same size; the piece count in the fingerprint tells them apart.
            smddp.allreduce(np.zeros(4096 if rank == 0 else 2048, np.float32), timeout=60)
        else:
            # Ranks disagree about the root: rank 0 names the last rank, the others rank 0.
            smddp.broadcast(np.zeros(5, np.float32), root=world - 1 if rank == 0 else 0, timeout=60)
        out["mismatch"] = "NO ERROR"
    except errors.CollectiveMismatchError as e:
        out["mismatch"] = str(e)
    try:
        smddp.allreduce(np.zeros(4, np.float32), timeout=60)
        out["later_call"] = "NO ERROR"
    except errors.CollectiveError as e:
        out["later_call"] = f"{type(e).__name__}: {e}"
    smddp.shutdown()
    try:
        smddp.allreduce(np.zeros(4, np.float32))
    except errors.NotInitializedError as e:
        out["after_shutdown"] = str(e)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
