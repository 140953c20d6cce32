"""Worker script: the GPU step's node collectives (smddp._engine.DeviceStep) as one of a node's ranks.

Each rank of a node runs this as its own process. The ranks share their staging memory through CUDA
IPC: each writes its card to --dir and opens the others'. Then every case runs, in one sequence on
the same slots and flags: an all-reduce and a reduce-scatter of every dtype and op, an all-gather
and a broadcast (from every root) of every dtype, at sizes from empty to several pieces. Each input
is written late by a kernel
on a compute stream, and each result is read back on that stream. The result is compared bit for
bit with tests/reference.py. Because the stand-in's copies and kernels land late, a slice read
before its producer wrote it gives the wrong bytes. The same script runs on a real GPU
(tests/gpu/on_gpu.sh), where the ranks share one device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "multiprocess"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import check_collectives as cc  # the same inputs as the host tests

from tests import reference

OPS = {"sum": 1, "avg": 2, "min": 3, "max": 4}
WIRE = {"uint8": 1, "int32": 2, "int64": 3, "float16": 4, "bfloat16": 5, "float32": 6, "float64": 7}


def cases(slot_bytes: int, quick: bool, size: int) -> list[dict[str, Any]]:
    """Every dtype and op at 0, 1, 7 and 1000 elements, one size just past a slot and one of several
    pieces (the slots are reused), for each kind; a reduce-scatter's counts are of each rank's block
    (a piece holds one range of every block), a broadcast's root goes round the ranks. The kinds
    interleave, so that each follows every other on the same flags."""
    out: list[dict[str, Any]] = []
    for dtype in reference.DTYPES:
        isz = reference.storage(dtype).itemsize
        per = {"allreduce": slot_bytes // isz, "reduce_scatter": slot_bytes // (isz * size)}
        per["allgather"] = per["broadcast"] = per["allreduce"]
        for n in [0, 1, 7, 1000] if quick else [0, 1, 7, 1000, -3, -11]:
            for kind in ("allreduce", "reduce_scatter", "allgather", "broadcast"):
                count = n if n >= 0 else (1 if n == -3 else 5) * per[kind] - n
                ops = reference.OPS if kind in ("allreduce", "reduce_scatter") else ["sum"]
                for op in ops:
                    out.append({"kind": kind, "dtype": dtype, "op": op, "count": count})
    # NaNs and infinities: the CPU's rules for which NaN a sum keeps (kernels.cu).
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for op in reference.OPS:
            for kind in ("allreduce", "reduce_scatter"):
                out.append({"kind": kind, "dtype": dtype, "op": op, "count": 64, "special": True})
    roots = 0
    for i, c in enumerate(out):
        c["id"] = i
        c["root"] = roots % size
        roots += c["kind"] == "broadcast"
    return out


def run_case(step: Any, c: dict[str, Any], ptr: int, out_ptr: int, size: int, stream: int) -> Any:
    """Enqueue case `c` on `step`: its end."""
    dtype, n = WIRE[c["dtype"]], c["count"]
    if c["kind"] == "allreduce":
        return step.allreduce(ptr, n, dtype, OPS[c["op"]], size, stream)
    if c["kind"] == "reduce_scatter":
        return step.reduce_scatter(ptr, out_ptr, n, dtype, OPS[c["op"]], size, stream)
    if c["kind"] == "allgather":
        return step.allgather(ptr, out_ptr, n, dtype, stream)
    return step.broadcast(ptr, n, dtype, c["root"], stream)


def expected(c: dict[str, Any], rank: int, size: int) -> np.ndarray:
    """What rank `rank` holds after case `c` (tests/reference.py; NaN cases: the host path's fold)."""
    inputs = [make_input(c, r, size) for r in range(size)]
    kind = c["kind"]
    if kind in ("allreduce", "reduce_scatter"):
        full = (
            host_path(inputs, c, size)
            if c.get("special")
            else reference.allreduce(inputs, c["dtype"], c["op"], 1)
        )
        if kind == "allreduce":
            return full
        k = len(full) // size
        return full[rank * k : (rank + 1) * k]
    if kind == "allgather":
        return reference.allgather(inputs).reshape(-1)
    return reference.broadcast(inputs, c["root"])


def make_input(c: dict[str, Any], rank: int, size: int) -> np.ndarray:
    """Rank `rank`'s input (a reduce-scatter's: `size` blocks of the case's count)."""
    n = c["count"] * (size if c["kind"] == "reduce_scatter" else 1)
    x = cc.make_input(c["id"], rank, c["dtype"], n)
    if c.get("special"):
        # NaNs with payloads (quiet and signalling), infinities of both signs, zeros of both signs.
        st = reference.storage(c["dtype"])
        bits = {
            "float32": [0x7FC00001, 0x7F800011, 0xFF800000, 0x7F800000, 0x80000000],
            "float64": [
                0x7FF8000000000001,
                0x7FF0000000000011,
                0xFFF0000000000000,
                0x7FF0000000000000,
                1 << 63,
            ],
            "float16": [0x7E01, 0x7C11, 0xFC00, 0x7C00, 0x8000],
            "bfloat16": [0x7FC1, 0x7F91, 0xFF80, 0x7F80, 0x8000],
        }[c["dtype"]]
        raw = x.view(np.dtype(f"u{st.itemsize}"))
        rng = np.random.default_rng([c["id"], rank, 7])
        for i in rng.choice(len(raw), size=12, replace=False):
            raw[i] = bits[int(rng.integers(0, len(bits)))]
    return x


def host_path(inputs: list[np.ndarray], c: dict[str, Any], world: int) -> np.ndarray:
    """What the daemon's CPU folds for the same inputs on one node (reduce_wire): where NaNs meet,
    numpy's own choice of payload depends on its loop, so the host path's rule is the reference."""
    from smddp_rigs import _engine_testing

    out = np.empty_like(inputs[0])
    op = OPS[c["op"]]
    _engine_testing.reduce(WIRE[c["dtype"]], op, [x.copy() for x in inputs], out, world if op == 2 else 0)
    return out


def wait_cards(d: Path, size: int, timeout: float) -> list[bytes]:
    deadline = time.monotonic() + timeout
    while True:
        paths = [d / f"card{j}.bin" for j in range(size)]
        if all(p.exists() for p in paths):
            return [p.read_bytes() for p in paths]
        if time.monotonic() > deadline:
            raise TimeoutError(f"cards: only {[p.name for p in paths if p.exists()]} came")
        time.sleep(0.01)


def summary(d: Path, size: int) -> int:
    """One line: how many cases, how many wrong, whether every rank closed its step; 1 if any went wrong."""
    runs = [json.loads((d / f"rank{r}.json").read_text()) for r in range(size)]
    bad = [rec for run in runs for rec in run["records"] if not rec["ok"]]
    digests = {
        i: {run["records"][i]["digest"] for run in runs}
        for i in range(len(runs[0]["records"]))
        if runs[0]["records"][i]["case"]["kind"] != "reduce_scatter"  # (each rank its own block)
    }
    split = [i for i, ds in digests.items() if len(ds) != 1]
    print(
        f"step: {len(runs[0]['records'])} cases x {size} ranks, {len(bad)} wrong, {len(split)} where ranks differ, "
        f"closed {[run['closed'] for run in runs]}"
    )
    return 1 if bad or split or not all(run["closed"] for run in runs) else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--summary", type=Path, help="no run: say what the ranks' files in this directory hold")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--slot-bytes", type=int, default=16384)
    ap.add_argument("--runtime", choices=["standin", "cupy"], default="standin")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--delay-ms", type=float, default=1.0, help="how long each input's producer kernel runs first"
    )
    args = ap.parse_args()
    if args.summary is not None:
        return summary(args.summary, args.size)
    if args.rank < 0 or args.dir is None:
        ap.error("--rank and --dir, or --summary")

    from smddp import _engine

    if args.runtime == "standin":
        from smddp_rigs.standin import StandinRuntime, driver_path

        rt: Any = StandinRuntime(devices=args.device + 1)
        library = driver_path()

        def upload_late(x: np.ndarray, stream: int) -> tuple[Any, int]:
            arr = rt.empty(x.shape, x.dtype, args.device)
            rt.sleep(stream, args.delay_ms / 1000, device=args.device)
            src = x.copy()
            rt.launch(stream, lambda v: np.copyto(v, src), arr, device=args.device)
            return arr, arr.ptr

        def scribble(arr: Any, stream: int) -> None:
            rt.launch(stream, lambda v: v.view(np.uint8).fill(0x5A), arr, device=args.device)

        def read_back(arr: Any, stream: int) -> np.ndarray:
            with rt.use(stream):
                return arr.get()

        stream = rt.new_stream(args.device)
    else:
        import cupy as cp

        library = "libcuda.so.1"
        cp.cuda.Device(args.device).use()
        cstream = cp.cuda.Stream(non_blocking=True)
        stream = cstream.ptr

        def upload_late(x: np.ndarray, s: int) -> tuple[Any, int]:

            with cstream:
                arr = cp.empty(x.shape, x.dtype)
                cp.cuda.runtime.memcpyAsync(arr.data.ptr, x.ctypes.data, x.nbytes, 1, s) if x.nbytes else None
            return arr, arr.data.ptr

        def scribble(arr: Any, s: int) -> None:
            if arr.nbytes:
                cp.cuda.runtime.memsetAsync(arr.data.ptr, 0x5A, arr.nbytes, s)

        def read_back(arr: Any, s: int) -> np.ndarray:
            out = np.empty(arr.shape, arr.dtype)
            if out.nbytes:
                cp.cuda.runtime.memcpyAsync(out.ctypes.data, arr.data.ptr, out.nbytes, 2, s)
            cstream.synchronize()
            return out

    step = _engine.DeviceStep(library, args.device, args.rank, args.size, args.slot_bytes)
    card = args.dir / f"card{args.rank}.bin"
    tmp = card.with_suffix(".tmp")
    tmp.write_bytes(step.card())
    tmp.rename(card)
    step.join(wait_cards(args.dir, args.size, 60))

    records = []
    for c in cases(args.slot_bytes, args.quick, args.size):
        x = make_input(c, args.rank, args.size)
        arr, ptr = upload_late(x, stream)
        outs = {"reduce_scatter": c["count"], "allgather": c["count"] * args.size}
        out_arr, out_ptr = arr, ptr
        if c["kind"] in outs:
            # The output, filled with a pattern late on the same stream: a result that lands before
            # it (the gather lane not after the caller's work) is overwritten, and caught.
            out_arr, out_ptr = upload_late(np.full(outs[c["kind"]], 0xA5, x.dtype), stream)
        done = run_case(step, c, ptr, out_ptr, args.size, stream)
        done.order(stream)
        got = read_back(out_arr, stream)
        if out_arr is not arr or (c["kind"] == "broadcast" and args.rank == c["root"]):
            # The input is the caller's again once the call has ended: written over at once, so
            # that a step still reading it then gives the node's other ranks wrong bytes.
            scribble(arr, stream)
        want = expected(c, args.rank, args.size)
        ok = cc.same_bits(got, want)
        rec = {"id": c["id"], "case": c, "ok": ok, "digest": cc.digest(got)}
        if not ok:
            bad = np.flatnonzero(
                got.view(np.uint8).reshape(-1) != np.asarray(want).view(np.uint8).reshape(-1)
            )
            rec["first_bad_byte"] = int(bad[0]) if len(bad) else -1
        records.append(rec)
        if not done.wait(30):
            raise TimeoutError(f"case {c} did not end")
    pieces = step.pieces
    closed = step.close(60)  # (after every rank's reads of this rank's slots)
    (args.dir / f"rank{args.rank}.json").write_text(
        json.dumps({"records": records, "pieces": pieces, "closed": closed})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
