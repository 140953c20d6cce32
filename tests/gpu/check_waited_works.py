"""Worker script: which thread completes a device Work (under tests/gpu/run_standin.py, the stand-in's late copies).

`dist.all_reduce(x, async_op=True).wait()` is completed by the waiting thread itself (no completer
thread is started for it), and its result is exact on the caller's stream; a Work whose future is
asked for, or which is polled, or dropped unwaited, goes to the completer thread, and its readers
see the exact result too. Writes waited-<rank>.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from typing import Any

import torch
import torch.distributed as dist

import smddp
import smddp.torch  # (registers the backend)


def completer_running() -> bool:
    return any(t.name == "smddp-torch-completer" for t in threading.enumerate())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group(backend="smddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    want = sum(range(1, world + 1))
    out: dict[str, Any] = {}
    rt = smddp.client().device_runtime()
    # (The host reads below come after a synchronize: which thread completes a Work is what this
    # checks; the order of its readers on the device is check_ordering's.)
    singles = [torch.full((4096 + i,), float(rank + 1)) for i in range(20)]
    for x in singles:
        dist.all_reduce(x, async_op=True).wait()
    ws = []
    xs = [torch.full((1000,), float(rank + 1)) for _ in range(4)]
    for x in xs:  # four in flight, waited for last first
        ws.append(dist.all_reduce(x, async_op=True))
    for w in reversed(ws):
        w.wait()
    rt.synchronize()
    out["waited_exact"] = all(bool((x == want).all()) for x in [*singles, *xs])
    out["completer_after_waits"] = completer_running()
    y = torch.full((2048,), float(rank + 1))
    fut = dist.all_reduce(y, async_op=True).get_future()
    got = fut.wait()[0]
    z = torch.full((2048,), float(rank + 1))
    polled = dist.all_reduce(z, async_op=True)
    while not polled.is_completed():
        pass
    rt.synchronize()
    out["future_exact"] = bool((got == want).all())
    out["polled_exact"] = bool((z == want).all())
    out["completer_after_future"] = completer_running()
    dropped = torch.full((512,), float(rank + 1))
    dist.all_reduce(dropped, async_op=True)  # never waited: its Work dropped at once
    dist.barrier()
    v = torch.full((8,), float(rank + 1))
    dist.all_reduce(v)
    out["after_dropped_exact"] = bool((v == want).all())
    rt.synchronize()
    out["dropped_exact"] = bool((dropped == want).all())
    with open(os.path.join(args.out, f"waited-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
