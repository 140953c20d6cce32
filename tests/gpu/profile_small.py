"""Worker script: where a small device all-reduce's time goes on a GPU (issue 28, the 4 KiB target).

Run under smddp-launch on a lent GPU machine (tests/gpu/on_gpu.sh profile), or on the stand-in
(`--device standin`, under tests/gpu/run_standin.py: the numbers then only show that it runs).
Every rank, each call after a barrier, medians in microseconds:

- calls: `dist.all_reduce(x)` then a synchronize (torch, blocking and async_op), `smddp.allreduce` of
  a CuPy array (blocking), of host memory, and the floor (the bytes to page-locked memory and back,
  each copy followed by a synchronize), interleaved round by round;
- parts: what one call makes of the device runtime and of torch, each alone, many times (an event
  record and query, a stream switch, a device-aware future completed with a tensor, a 4 KiB
  device-to-host copy waited for by the client's poll of its event, by an event synchronize), all
  ranks at once;
- steps: the blocking torch call's steps, timed in every call by wrapping the client's methods
  (torch's dispatch and the backend's checks until smddp is reached; the record reserved and the
  copy-in enqueued; the copy-in seen complete; the SUBMIT given, or held for the engine; the DONE
  taken and the copy back enqueued, both by the engine in the wait; smddp's return; the call's
  return; the synchronize), the median of each step's time from the one before, every rank;
- rank 0's profile of the torch calls (cProfile: the Python and the waits, by function; on Python
  3.12 it sees every thread's calls, and inflates small ones).

Writes profile-<rank>.json and, on rank 0, profile-rank0.txt into --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import smddp
import smddp.torch


def _median_us(fn: Callable[[], None], n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


# The blocking call's steps, in the order they happen: (name, what is wrapped, at its entry or exit).
# (`dist.all_reduce(x)` of one tensor in one piece: Client.device_allreduce_now, no Work.) A step may
# be reached by either of two methods (the SUBMIT given at once, or held for the engine to give once
# its copy lands): both are marked under one name, the first reached counting.
STEPS = (
    ("reached smddp", "smddp.client.session:Client.device_allreduce_now", "entry"),
    ("record reserved, copy-in enqueued", "smddp.client.session:Client.submit", "exit"),
    # (seen by the engine's CopyIn.wait, a native method; its caller then gives the SUBMIT at once)
    ("copy-in seen", "smddp.client.session:Client._give_locked", "entry"),
    ("copy-in seen", "smddp.client.session:Client._hold", "entry"),
    ("SUBMIT given", "smddp.client.session:Client._give_locked", "exit"),
    ("SUBMIT given", "smddp.client.session:Client._hold", "exit"),
    ("DONE taken, copy back enqueued", "smddp.client.session:DeviceHandle._wait", "exit"),
    ("smddp returned", "smddp.client.session:Client.device_allreduce_now", "exit"),
)


def _mark_steps(marks: dict[str, float]) -> Callable[[], None]:
    """Wrap each step's method to note when it is reached (the first time in a call) in `marks`;
    returns what puts them back."""
    import importlib

    undo = []
    for name, where, when in STEPS:
        module, _, path = where.partition(":")
        owner: Any = importlib.import_module(module)
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        real = getattr(owner, attr)

        def wrapped(*a: Any, _real: Any = real, _name: str = name, _when: str = when, **k: Any) -> Any:
            if _when == "entry":
                marks.setdefault(_name, time.perf_counter())
            try:
                return _real(*a, **k)
            finally:
                if _when == "exit":
                    marks.setdefault(_name, time.perf_counter())

        # Two steps may wrap one method (device_allreduce_now's entry and exit): the later wrapper holds
        # the earlier.
        setattr(owner, attr, wrapped)
        undo.append((owner, attr, real))

    def restore() -> None:
        for owner, attr, real in reversed(undo):
            setattr(owner, attr, real)

    return restore


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--device", choices=("cuda", "standin"), default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend="smddp")
    rank = dist.get_rank()
    cuda = args.device == "cuda"
    n = args.size // 4
    if cuda:
        dev = torch.device("cuda", smddp.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        x = torch.zeros(n, device=dev)

        def sync() -> None:
            torch.cuda.synchronize(dev)

    else:
        dev = torch.device("cpu")
        x = torch.zeros(n)

        def sync() -> None:
            pass

    host = np.zeros(n, np.float32)
    pinned = torch.empty(n, pin_memory=cuda)

    def blocking() -> None:
        dist.all_reduce(x)
        sync()

    def asynchronous() -> None:
        dist.all_reduce(x, async_op=True).wait()
        sync()

    def on_host() -> None:
        smddp.allreduce(host)

    def copy() -> None:
        pinned.copy_(x, non_blocking=True)
        sync()
        x.copy_(pinned, non_blocking=True)
        sync()

    calls: dict[str, Callable[[], None]] = {
        "torch": blocking,
        "torch-async": asynchronous,
        "host": on_host,
        "copy": copy,
    }
    if cuda:
        import cupy

        with cupy.cuda.Device(dev.index):
            c = cupy.zeros(n, cupy.float32)

        def on_cupy() -> None:
            smddp.allreduce(c)
            cupy.cuda.get_current_stream().synchronize()

        calls["cupy"] = on_cupy
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(20):  # warm: pinning, first events, the side stream
        for fn in calls.values():
            smddp.barrier()
            fn()
    for _ in range(args.rounds):
        for name, fn in calls.items():
            smddp.barrier()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    result: dict[str, Any] = {
        "rank": rank,
        "size": args.size,
        "calls_us": {k: statistics.median(v) * 1e6 for k, v in times.items()},
    }

    # The parts, every rank at once (they share the GPU as the calls do).
    parts: dict[str, float] = {}
    smddp.barrier()
    if cuda:
        rt = smddp.client().device_runtime()
        side = torch.cuda.Stream(dev)
        cur = torch.cuda.current_stream(dev)
        ev = torch.cuda.Event()
        parts["torch current_stream"] = _median_us(
            lambda: torch.cuda.current_stream(dev).query() and None, 2000
        )
        parts["torch Event() + record"] = _median_us(lambda: torch.cuda.Event().record(cur), 2000)
        parts["torch event query"] = _median_us(lambda: ev.query() and None, 2000)
        parts["torch stream wait_event"] = _median_us(lambda: cur.wait_event(ev), 2000)

        def switch() -> None:
            with torch.cuda.stream(side):
                pass

        parts["torch stream switch"] = _median_us(switch, 2000)

        def future() -> None:
            with torch.cuda.stream(side):
                f: torch.futures.Future[Any] = torch.futures.Future(devices=[dev])
                f.set_result([x])

        parts["torch device future set_result"] = _median_us(future, 2000)
        s = rt.new_stream(dev.index)
        e = rt.new_event(dev.index)
        parts["runtime new_event"] = _median_us(lambda: rt.new_event(dev.index) and None, 2000)
        parts["runtime record"] = _median_us(lambda: rt.record(e, s, dev.index), 2000)
        parts["runtime event_done"] = _median_us(lambda: rt.event_done(e) and None, 2000)
        dst = np.zeros(n, np.float32)
        rt.register_host(int(dst.ctypes.data), dst.nbytes, False)
        src = int(x.data_ptr())

        client = smddp.client()
        engine = client._device_path()
        slot, _fresh = client._arena.alloc(dst.nbytes)

        def d2h_poll() -> None:  # the engine's copy-in, polled as a blocking call polls it (CopyIn.wait)
            a = client._arena.native
            engine.copy_in(a, slot.segment, slot.offset, dst.nbytes, dev.index, src, s, None).wait(10.0)

        def d2h_sync() -> None:
            rt.copy_d2h(int(dst.ctypes.data), src, dst.nbytes, s, dev.index)
            rt.record(e, s, dev.index)
            rt.event_synchronize(e)

        parts["4 KiB D2H, the engine's copy-in polled"] = _median_us(d2h_poll, 500)
        parts["4 KiB D2H, event synchronize"] = _median_us(d2h_sync, 500)
        rt.unregister_host(int(dst.ctypes.data))
        client._arena.free(slot)
    result["parts_us"] = parts
    smddp.barrier()

    # The blocking torch call's steps, every rank, every call: the Python backend's (the C++ backend's
    # device route, smddp/torch/c10d.cpp, reaches none of these methods; run with
    # SMDDP_TORCH_BACKEND=python to see them).
    from smddp.torch import native

    result["backend"] = native.backend_kind()
    marks: dict[str, float] = {}
    restore = _mark_steps(marks)
    names = [*dict.fromkeys(n for n, _w, _e in STEPS), "returned", "synchronized"]
    gaps: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        smddp.barrier()
        marks.clear()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        marks["returned"] = time.perf_counter()
        sync()
        marks["synchronized"] = time.perf_counter()
        if all(n in marks for n in names):
            prev = t0
            for n in names:
                gaps[n].append(marks[n] - prev)
                prev = marks[n]
    restore()
    result["steps_us"] = {n: statistics.median(v) * 1e6 if v else None for n, v in gaps.items()}
    result["steps_counted"] = len(gaps["synchronized"])
    smddp.barrier()

    # Rank 0's profile of the blocking torch call (every rank runs the calls).
    prof = cProfile.Profile()
    for _ in range(args.rounds):
        smddp.barrier()
        if rank == 0:
            prof.enable()
        calls["torch"]()
        if rank == 0:
            prof.disable()
    if rank == 0:
        text = io.StringIO()
        st = pstats.Stats(prof, stream=text)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        with open(os.path.join(args.out, "profile-rank0.txt"), "w") as f:
            f.write(text.getvalue())
    with open(os.path.join(args.out, f"profile-{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"rank {rank}: " + ", ".join(f"{k} {v:.0f}" for k, v in result["calls_us"].items()), flush=True)
    if rank == 0:
        for k, v in parts.items():
            print(f"  {k}: {v:.1f} us", flush=True)
        print(
            f"  steps ({result['steps_counted']} calls): "
            + ", ".join(f"{k} +{v:.0f}" for k, v in result["steps_us"].items() if v is not None),
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
