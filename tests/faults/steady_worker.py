"""Worker script: checked collectives until a stop file appears; publishes the endpoints for attackers."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import smddp


def publish(c: smddp.Client, out: str, with_secret: bool) -> None:
    """Write the daemons' endpoints (and the secret, if asked) where the test finds them."""
    eps = [
        {"node": d.node, "tcp": [d.tcp_host, d.tcp_port], "unix": d.socket_path, "pid": d.pid}
        for d in c.job.daemons
    ]
    info = {"endpoints": eps, "job_id": c.job.job_id.hex()}
    if with_secret:
        info["secret"] = c.job.secret.hex()
    tmp = os.path.join(out, "endpoints.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.rename(tmp, os.path.join(out, "endpoints.json"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--secret-file", action="store_true", help="write the job secret (for the exposure test)")
    args = ap.parse_args()
    smddp.init()
    c = smddp.client()
    rank, world = smddp.rank(), smddp.size()
    rng = np.random.default_rng(1234)  # the same sizes on every rank
    done = wrong = 0
    stop = os.path.join(args.out, "stop")
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        # Everyone agrees to stop at the same collective: rank 0 decides, the others learn by a broadcast.
        flag = np.array([1 if rank == 0 and os.path.exists(stop) else 0], np.int32)
        smddp.broadcast(flag, root=0)
        if flag[0]:
            break
        n = int(rng.integers(1, 50_000))
        x = np.arange(n, dtype=np.float64) + rank
        smddp.allreduce(x, op=smddp.SUM, timeout=60)
        want = world * np.arange(n, dtype=np.float64) + world * (world - 1) / 2
        wrong += int(not np.array_equal(x, want))
        done += 1
        if rank == 0 and done == 1:
            # Published only after a collective has completed everywhere, so a test that stops
            # the job as soon as it has the endpoints still sees every rank with done > 0.
            publish(c, args.out, args.secret_file)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"done": done, "wrong": wrong}, f)
    smddp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
