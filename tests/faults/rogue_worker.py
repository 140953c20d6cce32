"""Worker script: rank 1 is authenticated but sends one invalid frame; every rank must fail cleanly."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import smddp
from smddp.proto import DType, Header, Kind, MsgType, ReduceOp
from smddp.proto.frames import SUBMIT_WINDOW

ROGUE_FRAMES = {
    # a slot far outside the segment it names: must never be read or written
    "out of bounds": lambda rank: Header(
        MsgType.SUBMIT,
        sender=rank,
        seq=2,
        shard=0,
        offset=2**40,
        count=1000,
        dtype=DType.FLOAT32,
        op=ReduceOp.SUM,
        kind=Kind.ALLREDUCE,
    ),
    "unknown segment": lambda rank: Header(
        MsgType.SUBMIT,
        sender=rank,
        seq=2,
        shard=77,
        offset=0,
        count=10,
        dtype=DType.FLOAT32,
        op=ReduceOp.SUM,
        kind=Kind.ALLREDUCE,
    ),
    # a SUBMIT further on than the window its daemon takes them in (docs/protocol.md)
    "a number past the window": lambda rank: Header(
        MsgType.SUBMIT,
        sender=rank,
        seq=SUBMIT_WINDOW + 9,
        shard=0,
        offset=0,
        count=10,
        dtype=DType.FLOAT32,
        op=ReduceOp.SUM,
        kind=Kind.ALLREDUCE,
    ),
    # the ring's ATTACH with no fd sent beside it on the side socket
    "an attach without its fd": lambda rank: Header(MsgType.ATTACH, sender=rank, shard=9, offset=4096),
    "another rank's name": lambda rank: Header(MsgType.RELEASE, sender=rank + 1, seq=1),
    "release of nothing": lambda rank: Header(MsgType.RELEASE, sender=rank, seq=1),
    "a daemon's message": lambda rank: Header(MsgType.HEARTBEAT, sender=rank),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--frame", required=True, choices=sorted(ROGUE_FRAMES))
    args = ap.parse_args()
    smddp.init()
    rank = smddp.rank()
    x = np.ones(10, np.float32)
    smddp.allreduce(x)  # collective #1 completes everywhere before anyone misbehaves
    out: dict = {}
    try:
        # #2: every rank has submitted it once the rogue's returns, but the others' DONE may still be
        # on its way when the rogue's frame fails the job, so their barrier may be what raises.
        smddp.barrier()
        if rank == 1:
            frame = ROGUE_FRAMES[args.frame](rank)
            # The transport these frames take (the socket, or the engine's ring), bypassing every
            # client-side check.
            smddp.client()._send_frames([frame.encode()], timeout=5.0)
        smddp.allreduce(x, timeout=30)
        out["outcome"] = "no error"
    except smddp.errors.CollectiveError as e:
        out["outcome"] = type(e).__name__
        out["message"] = str(e)
    except smddp.errors.CollectiveTimeoutError as e:
        out["outcome"] = f"timeout: {e}"
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
