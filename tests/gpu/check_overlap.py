"""Worker script (GPU): the compute stream is not blocked by communication, measured with CUDA events.

A long kernel runs on the compute stream right after an all-reduce of a buffer that stream
produced. If the all-reduce waited for the kernel, or the kernel for the all-reduce, the
all-reduce could not finish while the kernel still runs, or the kernel would take longer than
alone. Writes both durations, when the result was ready, and whether the kernel was still running.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import cupy
import numpy as np

import smddp

SPIN = cupy.RawKernel(
    r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
""",
    "spin",
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernel-ms", type=float, default=400.0)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ["SMDDP_DEVICE_RUNTIME"] = "cupy"
    smddp.init()
    rank, world = smddp.rank(), smddp.size()
    dev = smddp.local_rank() % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(dev).use()
    khz = cupy.cuda.runtime.getDeviceProperties(dev)["clockRate"]
    cycles = np.int64(khz * args.kernel_ms)  # clockRate is in kHz: cycles per millisecond
    compute = cupy.cuda.Stream(non_blocking=True)
    n = args.mib * (1 << 20) // 4
    rounds = []
    with compute:
        x = cupy.ones(n, dtype=cupy.float32)
        # The kernel alone.
        a0, a1 = cupy.cuda.Event(), cupy.cuda.Event()
        a0.record(compute)
        SPIN((1,), (1,), (cycles,))
        a1.record(compute)
        a1.synchronize()
        alone_ms = cupy.cuda.get_elapsed_time(a0, a1)
        # The first device call builds the runtime's streams and page-locks the input segment
        # (cudaHostRegister touches every page: tens of ms for 64 MiB); measured apart, unbounded.
        t0 = time.perf_counter()
        smddp.allreduce_async(x).synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        for _ in range(args.rounds):
            x.fill(rank + 1)
            smddp.barrier()
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(compute)
            t0 = time.perf_counter()
            h = smddp.allreduce_async(x)  # ordered after the fill, before the kernel below
            submit_ms = (time.perf_counter() - t0) * 1e3
            SPIN((1,), (1,), (cycles,))
            e1.record(compute)
            h.synchronize()  # the host waits for the result in device memory
            comm_ms = (time.perf_counter() - t0) * 1e3
            kernel_running = not e1.done
            e1.synchronize()
            with_ms = cupy.cuda.get_elapsed_time(e0, e1)
            correct = bool((x == world * (world + 1) / 2).all())
            rounds.append(
                {
                    "submit_ms": submit_ms,
                    "comm_ms": comm_ms,
                    "kernel_with_comm_ms": with_ms,
                    "kernel_running_when_result_ready": kernel_running,
                    "correct": correct,
                }
            )
    out = {
        "rank": rank,
        "world": world,
        "device": cupy.cuda.runtime.getDeviceProperties(dev)["name"].decode(),
        "buffer_mib": args.mib,
        "kernel_alone_ms": alone_ms,
        "first_call_ms": first_ms,
        "rounds": rounds,
    }
    smddp.shutdown()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
