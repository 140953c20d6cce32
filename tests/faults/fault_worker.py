"""Worker script for fault injection: runs checked all-reduces until the job fails, and records how."""

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
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--mib", type=float, default=1.0)
    ap.add_argument(
        "--device",
        action="store_true",
        help="device buffers (the stand-in runtime): blocking device all-reduces",
    )
    args = ap.parse_args()
    if args.device:
        os.environ["SMDDP_DEVICE_RUNTIME"] = "standin"
    smddp.init()
    c = smddp.client()
    rank, world = smddp.rank(), smddp.size()
    me = {"rank": rank, "node": c.node, "pid": os.getpid(), "daemon_pid": c.job.daemons[c.node].pid}
    with open(os.path.join(args.out, f"pids{rank}.json"), "w") as f:
        json.dump(me, f)
    x = np.empty(int(args.mib * (1 << 20)) // 4, np.float32)
    dev = c.device_runtime().empty(x.shape, np.float32) if args.device else None
    record: dict = {"rank": rank}
    deadline = time.monotonic() + args.seconds
    i = 0
    try:
        while time.monotonic() < deadline:
            x[:] = rank + 1
            if dev is None:
                smddp.allreduce(x, op=smddp.SUM, timeout=120)
            else:
                dev.set(x)
                smddp.allreduce(dev, op=smddp.SUM, timeout=120)
                dev.get(out=x)
            if not np.all(x == world * (world + 1) / 2):
                record["wrong"] = f"iteration {i}: wrong result"
                break
            i += 1
            if i == 5 and rank == 0:
                open(os.path.join(args.out, "running"), "w").close()
        record.update(outcome="no error", iterations=i)
    except smddp.errors.CollectiveError as e:
        record.update(outcome=type(e).__name__, message=str(e), time=time.time(), iterations=i)
    except smddp.errors.CollectiveTimeoutError as e:
        record.update(outcome="timeout", message=str(e), time=time.time(), iterations=i)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if record["outcome"] != "no error":
        wait_for_reports(args.out, world)
    return 0 if record["outcome"] == "no error" else 1


def wait_for_reports(out: str, world: int, timeout: float = 30.0) -> None:
    """Leave only once every rank still alive has written its report: a non-zero exit makes mpirun
    stop the other workers, possibly before they have written theirs (all ranks share this host)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        missing = [r for r in range(world) if not os.path.exists(os.path.join(out, f"rank{r}.json"))]
        if not any(_alive(out, r) for r in missing):
            return
        time.sleep(0.05)


def _alive(out: str, rank: int) -> bool:
    try:
        with open(os.path.join(out, f"pids{rank}.json")) as f:
            pid = json.load(f)["pid"]
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, ValueError, KeyError, IndexError):
        return False


if __name__ == "__main__":
    sys.exit(main())
