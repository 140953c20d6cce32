"""Worker script: every collective on device buffers (stand-in, CuPy or torch CUDA), results checked bit for bit.

The same script runs against the stand-in runtime in CI and against a real GPU: only --runtime and
--array differ. Each input is written by a kernel on a compute stream that first runs for a while,
and each result is read back on that stream, so a copy that does not wait for the producer, or a
reader that does not wait for the copy, sees the wrong bytes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "multiprocess"))
import check_collectives as cc  # the same cases and the same independent reference as the host tests

KERNEL_S = 0.002  # how long the producer's kernel runs before the data exists


class StandinDev:
    """Arrays of the client's stand-in runtime; `cai` hides DLPack so the CUDA Array Interface path runs."""

    def __init__(self, rt: Any, via: str) -> None:
        from smddp_rigs.standin import CaiOnly

        self.rt = rt
        self.via = via
        self.compute = rt.new_stream(0)
        self._cai = CaiOnly

    def ctx(self) -> Any:
        return self.rt.use(self.compute)

    def can(self, dtype: str) -> bool:
        return True

    def make(self, x: np.ndarray) -> Any:
        arr = self.rt.empty(x.shape, x.dtype)  # holds garbage until the kernel below runs
        self.rt.sleep(self.compute, KERNEL_S)
        self.rt.launch(self.compute, lambda v: np.copyto(v, x), arr)
        if self.via == "cai" and x.dtype.kind != "V":
            return self._cai(arr)
        return arr

    def fetch(self, arr: Any) -> np.ndarray:
        return (arr._arr if isinstance(arr, self._cai) else arr).get()

    def stats(self) -> dict[str, Any]:
        return {"stats": dict(self.rt.stats), "registered": len(self.rt.driver_registered())}


class CupyDev:
    """CuPy arrays on a non-blocking compute stream (bfloat16 has no CuPy dtype: those cases are skipped)."""

    def __init__(self, local_rank: int) -> None:
        import cupy

        self.cp = cupy
        self.device = local_rank % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(self.device).use()
        self.compute = cupy.cuda.Stream(non_blocking=True)

    def ctx(self) -> Any:
        return self.compute

    def can(self, dtype: str) -> bool:
        return dtype != "bfloat16"

    def make(self, x: np.ndarray) -> Any:
        if x.dtype.kind == "V":
            return None
        return self.cp.asarray(x)  # uploaded on the current (compute) stream

    def fetch(self, arr: Any) -> np.ndarray:
        return arr.get()

    def stats(self) -> dict[str, Any]:
        return {}


class TorchDev:
    """torch CUDA tensors (bfloat16 included, through DLPack) on a side compute stream with a long kernel first."""

    def __init__(self, local_rank: int) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(self.device)
        self.compute = torch.cuda.Stream(self.device)

    def ctx(self) -> Any:
        return self.torch.cuda.stream(self.compute)

    def can(self, dtype: str) -> bool:
        return True

    def make(self, x: np.ndarray) -> Any:
        t = self.torch
        if x.dtype.kind == "V":
            host = t.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(t.bfloat16)
        else:
            host = t.from_numpy(np.ascontiguousarray(x))
        t.cuda._sleep(200_000)  # a kernel that runs first: the copy-in must wait for the upload behind it
        return host.to(self.device)

    def fetch(self, arr: Any) -> np.ndarray:
        t = self.torch
        if not isinstance(arr, t.Tensor):
            # A result smddp allocated (all-gather, reduce-scatter without out=) is the device
            # runtime's array, as on the host it is numpy's: raw uint16 bits for bfloat16. wait()
            # ordered torch's current stream after it, so it is read there.
            import cupy

            return arr.get(stream=cupy.cuda.ExternalStream(t.cuda.current_stream().cuda_stream))
        if arr.dtype == t.bfloat16:
            return arr.view(t.int16).cpu().numpy().view(np.uint16)
        return arr.cpu().numpy()

    def stats(self) -> dict[str, Any]:
        return {}


class Done:
    """A blocking call's result, as a handle whose wait() returns it."""

    def __init__(self, result: Any) -> None:
        self.result = result

    def wait(self, timeout: float | None = None) -> Any:
        return self.result


def call(c: dict, x: Any) -> Done:
    """Collective `c` through the blocking call (its SUBMIT sent by its own wait, on this thread)."""
    import smddp

    kind = c["kind"]
    if kind == "allreduce":
        return Done(smddp.allreduce(x, op=cc.OPS[c["op"]], timeout=120))
    if kind == "reduce_scatter":
        return Done(smddp.reduce_scatter(x, op=cc.OPS[c["op"]], timeout=120))
    if kind == "allgather":
        return Done(smddp.allgather(x, timeout=120))
    if kind == "broadcast":
        return Done(smddp.broadcast(x, root=c["root"], timeout=120))
    smddp.barrier(timeout=120)
    return Done(None)


def start(c: dict, x: Any) -> Any:
    import smddp

    kind = c["kind"]
    if kind == "allreduce":
        return smddp.allreduce_async(x, op=cc.OPS[c["op"]])
    if kind == "reduce_scatter":
        return smddp.reduce_scatter_async(x, op=cc.OPS[c["op"]])
    if kind == "allgather":
        return smddp.allgather_async(x)
    if kind == "broadcast":
        return smddp.broadcast_async(x, root=c["root"])
    return smddp.barrier_async()


def run_case(dev: Any, c: dict, rank: int, blocking: bool = False) -> tuple[Any, Any] | None:
    """Start case `c` (or, `blocking`, run it through the blocking call): its handle and input array."""
    go = call if blocking else start
    x = cc.as_user_array(cc.make_input(c["id"], rank, c["dtype"], c["count"]), c["dtype"])
    if c["kind"] == "barrier":
        return go(c, None), None
    arr = dev.make(x)
    if arr is None:
        return None
    return go(c, arr), arr


def collect(dev: Any, c: dict, h: Any, world: int, nnodes: int, rank: int) -> dict:
    got = h.wait(timeout=120)
    host = None if got is None else dev.fetch(got)
    return cc.check(c, host, world, nnodes, rank)


def refused(fn: Any, *args: Any, **kwargs: Any) -> str:
    from smddp import errors

    try:
        fn(*args, **kwargs)
    except errors.SmddpError as e:
        return f"{type(e).__name__}: {e}"
    return "NOT REFUSED"


class ForeignCai:
    """CUDA Array Interface over memory the stand-in runtime does not own (a real GPU pointer, say)."""

    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (ptr, False),
            "version": 3,
            "stream": None,
        }


def error_cases(rt: Any) -> dict[str, str]:
    """Bad device buffers are refused with a clear smddp error before anything is sent."""
    from smddp_rigs.standin import CaiOnly, StandinRuntime

    import smddp

    ok = rt.asarray(np.arange(8, dtype=np.float32))
    other = StandinRuntime()
    try:
        out = {
            "noncontiguous": refused(
                smddp.allreduce_async, rt.asarray(np.arange(10, dtype=np.float32)).every(2)
            ),
            "int16": refused(smddp.allreduce_async, rt.asarray(np.arange(4, dtype=np.int16))),
            "int16_cai": refused(smddp.allreduce_async, CaiOnly(rt.asarray(np.arange(4, dtype=np.int16)))),
            "foreign": refused(smddp.allreduce_async, ForeignCai(0x1000)),
            "other_runtime": refused(smddp.allreduce_async, other.asarray(np.arange(4, dtype=np.float32))),
            "stream_0": refused(smddp.allreduce_async, CaiOnly(ok, stream=0)),
            "host_with_stream": refused(smddp.allreduce_async, np.zeros(4, np.float32), stream=5),
            "host_out": refused(smddp.allgather_async, ok, out=np.zeros((smddp.size(), 8), np.float32)),
            "device_out": refused(
                smddp.allgather_async, np.zeros(8, np.float32), out=rt.empty((8,), np.float32)
            ),
            "out_dtype": refused(smddp.allgather_async, ok, out=rt.empty((smddp.size(), 8), np.int32)),
        }
    finally:
        other.close()
    return out


def late_copy(rank: int, world: int, count: int) -> dict[str, Any]:
    """A blocking device all-reduce of `count` float32 whose copy-in cannot start in time: rank 0's
    stream is still busy with a long kernel past the call's timeout. Rank 0 is told so
    (CollectiveTimeoutError, within about that timeout), its collective is still sent once the copy
    lands, every other rank gets the exact result, rank 0's is dropped (its array is never written
    after the error: it holds its own input once later collectives have completed), and the job
    goes on."""
    import time

    import smddp
    from smddp.errors import CollectiveTimeoutError

    rt = smddp.client().device_runtime()
    s = rt.new_stream(0)
    out: dict[str, Any] = {}
    want = world * (world + 1) / 2
    with rt.use(s):
        arr = rt.asarray(np.full(count, rank + 1.0, np.float32))
        if rank == 0:
            rt.sleep(s, 2.0)  # the caller's kernels, still running when it calls
        t0 = time.monotonic()
        try:
            smddp.allreduce(arr, timeout=0.3 if rank == 0 else 60)
            out["call"] = "returned"
        except CollectiveTimeoutError as e:
            out["call"] = "timed out"
            out["why"] = str(e)
        out["call_s"] = time.monotonic() - t0
        again = rt.asarray(np.full(8, rank + 1.0, np.float32))
        out["again"] = smddp.allreduce(again, timeout=60).get().tolist()
    out["host"] = smddp.allreduce(np.full(4, rank + 1.0, np.float32)).tolist()
    # The later collectives' DONEs came after the first's on this rank's ring, so its DONE has been
    # taken (and a copy back, were there one, enqueued on `s` before theirs).
    with rt.use(s):
        got = arr.get()  # on `s`: after the kernel, and after any copy back enqueued there
    out["holds"] = "result" if (got == want).all() else "input" if (got == rank + 1.0).all() else "other"
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--nnodes", type=int, required=True)
    ap.add_argument("--runtime", choices=["standin", "cupy", "auto"], default="standin")
    ap.add_argument("--array", choices=["dlpack", "cai", "cupy", "torch"], default="dlpack")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="stand-in: every async copy waits this long")
    ap.add_argument("--errors", action="store_true", help="check the refusals first")
    ap.add_argument("--inflight", type=int, default=24)
    ap.add_argument(
        "--flood",
        type=int,
        default=0,
        help="then this many small all-reduces in flight at once (device and host)",
    )
    ap.add_argument("--big", action="store_true")
    ap.add_argument(
        "--unavailable", action="store_true", help="hand a stand-in array to a client whose runtime is CuPy"
    )
    ap.add_argument(
        "--late-copy",
        type=int,
        default=0,
        help="stand-in: rank 0's blocking all-reduce of this many float32 times out waiting for its own "
        "stream's kernels",
    )
    args = ap.parse_args()
    os.environ["SMDDP_DEVICE_RUNTIME"] = args.runtime
    os.environ["SMDDP_STANDIN_DELAY_MS"] = str(args.delay_ms)

    import smddp

    smddp.init()
    rank, world = smddp.rank(), smddp.size()
    result: dict[str, Any] = {"rank": rank, "world": world}
    if args.unavailable:
        from smddp_rigs.standin import StandinRuntime

        own = StandinRuntime()  # not the client's: the client has to find a runtime itself
        result["refused"] = refused(smddp.allreduce_async, own.asarray(np.ones(4, np.float32)))
        x = np.full(4, rank + 1.0, np.float32)
        result["after"] = smddp.allreduce(x).tolist()  # nothing was sent: the job goes on
        own.close()
        smddp.shutdown()
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        return 0
    if args.late_copy:
        rt = smddp.client().device_runtime()
        result.update(late_copy(rank, world, args.late_copy))
        smddp.shutdown()
        result["registered"] = len(rt.driver_registered())  # every segment unpinned, the engine's too
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        return 0
    dev: Any
    if args.array in ("dlpack", "cai"):
        rt = smddp.client().device_runtime()
        dev = StandinDev(rt, args.array)
        if args.errors:
            result["errors"] = error_cases(rt)
    elif args.array == "cupy":
        dev = CupyDev(smddp.local_rank())
    else:
        dev = TorchDev(smddp.local_rank())

    records: list[dict] = []
    skipped = 0
    all_cases = cc.cases(world, args.big)
    with dev.ctx():
        for i, c in enumerate(all_cases):
            # Every other case through the blocking call, the rest through *_async and wait().
            started = run_case(dev, c, rank, blocking=i % 2 == 0)
            if started is None:
                skipped += 1
                continue
            records.append(collect(dev, c, started[0], world, args.nnodes, rank))

        # Many in flight, device and host buffers interleaved (a host SUBMIT queues behind a device
        # one whose copy-in is not finished), then waited in reverse.
        rng = np.random.default_rng(11)
        # Only cases this kind of array holds (CuPy has no bfloat16), so that `inflight` are in flight.
        small = [
            c for c in all_cases if c["count"] <= cc.MIB and c["kind"] != "barrier" and dev.can(c["dtype"])
        ]
        pick = [small[int(i)] for i in rng.choice(len(small), size=args.inflight, replace=False)]
        pending = []
        for i, c in enumerate(pick):
            if i % 3 == 2:
                h, _x = cc.start(c, rank)  # host memory
                pending.append((c, h, False))
                continue
            started = run_case(dev, c, rank)
            if started is not None:
                pending.append((c, started[0], True))
        for c, h, on_device in reversed(pending):
            if on_device:
                rec = collect(dev, c, h, world, args.nnodes, rank)
            else:
                rec = cc.check(c, h.wait(timeout=120), world, args.nnodes, rank)
            rec["inflight"] = True
            rec["device"] = on_device
            records.append(rec)

        if args.flood:
            # More in flight than a channel's rings hold, one in four on device buffers (collected:
            # the DONE thread takes DONEs meanwhile), the rest host buffers.
            few = [c for c in small if c["kind"] == "allreduce" and c["count"] <= 4096]
            flood = []
            for i in range(args.flood):
                c = few[i % len(few)]
                if i % 4 != 3:
                    h, _x = cc.start(c, rank)
                    flood.append((c, h, False))
                    continue
                started = run_case(dev, c, rank)
                if started is not None:
                    flood.append((c, started[0], True))
            bad = 0
            for c, h, on_device in reversed(flood):
                rec = (
                    collect(dev, c, h, world, args.nnodes, rank)
                    if on_device
                    else cc.check(c, h.wait(timeout=120), world, args.nnodes, rank)
                )
                bad += not rec["ok"]
            result["flood"] = {"started": len(flood), "bad": bad}

    result["records"] = records
    result["skipped"] = skipped
    result["runtime"] = smddp.client().device_runtime().name
    # Whether device all-reduces took the GPU step (node_reduce), and how many did.
    result["node_reduce_why"] = smddp.client().node_reduce_why
    step = smddp.client()._node_step
    result["step_count"] = 0 if step is None else step.count
    result["device_allreduces"] = sum(
        1 for r in records if r["case"]["kind"] == "allreduce" and r.get("device", True)
    )
    result["device_kinds"] = dict(
        collections.Counter(
            r["case"]["kind"] for r in records if r["case"]["kind"] != "barrier" and r.get("device", True)
        )
    )
    smddp.shutdown()
    result.update(dev.stats())  # after shutdown: every segment must have been unpinned
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
