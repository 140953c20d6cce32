"""Worker script: every collective through the engine's C function table (capi.h) from C, results checked bit for bit.

The front end is smddp_rigs._capi_probe, a C module that knows the table's header and nothing else
of smddp (what the native torch backend does). Each case is the host tests' (check_collectives:
the same inputs, the same independent reference), completed by wait(), by its done callback alone,
by both at once, or by a wait that times out first; then many all-reduces in flight completed by
their callbacks alone; then refusals; last, a mismatch that fails the job, as every rank must see
it. Writes rank<N>.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import check_collectives as cc  # the same cases and the same independent reference as the host tests

KIND = {"allreduce": 1, "broadcast": 2, "allgather": 3, "reduce_scatter": 4, "barrier": 5}
DTYPE = {"uint8": 1, "int32": 2, "int64": 3, "float16": 4, "bfloat16": 5, "float32": 6, "float64": 7}
OP = {"sum": 1, "avg": 2, "min": 3, "max": 4}
OK, PENDING, FAILED, INVALID, CLOSED = 0, 1, 2, 3, 4


def addr(a: np.ndarray | None) -> int:
    return 0 if a is None else int(a.ctypes.data)


def run_case(probe: Any, cap: Any, c: dict, rank: int, world: int, mode: int) -> tuple[Any, tuple]:
    """Case `c` through the table: (what this rank got, the probe's (status, why, class, first))."""
    x = cc.make_input(c["id"], rank, c["dtype"], c["count"])  # (bfloat16 as its uint16 bits)
    kind = c["kind"]
    n = c["count"]
    op = OP[c["op"]] if "op" in c else 0
    src: np.ndarray | None = x
    dst: np.ndarray | None
    if kind == "allreduce":
        dst = x if c["id"] % 2 == 0 else np.empty_like(x)  # in place, or into another buffer
    elif kind == "broadcast":
        dst = x
        if rank != c["root"]:
            src = None
    elif kind == "allgather":
        dst = np.empty(world * n, x.dtype)
    elif kind == "reduce_scatter":
        dst = np.empty(n // world, x.dtype)
    else:
        src = dst = None
    got = probe.run(
        cap, KIND[kind], DTYPE[c["dtype"]], op, c.get("root", 0), addr(src), addr(dst), n, mode, 120.0
    )
    return (None if kind == "barrier" else dst), got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--nnodes", type=int, required=True)
    args = ap.parse_args()

    from smddp_rigs import _capi_probe as probe

    import smddp

    smddp.init()
    rank, world = smddp.rank(), smddp.size()
    cap = smddp.client().native_api()
    out: dict[str, Any] = {"rank": rank, "world": world, "info": list(probe.info(cap))}

    records = []
    statuses: dict[str, int] = {}
    for c in cc.cases(world, big=False):
        mode = c["id"] % 3
        got, (status, why, cls, _first) = run_case(probe, cap, c, rank, world, mode)
        statuses[str(c["id"])] = status
        rec = cc.check(c, got if status == OK else np.zeros(0, np.uint8), world, args.nnodes, rank)
        rec.update(mode=mode, status=status, why=why, error_class=cls)
        records.append(rec)
    out["records"] = records

    # A wait that times out first: rank 0 starts, waits 50 ms (the others start 1 s late: PENDING),
    # then waits again and gets the result.
    c = {"kind": "allreduce", "dtype": "float32", "op": "sum", "count": 1000, "id": 9000}
    smddp.barrier()
    if rank != 0:
        time.sleep(1.0)
    got, (status, why, _cls, first) = run_case(probe, cap, c, rank, world, 3)
    out["late"] = {"first": first, "status": status, "ok": cc.check(c, got, world, args.nnodes, rank)["ok"]}

    # A front end that gives up (its own timeout): rank 0 abandons its all-reduce while the others are
    # late; it fails at once with the front end's error, and the result that comes later is not
    # written into its buffer. The others complete it, and the job goes on.
    c = {"kind": "allreduce", "dtype": "float32", "op": "sum", "count": 1000, "id": 9002}
    smddp.barrier()
    if rank != 0:
        time.sleep(1.0)
    got, (status, why, cls, first) = run_case(probe, cap, c, rank, world, 4 if rank == 0 else 0)
    smddp.barrier()  # (every rank's result has come back by now: rank 0's late one too)
    time.sleep(0.2)
    untouched = bool((got == cc.make_input(9002, rank, "float32", 1000)).all())
    out["abandon"] = {
        "first": first,
        "status": status,
        "why": why,
        "class": cls,
        "ok": cc.check(c, got, world, args.nnodes, rank)["ok"],
        "untouched": untouched,
    }

    # Many in flight, each completed by its done callback alone (the client's DONE thread).
    n, count = 200, 1000
    bufs = np.stack([cc.make_input(10000 + i, rank, "float32", count) for i in range(n)])
    many = probe.allreduce_many(cap, DTYPE["float32"], OP["sum"], 4, addr(bufs), count, n, 120.0)
    want = [cc.expected({"kind": "allreduce", "dtype": "float32", "op": "sum", "count": count, "id": 10000 + i},
                        world, args.nnodes, rank) for i in range(n)]  # fmt: skip
    out["many"] = {
        "statuses": sorted(set(many)),
        "ok": all(cc.same_bits(bufs[i], want[i]) for i in range(n)),
    }

    # Refused before anything is sent: the job goes on.
    x = np.ones(world * 3 + 1, np.float32)
    out["refused"] = {
        "dtype": probe.run(cap, 1, 99, 1, 0, addr(x), addr(x), 4, 0, 10.0)[:2],
        "op": probe.run(cap, 1, 6, 9, 0, addr(x), addr(x), 4, 0, 10.0)[:2],
        "uneven": probe.run(cap, 4, 6, 1, 0, addr(x), addr(np.empty(3, np.float32)), len(x), 0, 10.0)[:2],
        "root": probe.run(cap, 2, 6, 0, world, addr(x), addr(x), 4, 0, 10.0)[:2],
        "no_dst": probe.run(cap, 1, 6, 1, 0, addr(x), 0, 4, 0, 10.0)[:2],
        "barrier_dtype": probe.run(cap, 5, 6, 0, 0, 0, 0, 0, 0, 10.0)[:2],
    }
    after = np.full(4, rank + 1.0, np.float32)
    out["after"] = (*probe.run(cap, 1, 6, 1, 0, addr(after), addr(after), 4, 0, 60.0)[:1], after.tolist())

    # Last: ranks that disagree on a count. Every rank's work fails with the job's error, whose text
    # and class are the ones the Python calls then raise; the table refuses anything after it.
    smddp.barrier()
    bad = np.ones(5 + (rank == 0), np.float32)
    status, why, cls, _ = probe.run(cap, 1, 6, 1, 0, addr(bad), addr(bad), len(bad), rank % 3, 60.0)
    try:
        smddp.allreduce(np.ones(4, np.float32))
        python = "NOT RAISED"
        python_cls = ""
    except smddp.errors.SmddpError as e:
        python, python_cls = str(e), type(e).__name__
    closed = probe.run(cap, 1, 6, 1, 0, addr(after), addr(after), 4, 0, 10.0)[:2]
    out["mismatch"] = {"status": status, "why": why, "class": cls, "python": python, "python_class": python_cls,
                       "bad": bad.tolist(), "closed": list(closed)}  # fmt: skip
    return finish(out, args.out, rank)


def finish(out: dict[str, Any], where: str, rank: int) -> int:
    """Shut smddp down (after a job that failed on purpose, as it can) and write rank<N>.json."""
    import smddp

    try:
        smddp.shutdown()
    except smddp.errors.SmddpError:
        pass
    with open(os.path.join(where, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
