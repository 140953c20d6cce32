"""Worker script for the soak: many random collectives, every result checked, daemon memory tracked."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "multiprocess")]  # tests/reference.py, check_collectives
import reference  # noqa: E402  (tests/reference.py, put on the path by check_collectives)
from check_collectives import DTYPES, OPS, as_user_array, make_input, same_bits  # noqa: E402

import smddp  # noqa: E402


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def plan(n: int, world: int, seed: int) -> list[dict]:
    """The same random sequence on every rank: kind, dtype, op, size."""
    rng = np.random.default_rng(seed)
    kinds = ["allreduce"] * 6 + ["broadcast", "allgather", "reduce_scatter"]
    out = []
    for i in range(n):
        kind = kinds[int(rng.integers(len(kinds)))]
        count = int(np.exp(rng.uniform(0, np.log(200_000))))  # log-uniform: mostly small, some large
        if kind == "reduce_scatter":
            count = max(1, count // world) * world
        out.append(
            {
                "id": 1_000_000 + i,
                "kind": kind,
                "dtype": DTYPES[int(rng.integers(len(DTYPES)))],
                "op": list(OPS)[int(rng.integers(len(OPS)))],
                "count": count,
                "root": int(rng.integers(world)),
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--collectives", type=int, default=1000)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--nnodes", type=int, required=True)
    args = ap.parse_args()
    smddp.init()
    c = smddp.client()
    rank, world = smddp.rank(), smddp.size()
    daemon = c.job.daemons[c.node].pid
    if rank == 0:  # for the stranger: where the daemons listen
        eps = [[d.tcp_host, d.tcp_port] for d in c.job.daemons]
        with open(os.path.join(args.out, "endpoints.tmp"), "w") as f:
            json.dump(eps, f)
        os.rename(os.path.join(args.out, "endpoints.tmp"), os.path.join(args.out, "endpoints.json"))
    cases = plan(args.collectives, world, seed=99)
    wrong: list[str] = []
    rss: dict[str, int] = {}
    warmup = min(200, len(cases) // 5)
    for start in range(0, len(cases), args.inflight):
        batch = cases[start : start + args.inflight]
        pending = []
        for case in batch:
            x = as_user_array(make_input(case["id"], rank, case["dtype"], case["count"]), case["dtype"])
            if case["kind"] == "allreduce":
                h = smddp.allreduce_async(x, op=OPS[case["op"]])
            elif case["kind"] == "reduce_scatter":
                h = smddp.reduce_scatter_async(x, op=OPS[case["op"]])
            elif case["kind"] == "allgather":
                h = smddp.allgather_async(x)
            else:
                h = smddp.broadcast_async(x, root=case["root"])
            pending.append((case, h))
        for case, h in pending:
            got = h.wait(timeout=120)
            inputs = [make_input(case["id"], r, case["dtype"], case["count"]) for r in range(world)]
            if case["kind"] == "allreduce":
                want = reference.allreduce(inputs, case["dtype"], case["op"], args.nnodes)
            elif case["kind"] == "reduce_scatter":
                want = reference.reduce_scatter(inputs, case["dtype"], case["op"], args.nnodes)[rank]
            elif case["kind"] == "allgather":
                want = reference.allgather(inputs)
            else:
                want = reference.broadcast(inputs, case["root"])
            if not same_bits(np.asarray(got), want):
                wrong.append(str(case))
        if start <= warmup < start + args.inflight:
            rss["start_kib"] = rss_kib(daemon)
    rss["end_kib"] = rss_kib(daemon)
    smddp.shutdown()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"done": len(cases), "wrong": wrong, "rss": rss, "node": c.node}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
