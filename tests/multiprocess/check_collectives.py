"""Worker script: runs every collective over a matrix of cases and records, per rank, what came back."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time

import numpy as np

# tests/ after everything else: its torch/ and tensorflow/ directories must not shadow the real packages.
sys.path.append(os.path.join(os.path.dirname(__file__), ".."))
import reference

import smddp

DTYPES = ["uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = {"sum": smddp.SUM, "avg": smddp.AVG, "min": smddp.MIN, "max": smddp.MAX}
STORAGE = {"bfloat16": np.uint16}
ITEMSIZE = {"uint8": 1, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
MIB = 1 << 20


def storage(dtype: str) -> np.dtype:
    return np.dtype(STORAGE.get(dtype, dtype))


def make_input(case: int, rank: int, dtype: str, count: int) -> np.ndarray:
    """Rank `rank`'s input for case `case`: the same on every process, different per rank."""
    rng = np.random.default_rng([case, rank])
    if dtype in ("uint8", "int32", "int64"):
        info = np.iinfo(dtype)
        # Full-range integers, so sums wrap around as the fixed-width types promise.
        return rng.integers(info.min, info.max, size=count, dtype=dtype, endpoint=True)
    x = rng.standard_normal(count, dtype=np.float32) * 100
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    return x.astype(dtype)


def as_user_array(x: np.ndarray, dtype: str) -> np.ndarray:
    """What a user hands smddp: ml_dtypes' bfloat16 for bfloat16, plain numpy otherwise."""
    if dtype == "bfloat16":
        import ml_dtypes

        return x.copy().view(ml_dtypes.bfloat16)
    return x.copy()


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a8 = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    b8 = np.ascontiguousarray(b).view(np.uint8).reshape(-1)
    return a8.shape == b8.shape and bool(np.array_equal(a8, b8))


def cases(world: int, big: bool, dtypes: list[str] = DTYPES) -> list[dict]:
    out: list[dict] = []
    sizes = [0, 1, 7]
    for dtype in dtypes:
        counts = [*sizes, MIB // ITEMSIZE[dtype] + 3]
        for op in OPS:
            for n in counts:
                out.append({"kind": "allreduce", "dtype": dtype, "op": op, "count": n})
            k = 3 + MIB // ITEMSIZE[dtype] // world // 4
            for n in (0, world, 7 * world, k * world):
                out.append({"kind": "reduce_scatter", "dtype": dtype, "op": op, "count": n})
        for n in counts:
            out.append({"kind": "allgather", "dtype": dtype, "count": n})
            out.append({"kind": "broadcast", "dtype": dtype, "count": n, "root": world - 1})
        out.append({"kind": "broadcast", "dtype": dtype, "count": 5, "root": 0})
    out.append({"kind": "barrier", "dtype": "uint8", "count": 0})
    if big:
        out.append({"kind": "allreduce", "dtype": "float32", "op": "sum", "count": 64 * MIB // 4})
        out.append({"kind": "allreduce", "dtype": "bfloat16", "op": "avg", "count": 64 * MIB // 2})
    for i, c in enumerate(out):
        c["id"] = i
    return out


def expected(c: dict, world: int, nnodes: int, rank: int) -> np.ndarray | None:
    inputs = [make_input(c["id"], r, c["dtype"], c["count"]) for r in range(world)]
    kind = c["kind"]
    if kind == "allreduce":
        return reference.allreduce(inputs, c["dtype"], c["op"], nnodes)
    if kind == "reduce_scatter":
        return reference.reduce_scatter(inputs, c["dtype"], c["op"], nnodes)[rank]
    if kind == "allgather":
        return reference.allgather(inputs)
    if kind == "broadcast":
        return reference.broadcast(inputs, c["root"])
    return None


def start(c: dict, rank: int) -> tuple[smddp.Handle, np.ndarray]:
    x = as_user_array(make_input(c["id"], rank, c["dtype"], c["count"]), c["dtype"])
    kind = c["kind"]
    if kind == "allreduce":
        return smddp.allreduce_async(x, op=OPS[c["op"]]), x
    if kind == "reduce_scatter":
        return smddp.reduce_scatter_async(x, op=OPS[c["op"]]), x
    if kind == "allgather":
        return smddp.allgather_async(x), x
    if kind == "broadcast":
        return smddp.broadcast_async(x, root=c["root"]), x
    return smddp.barrier_async(), x


# The references of the cases of 1 MiB and more, kept from their first check for the blocking pass's
# second (each is most of a case's time: its inputs made for every rank, then reduced in numpy).
_kept: dict[int, np.ndarray | None] = {}


def check(c: dict, got: object, world: int, nnodes: int, rank: int) -> dict:
    big = c["count"] * ITEMSIZE[c["dtype"]] >= MIB
    want = _kept[c["id"]] if c["id"] in _kept else expected(c, world, nnodes, rank)
    if big and c["kind"] == "allreduce":
        _kept[c["id"]] = want
    rec = {"id": c["id"], "case": {k: v for k, v in c.items() if k != "id"}}
    if want is None:
        rec.update(ok=got is None, digest="")
        return rec
    arr = np.asarray(got)
    rec["ok"] = same_bits(arr, want)
    rec["digest"] = digest(arr)
    if not rec["ok"]:
        a = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        b = np.ascontiguousarray(want).view(np.uint8).reshape(-1)
        bad = np.flatnonzero(a[: len(b)] != b[: len(a)]) if a.shape == b.shape else []
        rec["detail"] = f"shape {arr.shape} vs {want.shape}; first differing bytes {list(bad[:5])}"
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--nnodes", type=int, required=True)
    ap.add_argument("--big", action="store_true", help="include the 64 MiB cases")
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="a subset of the matrix: these dtypes only")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= set(DTYPES):
        ap.error(f"--dtypes: not among {DTYPES}")

    smddp.init()
    rank, world = smddp.rank(), smddp.size()
    records = []
    all_cases = cases(world, args.big, dtypes)

    # One at a time, each waited for before the next.
    for c in all_cases:
        h, _x = start(c, rank)
        got = h.wait(timeout=120)
        records.append(check(c, got, world, args.nnodes, rank))

    # The large all-reduces again as blocking calls (on one node their copy-in goes round an input
    # ring as the daemon reduces, and the result comes out behind it), the ranks arriving at
    # different times so that each waits for the others' copy-ins mid-way.
    for c in all_cases:
        if c["kind"] != "allreduce" or c["count"] * ITEMSIZE[c["dtype"]] < MIB:
            continue
        x = as_user_array(make_input(c["id"], rank, c["dtype"], c["count"]), c["dtype"])
        time.sleep(0.002 * rank)
        got = smddp.allreduce(x, op=OPS[c["op"]], timeout=120)
        rec = check(c, got, world, args.nnodes, rank)
        rec["blocking"] = True
        records.append(rec)

    # Many in flight: mixed kinds, sizes and dtypes submitted back to back, then waited in reverse.
    rng = np.random.default_rng(7)
    small = [c for c in all_cases if c["count"] <= MIB]
    pick = [small[int(i)] for i in rng.choice(len(small), size=args.inflight, replace=False)]
    pending = [(c, *start(c, rank)) for c in pick]
    for c, h, _x in reversed(pending):
        got = h.wait(timeout=120)
        rec = check(c, got, world, args.nnodes, rank)
        rec["inflight"] = True
        records.append(rec)

    job = smddp.client().job
    streamed_in, streamed_out = smddp.client()._channel.streamed()
    daemons = [{"node": d.node, "host": d.host, "tcp_host": d.tcp_host} for d in job.daemons]
    smddp.shutdown()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        # Where it ran: which interpreter, and what it got from the launching environment.
        env = {k: os.environ.get(k) for k in ("VIRTUAL_ENV", "SMDDP_CHECK_FORWARDED", "CHECK_USER_VAR")}
        where = {"executable": sys.executable, "host": socket.gethostname(), "env": env}
        json.dump(
            {
                "rank": rank,
                "world": world,
                "records": records,
                "daemons": daemons,
                "streamed": [streamed_in, streamed_out],
                **where,
            },
            f,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
