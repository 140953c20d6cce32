"""python -m smddp.bench.gpu: device copies through the arena against plain copies, and all-reduce of device buffers.

Two measurements, both on the device runtime smddp uses (CuPy on a GPU; the stand-in runtime
runs the same code end to end without one):

* copy: device-to-host and host-to-device throughput of the client's own path (DeviceIO into a
  page-locked memfd arena slot, with its events) against plain cudaMemcpyAsync to and from
  page-locked anonymous memory, per size;
* all-reduce: float32 device buffers, W = 1..4 worker processes sharing the device (one job per
  W), timed from the call to the result in device memory (`Handle.synchronize`), against the same
  all-reduce of host buffers in the same job.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from smddp.bench.flags import parse_list, parse_sizes
from smddp.client.device.buffers import DeviceBuffer
from smddp.client.device.copies import DeviceIO
from smddp.client.device.runtime import DeviceRuntime, load_runtime
from smddp.proto.dtypes import DType
from smddp.transport.shm import Arena

GB = 1e9


def _median_s(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: first-touch, registration, stream creation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(rt: DeviceRuntime, stream: int, device: int) -> None:
    ev = rt.new_event(device)
    rt.record(ev, stream, device)
    rt.event_synchronize(ev)


def _copy_row(
    rt: DeviceRuntime, io: DeviceIO, arena: Arena, stream: int, dev: int, n: int, repeats: int
) -> dict[str, Any]:
    darr, dptr = rt.new_array((n,), np.dtype(np.uint8), dev)
    anon = mmap.mmap(-1, n)  # page-aligned anonymous memory, page-locked the way the arena is
    host = np.frombuffer(anon, np.uint8)
    hp = int(host.ctypes.data)
    rt.register_host(hp, n, False)
    try:

        def plain_d2h() -> None:
            rt.copy_d2h(hp, dptr, n, stream, dev)
            _sync(rt, stream, dev)

        def plain_h2d() -> None:
            rt.copy_h2d(dptr, hp, n, stream, dev)
            _sync(rt, stream, dev)

        t_plain_d2h = _median_s(plain_d2h, repeats)
        t_plain_h2d = _median_s(plain_h2d, repeats)
    finally:
        rt.unregister_host(hp)
        del host
        anon.close()
    slot, _new = arena.alloc(n)
    seg = arena.segment(slot.segment)
    io.pin(("in", seg.id), seg.array, readonly=False)
    view = arena.view(slot)
    buf = DeviceBuffer(
        ptr=dptr,
        dtype=DType.UINT8,
        shape=(n,),
        count=n,
        device=dev,
        readonly=False,
        stream=None,
        stream_given=True,
        via="cai",
        library="smddp",
        result_dtype=np.dtype(np.uint8),
        keepalive=darr,
    )
    t_arena_d2h = _median_s(lambda: io.host_wait(io.copy_in(buf, view, None)), repeats)
    t_arena_h2d = _median_s(lambda: io.host_wait(io.copy_out(dev, [(buf, view)], None)), repeats)
    arena.free(slot)
    return {
        "bytes": n,
        "plain_d2h_gbs": n / t_plain_d2h / GB,
        "plain_h2d_gbs": n / t_plain_h2d / GB,
        "arena_d2h_gbs": n / t_arena_d2h / GB,
        "arena_h2d_gbs": n / t_arena_h2d / GB,
    }


def copy_bench(runtime: str, sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """Copy throughput (GB/s) of plain page-locked copies and of the client's arena path, per size."""
    rt = load_runtime(runtime)
    io = DeviceIO(rt)
    arena = Arena(max(sizes), "smddp-bench-gpu")
    dev = 0
    try:
        stream = rt.new_stream(dev)
        rows = [_copy_row(rt, io, arena, stream, dev, n, repeats) for n in sizes]
        pageable = dict(getattr(rt, "stats", {})).get("pageable")
        return {
            "device": rt.describe(dev),
            "rows": rows,
            "pageable": pageable,
        }
    finally:
        io.close()
        arena.close()
        rt.close()


def _worker(args: argparse.Namespace) -> int:
    """One rank of an all-reduce job: device and host float32 buffers, each size, timed and checked."""
    os.environ["SMDDP_DEVICE_RUNTIME"] = args.runtime
    import smddp

    smddp.init()
    rank, world = smddp.rank(), smddp.size()
    rt = smddp.client().device_runtime()
    dev = smddp.local_rank() % rt.device_count()
    stream = rt.new_stream(dev)
    rows = []
    for nbytes in parse_sizes(args.sizes):
        count = nbytes // 4
        darr, dptr = rt.new_array((count,), np.dtype(np.float32), dev)
        fill = np.full(count, rank + 1.0, np.float32)
        rt.copy_h2d(dptr, int(fill.ctypes.data), fill.nbytes, stream, dev)
        _sync(rt, stream, dev)
        smddp.allreduce_async(darr, smddp.SUM).synchronize()
        back = np.empty(count, np.float32)
        rt.copy_d2h(int(back.ctypes.data), dptr, back.nbytes, stream, dev)
        _sync(rt, stream, dev)
        ok = bool((back == world * (world + 1) / 2).all())
        host = np.full(count, 1.0, np.float32)

        def device_round(x: Any = darr) -> None:
            smddp.allreduce_async(x, smddp.AVG).synchronize()  # values stay put: timing only

        def host_round(x: np.ndarray = host) -> None:
            smddp.allreduce(x, smddp.AVG)

        smddp.barrier()
        t_dev = _median_s(device_round, args.repeats)
        smddp.barrier()
        t_host = _median_s(host_round, args.repeats)
        agree = smddp.allgather(np.array([ok], np.uint8))
        rows.append(
            {
                "bytes": nbytes,
                "device_s": t_dev,
                "host_s": t_host,
                "correct": bool(agree.all()),
            }
        )
        del darr
    if rank == 0:
        Path(args.result).write_text(
            json.dumps({"workers": world, "device": rt.describe(dev), "runtime": rt.name, "rows": rows})
        )
    smddp.shutdown()
    return 0


def allreduce_bench(
    runtime: str, sizes: str, workers: tuple[int, ...], repeats: int, timeout: float
) -> list[Any]:
    runs = []
    bindir = Path(sys.executable).parent
    for w in workers:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            cmd = [str(bindir / "smddp-launch"), "-np", str(w), "--", sys.executable, "-m", "smddp.bench.gpu"]
            cmd += ["--worker", "--runtime", runtime, "--sizes", sizes, "--repeats", str(repeats)]
            cmd += ["--result", str(result)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0 or not result.exists():
                raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            run = json.loads(result.read_text())
        for row in run["rows"]:
            algbw = row["bytes"] / row["device_s"] / GB
            row["device_busbw_gbs"] = algbw * (2 * (w - 1) / w if w > 1 else 1.0)
            row["host_busbw_gbs"] = row["bytes"] / row["host_s"] / GB * (2 * (w - 1) / w if w > 1 else 1.0)
        runs.append(run)
    return runs


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def markdown(report: dict[str, Any]) -> str:
    out = [
        f"Device: {report['copy']['device']} (runtime `{report['runtime']}`). Command: `{report['command']}`.",
        "",
        "Copy throughput, GB/s (median of the timed rounds; each round enqueues the copy and waits for its event):",
        "",
        "| size | plain D2H | arena D2H | plain H2D | arena H2D |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["copy"]["rows"]:
        out.append(
            f"| {_mib(r['bytes'])} | {r['plain_d2h_gbs']:.2f} | {r['arena_d2h_gbs']:.2f} | "
            f"{r['plain_h2d_gbs']:.2f} | {r['arena_h2d_gbs']:.2f} |"
        )
    out += [
        "",
        "All-reduce (SUM checked, AVG timed) of float32 buffers, from the call to the result in memory; "
        "busbw = bytes / time x 2(W-1)/W (W = 1: bytes / time):",
        "",
        "| workers | size | device: time | device busbw GB/s | host: time | host busbw GB/s | correct |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for run in report["allreduce"]:
        for r in run["rows"]:
            out.append(
                f"| {run['workers']} | {_mib(r['bytes'])} | {r['device_s'] * 1e3:.2f} ms | "
                f"{r['device_busbw_gbs']:.2f} | {r['host_s'] * 1e3:.2f} ms | {r['host_busbw_gbs']:.2f} | "
                f"{r['correct']} |"
            )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None, prog: str = "python -m smddp.bench.gpu") -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", choices=["cupy", "standin"], default="cupy")
    ap.add_argument(
        "--sizes", default="1M,16M,64M,256M", help="comma list (1M,64M) or FROM-TO in steps of 4x"
    )
    ap.add_argument("--workers", default="1,2,3,4", help="all-reduce jobs to run, workers each")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="bench-results/gpu")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    ap.add_argument("--skip-allreduce", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    sizes = parse_sizes(args.sizes)
    report: dict[str, Any] = {
        "runtime": args.runtime,
        "command": shlex.join([*prog.split(), *argv]),
        "copy": copy_bench(args.runtime, sizes, args.repeats),
        "allreduce": []
        if args.skip_allreduce
        else allreduce_bench(
            args.runtime,
            args.sizes,
            tuple(int(w) for w in parse_list(args.workers)),
            args.repeats,
            args.timeout,
        ),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out / "gpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
