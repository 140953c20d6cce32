"""Worker script: device collectives through the engine's C table (capi.h's start_device) from C, on the stand-in runtime, checked bit for bit.

The front end is smddp_rigs._capi_probe (the C table's header and nothing else of smddp). The
device memory is the stand-in runtime's (SMDDP_DEVICE_RUNTIME=standin: host memory the stand-in
driver copies late, SMDDP_STANDIN_DELAY_MS), so a reader that is not ordered after a collective's
copy back, as CUDA would order it, reads stale data. Each case goes in line on the caller's stream
(then that stream is synchronized), on the engine's lanes with device_order() onto another stream
(then that one is synchronized), or on the lanes completed by its done callback alone (then
device_query() is polled until the buffers are the caller's again); its result, read only then, is
checked against the independent reference. Writes rank<N>.json into --out.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import check_collectives as cc  # the same inputs and the same independent reference as the host tests
from check_capi import finish

DTYPE = {"uint8": 1, "int32": 2, "int64": 3, "float16": 4, "bfloat16": 5, "float32": 6, "float64": 7}
OP = {"sum": 1, "avg": 2, "min": 3, "max": 4}
OK, PENDING, FAILED, INVALID, CLOSED = 0, 1, 2, 3, 4
IN_LINE = 1
PIECE = 256 << 10  # the job's pieces across nodes (the test's --pipeline-kb)

# (dtype, op, count): small and large, a count that goes in pieces across nodes (more than PIECE).
CASES = [
    ("float32", "sum", 1000),
    ("float32", "avg", 70001),
    ("bfloat16", "sum", 3001),
    ("bfloat16", "avg", 140003),
    ("float16", "max", 513),
    ("int32", "sum", 77777),
    ("int64", "min", 9),
    ("float64", "sum", 40000),
    ("uint8", "sum", 0),
]
KIND = {"allreduce": 1, "broadcast": 2, "allgather": 3, "reduce_scatter": 4}
# The other kinds, each in one piece: (kind, dtype, op, count, root: -1 the last rank). A reduce-scatter's
# count divides among 1 to 10 ranks; an all-gather's result is every rank's count.
OTHERS = [
    ("broadcast", "float32", None, 70001, -1),
    ("broadcast", "float16", None, 513, 0),
    ("allgather", "bfloat16", None, 3001, 0),
    ("allgather", "int64", None, 9, 0),
    ("reduce_scatter", "float32", "sum", 25200, 0),
    ("reduce_scatter", "bfloat16", "avg", 2520, 0),
]
# How each case's copies run and how its reader waits: in line (only where it goes in one piece),
# on the lanes with device_order onto another stream, on the lanes by its callback alone.
WAYS = ("in_line", "order", "callback")
SNAPSHOTS = "TSAN_OPTIONS" not in os.environ


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--nnodes", type=int, required=True)
    args = ap.parse_args()
    os.environ["SMDDP_DEVICE_RUNTIME"] = "standin"
    os.environ.setdefault("SMDDP_STANDIN_DELAY_MS", "20")

    from smddp_rigs import _capi_probe as probe

    import smddp
    from smddp.proto.dtypes import DType

    smddp.init()
    rank, world = smddp.rank(), smddp.size()
    client = smddp.client()
    cap = client.native_api()
    out: dict[str, Any] = {"rank": rank, "world": world}

    x = np.ones(4, np.float32)
    # Before this client's device machinery has started, the table has no device route.
    out["before"] = list(
        probe.device_run(cap, 6, 1, x.ctypes.data, x.ctypes.data, 4, 0, 0, 0, 0, 0, 10.0)[:2]
    )
    rt = client.device_runtime()  # (starts it: the table's device route runs on its path from now on)
    stream, other = rt.new_stream(0), rt.new_stream(0)

    records = []
    cases = [("allreduce", dtype, op, count, 0) for dtype, op, count in CASES] + OTHERS
    for i, (kind, dtype, op, count, root) in enumerate(cases):
        case_id = 20000 + i
        root = world - 1 if root < 0 else root
        pieces = kind == "allreduce" and args.nnodes > 1 and count * cc.ITEMSIZE[dtype] > PIECE
        for w, way in enumerate(WAYS):
            if way == "in_line" and pieces:
                continue
            c = {"kind": kind, "dtype": dtype, "op": op, "count": count, "id": case_id}
            if kind == "broadcast":
                c["root"] = root
            host = cc.make_input(case_id, rank, dtype, count)  # (bfloat16 as its uint16 bits)
            wire = DType.BFLOAT16 if dtype == "bfloat16" else None
            # (an all-gather's result is every rank's count, a reduce-scatter's this rank's block)
            in_place = kind in ("allreduce", "broadcast") and (i + w) % 2 == 0
            n_out = (
                count * world
                if kind == "allgather"
                else count // world
                if kind == "reduce_scatter"
                else count
            )
            result = host if in_place else np.zeros(n_out, host.dtype)
            # (an empty all-reduce has no memory: null addresses, as a CUDA tensor of none has; the
            # aliases are kept until the case's copies have landed: the stand-in frees one let go of)
            held = [rt.alias(host, wire=wire)] if count else []
            if count and not in_place:
                held.append(rt.alias(result, wire=wire))
            src = held[0].ptr if held else 0
            dst = held[-1].ptr if held else 0
            flags = IN_LINE if way == "in_line" else 0
            # What a reader that waited for completion alone would read (the probe copies it at
            # completion, before its first device_query). That read races the copy back on purpose:
            # under ThreadSanitizer (make engine-sanitize-jobs), which rightly reports it, none is taken.
            snap = np.zeros_like(result) if SNAPSHOTS else np.zeros(0, host.dtype)
            status, why, cls, first, order, last = probe.device_run(
                cap, DTYPE[dtype], OP[op] if op else 0, src, dst, count, 0, stream, flags,
                1 if way == "callback" else 0, other if way == "order" else 0, 120.0,
                snap.ctypes.data if count and SNAPSHOTS else 0, result.ctypes.data, snap.nbytes,
                KIND[kind], root if kind == "broadcast" else 0,
            )  # fmt: skip
            if way == "in_line":
                rt.stream_synchronize(stream)
            elif way == "order":
                rt.stream_synchronize(other)
            del held
            rec = cc.check(c, result if status == OK else np.zeros(0, np.uint8), world, args.nnodes, rank)
            # (against the result just checked, not the reference made again: the same bits where it held)
            early = bool(rec["ok"]) and cc.same_bits(snap, result) if SNAPSHOTS else None
            rec.update(way=way, in_place=in_place, pieces=pieces, status=status, why=why, error_class=cls,
                       first=first, order=order, last=last, early=early)  # fmt: skip
            records.append(rec)
    out["records"] = records

    # Refused before anything is enqueued or sent, and the job goes on: a dtype, a device, in line in
    # pieces (across nodes), and a stream that is capturing a CUDA graph.
    big = np.ones(PIECE // 4 + 1, np.float32)
    b = rt.alias(big)
    refused = {
        "dtype": probe.device_run(cap, 99, 1, b.ptr, b.ptr, 4, 0, stream, 0, 0, 0, 10.0)[:2],
        "device": probe.device_run(cap, 6, 1, b.ptr, b.ptr, 4, -1, stream, 0, 0, 0, 10.0)[:2],
    }
    if args.nnodes > 1:
        refused["in_line_pieces"] = probe.device_run(
            cap, 6, 1, b.ptr, b.ptr, big.size, 0, stream, IN_LINE, 0, 0, 10.0
        )[:2]
    rt.begin_capture(stream)
    try:
        refused["capture"] = probe.device_run(cap, 6, 1, b.ptr, b.ptr, 4, 0, stream, IN_LINE, 0, 0, 10.0)[:2]
    finally:
        rt.end_capture(stream)
    out["refused"] = {k: list(v) for k, v in refused.items()}

    # Last: ranks that disagree on a count. Every rank's work fails with the job's error (the class
    # and text the Python calls raise), and nothing is written into its buffer after the failure.
    smddp.barrier()
    bad = np.ones(5 + (rank == 0), np.float32)
    bd = rt.alias(bad)
    status, why, cls, _first, _order, last = probe.device_run(
        cap, 6, 1, bd.ptr, bd.ptr, bad.size, 0, stream, 0, rank % 2, 0, 60.0
    )
    rt.synchronize()
    out["mismatch"] = {"status": status, "why": why, "class": cls, "last": last, "bad": bad.tolist()}
    return finish(out, args.out, rank)


if __name__ == "__main__":
    sys.exit(main())
