"""`smddp-bench torch-gpu`: torch.distributed all-reduce of device tensors on smddp against gloo and a bare copy round trip.

The way a training step meets an all-reduce: W ranks share the machine's GPU(s) (rank r on GPU
r % GPUs), and each call is timed on its own after a barrier, from `dist.all_reduce(x)` to the
result in device memory (`torch.cuda.synchronize()`). Per size and per round the three cases run
interleaved in one job: smddp (the job's default group), gloo (a `new_group(backend="gloo")` of
the same ranks, gloo on CUDA tensors) and the floor, a bare round trip of the same bytes through
page-locked host memory (device to host, synchronize, host to device, synchronize). A round's time
is the slowest rank's; the report gives the medians and the ratios. Every all-reduce is checked once
(ones in, W out) before the timed rounds, which reduce zeros. `--runtime standin` runs the same
code on CPU tensors through the stand-in device route (the numbers then say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import json
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

IMPLS = ("smddp", "gloo", "copy")


def _worker(args: argparse.Namespace) -> int:
    """One rank: every size, `repeats` rounds of the three cases, each after a barrier."""
    os.environ["SMDDP_DEVICE_RUNTIME"] = args.runtime
    import torch
    import torch.distributed as dist

    import smddp
    import smddp.torch

    torch.set_num_threads(1)
    smddp.init()
    dist.init_process_group(backend="smddp")
    gloo = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sync: Callable[[], None]
    if args.runtime == "standin":
        device = torch.device("cpu")
        name = smddp.client().device_runtime().describe(0)

        def sync() -> None:
            pass  # CPU torch: a call returns with its result in memory (the device route's wait orders it)

    else:
        device = torch.device("cuda", smddp.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)

        def sync() -> None:
            torch.cuda.synchronize(device)

    rows = [
        _measure(max(1, int(size) // 4), device, gloo, sync, args.warmup, args.repeats)
        for size in args.sizes.split(",")
    ]
    os.makedirs(args.result, exist_ok=True)
    with open(os.path.join(args.result, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "device": name, "rows": rows}, f)
    dist.destroy_process_group()
    smddp.shutdown()
    return 0


def _measure(
    n: int, device: Any, gloo: Any, sync: Callable[[], None], warmup: int, repeats: int
) -> dict[str, Any]:
    """One size on this rank: each all-reduce checked once, then `repeats` rounds of the three cases."""
    import torch
    import torch.distributed as dist

    import smddp

    world = dist.get_world_size()
    x = torch.ones(n, device=device)
    correct = {}
    for impl, group in (("smddp", None), ("gloo", gloo)):
        x.fill_(1.0)
        dist.all_reduce(x, group=group)
        sync()
        correct[impl] = bool(torch.equal(x, torch.full_like(x, float(world))))
    x.zero_()
    host = torch.empty(n, pin_memory=device.type == "cuda")

    def copy() -> None:
        host.copy_(x, non_blocking=True)
        sync()
        x.copy_(host, non_blocking=True)
        sync()

    cases: dict[str, Callable[[], Any]] = {
        "smddp": lambda: dist.all_reduce(x),
        "gloo": lambda: dist.all_reduce(x, group=gloo),
        "copy": copy,
    }
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for i in range(warmup + repeats):
        for impl in IMPLS:
            smddp.barrier()
            t0 = time.perf_counter()
            cases[impl]()
            sync()
            t = time.perf_counter() - t0
            if i >= warmup:
                times[impl].append(t)
    return {"bytes": n * 4, "times_s": times, "correct": correct}


def _job(runtime: str, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One launch of `workers` ranks; per size and case the slowest rank's time per round, and medians."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(Path(sys.executable).parent / "smddp-launch"), "-np", str(workers)]
        cmd += [*shlex.split(args.launch_args), "--", sys.executable]
        cmd += ["-m", "smddp.bench.torch_gpu", "--worker", "--runtime", runtime, "--sizes", args.sizes]
        cmd += ["--repeats", str(args.repeats), "--warmup", str(args.warmup), "--result", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        per_rank = [Path(tmp) / f"rank{r}.json" for r in range(workers)]
        if proc.returncode != 0 or not all(p.exists() for p in per_rank):
            raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in per_rank]
    rows = []
    for i, row in enumerate(ranks[0]["rows"]):
        out: dict[str, Any] = {"bytes": row["bytes"]}
        for impl in IMPLS:
            slowest = [max(ts) for ts in zip(*(r["rows"][i]["times_s"][impl] for r in ranks), strict=True)]
            out[f"{impl}_ms"] = statistics.median(slowest) * 1e3
        out["smddp_over_gloo"] = out["smddp_ms"] / out["gloo_ms"]
        out["smddp_over_copy"] = out["smddp_ms"] / out["copy_ms"]
        out["correct"] = all(all(r["rows"][i]["correct"].values()) for r in ranks)
        rows.append(out)
    return {"workers": workers, "device": ranks[0]["device"], "rows": rows}


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def markdown(report: dict[str, Any]) -> str:
    jobs = report["jobs"]
    out = [
        f"torch.distributed all-reduce (float32, SUM) of device tensors, {jobs[0]['device'] if jobs else '-'} "
        f"(runtime `{report['runtime']}`), ranks sharing the GPU, a barrier before each call, the slowest "
        f"rank's median of {report['repeats']} rounds; the three cases interleaved in one job. copy: the same "
        "bytes to page-locked host memory and back, each followed by a synchronize (the device path's floor).",
        "",
        f"Command: `{report['command']}`",
        "",
        *([f"Settings: {report['settings']}", ""] if report.get("settings") else []),
        "| ranks | size | smddp ms | gloo ms | copy ms | smddp / gloo | smddp / copy | checked |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for job in jobs:
        for r in job["rows"]:
            out.append(
                f"| {job['workers']} | {_size(r['bytes'])} | {r['smddp_ms']:.3f} | {r['gloo_ms']:.3f} | "
                f"{r['copy_ms']:.3f} | {r['smddp_over_gloo']:.2f} | {r['smddp_over_copy']:.2f} | {r['correct']} |"
            )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None, prog: str = "python -m smddp.bench.torch_gpu") -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", choices=["cupy", "standin"], default="cupy")
    ap.add_argument("--sizes", default="4096,16777216,67108864", help="bytes, comma list")
    ap.add_argument("--workers", default="2,4", help="jobs to run, ranks each")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--name", default="torch-gpu")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    ap.add_argument(
        "--launch-args", default="", help="more smddp-launch flags, one string (e.g. '--threads 2')"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    report = {
        "kind": "torch-gpu",
        "runtime": args.runtime,
        "command": shlex.join([*prog.split(), *argv]),
        "repeats": args.repeats,
        "settings": f"smddp-launch {args.launch_args}" if args.launch_args else "smddp-launch's defaults",
        "jobs": [_job(args.runtime, int(w), args) for w in args.workers.split(",")],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
