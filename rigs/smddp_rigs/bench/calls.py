"""One all-reduce the way a training step meets it (a barrier before each call): the blocking call, `allreduce_async(...).wait()` and torch's `dist.all_reduce`, blocking and async_op=True, on the smddp backend (the C++ one where it loads) and on its Python group, interleaved, in one smddp-launch job; and the floors of a torch backend written in Python and in C++.

    python -m smddp_rigs.bench.calls [--np 4] [--size 4096] [--rounds 400] [--out DIR --name NAME]

torch and torch.async run on the default group, the backend a user gets (SMDDP_TORCH_BACKEND; the
report says which); torch.python and torch.python.async on a group of every rank that is smddp's
Python ProcessGroupSmddp, whatever the default is, so that both backends are timed in one run.

The floors: what a torch call could cost at best on a backend of each kind. torch's
`dist.all_reduce` on a group whose backend does nothing, then the engine's blocking all-reduce of
the tensor by its address with no check at all (`Client.allreduce_now`). torch.floor: a Python
backend that does nothing (torch's dispatch: the Python wrapper, the C++ dispatcher, the call into
Python); torch.floor.native: torch's own C++ backend that does nothing ("fake", FakeProcessGroup:
the Python wrapper and the dispatcher alone).

Each rank times each call from the end of the barrier to its return. Printed per call: the median
over rounds of the slowest rank's time, and the median over ranks of each rank's own median, each
with its ratio to the blocking call (issue 29's targets for the asynchronous calls: 1.2x at most).
With --out, also NAME.json and NAME.md there: `make bench` runs it, and BENCHMARKS.md quotes it.

--device measures the device path's calls instead (issue 28), on the stand-in runtime with every
operation run at once (SMDDP_STANDIN_IMMEDIATE=1: no copy takes time and no stream's thread is
woken), so that what a call costs beyond the host's blocking call is smddp's and torch's own Python
and hand-offs, which is what a 4 KiB device all-reduce pays on a GPU beyond its copies: the blocking
call of a device array (`smddp.allreduce(d)`, as of a CuPy array), `smddp.allreduce_async(d).wait()`,
and torch's `dist.all_reduce(t)`, blocking and async_op=True, of a tensor the stand-in takes as
device memory; the host's blocking call of a numpy array beside them.
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
from pathlib import Path
from typing import Any

CALLS = (
    "blocking",
    "async.wait",
    "torch",
    "torch.async",
    "torch.python",
    "torch.python.async",
    "torch.floor",
    "torch.floor.native",
)
# --device: the host's blocking call, then the device path's (the stand-in, its operations at once),
# each timed in blocks of this many calls in a row (_timed).
DEVICE_CALLS = ("blocking", "device", "device.async.wait", "torch.device", "torch.device.async")
DEVICE_BLOCK = 20


def _timed(
    out: str, rank: int, calls: tuple[str, ...], run: dict[str, Any], rounds: int, warmup: int, block: int = 1
) -> None:
    """Each call after a barrier, `block` times in a row, the calls' blocks interleaved (1: every round
    has one of each), until `rounds` times of each are kept after `warmup` calls of each; each rank's
    times into rankR.json. With blocks, a block's first call is not kept: it carries what the call
    before it left running (an asynchronous call's releases and completions, on its client's threads).
    Every rank makes the same calls, so their barriers pair up."""
    import smddp

    times: dict[str, list[float]] = {c: [] for c in calls}
    made = 0  # calls of each so far
    while len(times[calls[-1]]) < rounds:
        for c in calls:
            for j in range(block):
                smddp.barrier()
                t0 = time.perf_counter()
                run[c]()
                if made + j >= warmup and (block == 1 or j > 0) and len(times[c]) < rounds:
                    times[c].append(time.perf_counter() - t0)
        made += block
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(times, f)


def device_worker(out: str, size: int, rounds: int, warmup: int) -> int:
    """--device: the device path's calls on the stand-in (its operations at once), the host's beside."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import smddp
    import smddp.torch

    smddp.init()
    dist.init_process_group("smddp")
    a = np.ones(size // 4, np.float32)
    rt: Any = smddp.client().device_runtime()  # the stand-in (SMDDP_DEVICE_RUNTIME=standin)
    d = rt.asarray(a)
    t = torch.ones(size // 4)  # device memory to the backend: the stand-in claims CPU tensors
    run = {
        "blocking": lambda: smddp.allreduce(a),
        "device": lambda: smddp.allreduce(d),
        "device.async.wait": lambda: smddp.allreduce_async(d).wait(),
        "torch.device": lambda: dist.all_reduce(t),
        "torch.device.async": lambda: dist.all_reduce(t, async_op=True).wait(),
    }
    # In blocks: each call after itself, as a training loop repeats it (interleaved one by one, a
    # blocking call measured after an asynchronous one took 1.7-3.3x its time alone, on that call's threads).
    _timed(out, smddp.rank(), DEVICE_CALLS, run, rounds, warmup, block=DEVICE_BLOCK)
    dist.destroy_process_group()
    smddp.shutdown()
    return 0


def worker(out: str, size: int, rounds: int, warmup: int) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # (registers torch's "fake" backend)

    import smddp
    import smddp.torch
    from smddp.proto.dtypes import DType
    from smddp.torch.backend import ProcessGroupSmddp, SideGroup

    class NopWork(dist.Work):
        def wait(self, timeout: Any = None) -> bool:
            return True

    class Nop(dist.ProcessGroup):
        """A backend that does nothing: what torch's dispatch to a Python backend costs alone."""

        def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work | None:  # type: ignore[override]
            return NopWork() if getattr(opts, "asyncOp", True) else None

        def getBackendName(self) -> str:
            return "smddp-rig-nop"

    def python_group(store: Any, rank: int, size: int, timeout: Any) -> Any:
        """smddp's Python group of every rank, as create_process_group makes it before any C++ wrap."""
        return ProcessGroupSmddp(rank, size, timeout, SideGroup(store, rank, size, timeout))

    dist.Backend.register_backend("smddp-rig-nop", lambda store, rank, size, timeout: Nop(rank, size))  # type: ignore[call-arg]
    dist.Backend.register_backend("smddp-rig-python", python_group)
    smddp.init()
    dist.init_process_group("smddp")
    nop = dist.new_group(backend="smddp-rig-nop")
    fake = dist.new_group(backend="fake")  # (registered by fake_pg's import)
    py = dist.new_group(backend="smddp-rig-python")
    rank = smddp.rank()
    Path(out, f"backend{rank}.json").write_text(json.dumps({"backend": smddp.torch.backend_kind()}))
    a = np.ones(size // 4, np.float32)
    t = torch.ones(size // 4)
    client = smddp.client()

    def floor(group: Any) -> None:
        dist.all_reduce(t, group=group)
        client.allreduce_now(t.data_ptr(), DType.FLOAT32, t.numel(), smddp.SUM, None)

    run = {
        "blocking": lambda: smddp.allreduce(a),
        "async.wait": lambda: smddp.allreduce_async(a).wait(),
        "torch": lambda: dist.all_reduce(t),
        "torch.async": lambda: dist.all_reduce(t, async_op=True).wait(),
        "torch.python": lambda: dist.all_reduce(t, group=py),
        "torch.python.async": lambda: dist.all_reduce(t, group=py, async_op=True).wait(),
        "torch.floor": lambda: floor(nop),
        "torch.floor.native": lambda: floor(fake),
    }
    _timed(out, rank, CALLS, run, rounds, warmup)
    dist.destroy_process_group()
    smddp.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smddp_rigs.bench.calls", description=__doc__)
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--size", type=int, default=4096, help="bytes per all-reduce (float32)")
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--out", default="", help="write NAME.json and NAME.md into this directory")
    ap.add_argument("--name", default="calls")
    ap.add_argument("--device", action="store_true", help="the device path's calls (the stand-in, at once)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        work = device_worker if args.device else worker
        return work(args.worker, args.size, args.rounds, args.warmup)
    calls = DEVICE_CALLS if args.device else CALLS
    launch = str(Path(sys.executable).parent / "smddp-launch")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.device:
        env.update(SMDDP_DEVICE_RUNTIME="standin", SMDDP_STANDIN_IMMEDIATE="1", SMDDP_STANDIN_DELAY_MS="0")
    with tempfile.TemporaryDirectory(prefix="smddp-calls-") as out:
        cmd = [launch, "-np", str(args.np), "--", sys.executable, "-m", "smddp_rigs.bench.calls"]
        cmd += ["--size", str(args.size), "--rounds", str(args.rounds), "--warmup", str(args.warmup)]
        cmd += [*(["--device"] if args.device else []), "--worker", out]
        subprocess.run(cmd, check=True, timeout=1800, env=env)
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(args.np)]
        kinds = sorted({json.loads(p.read_text())["backend"] for p in Path(out).glob("backend*.json")})
    kept = len(ranks[0][calls[0]])  # (the same on every rank, call by call)
    med = {c: statistics.median(max(r[c][i] for r in ranks) for i in range(kept)) for c in calls}
    # Each rank's own median too: the slowest rank of a round also carries the barrier's skew.
    own = {c: statistics.median(statistics.median(r[c]) for r in ranks) for c in calls}
    print(
        f"{args.np} workers on one host, {args.size} B float32, a barrier before each call, {args.rounds} rounds"
        + ("" if args.device else f", torch's default group on the {'/'.join(kinds)} backend")
        + ":"
    )
    for c in calls:
        print(
            f"  {c:11s} slowest rank: median {med[c] * 1e6:7.1f} us ({med[c] / med['blocking']:.2f}x blocking);"
            f" a rank's own: median {own[c] * 1e6:7.1f} us ({own[c] / own['blocking']:.2f}x blocking)"
        )
    if args.out:
        report = {
            "kind": "calls-device" if args.device else "calls",
            "command": shlex.join(["python", "-m", "smddp_rigs.bench.calls", *(argv or sys.argv[1:])]),
            "np": args.np,
            "size": args.size,
            "rounds": args.rounds,
            "slowest_s": med,
            "own_s": own,
            **({} if args.device else {"torch_backend": ",".join(kinds)}),
        }
        dest = Path(args.out)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (dest / f"{args.name}.md").write_text(calls_markdown(report))
    return 0


#: The targets, as a multiple of the blocking call (slowest rank): issue 29's for an asynchronous call
#: waited for at once, issue 58's for torch's calls on the default group.
TARGETS = {"async.wait": (1.2, "issue 29"), "torch": (1.1, "issue 58"), "torch.async": (1.2, "issue 58")}


def calls_markdown(report: dict[str, Any]) -> str:
    """The report as a table: each call's medians and their ratios to the blocking call, and the target."""
    if report.get("kind") == "calls-device":
        return _device_markdown(report)
    med = report["slowest_s"]
    calls = [c for c in CALLS if c in med]  # (older reports have fewer)
    backend = report.get("torch_backend", "")
    lines = [
        f"{report['np']} workers on one host, {report['size']} B float32 all-reduces, a barrier before each "
        f"call, {report['rounds']} rounds of the {len(calls)} calls interleaved in one smddp-launch job: blocking "
        "`smddp.allreduce(a)`, `smddp.allreduce_async(a).wait()`, torch's `dist.all_reduce(t)` on the "
        f"default group{f', here the {backend} backend' if backend else ''} (torch), and "
        "`dist.all_reduce(t, async_op=True).wait()` (torch.async); the same two on a group of every rank that "
        "is smddp's Python backend (torch.python, torch.python.async). The floors: `dist.all_reduce(t)` on a "
        "group whose backend does nothing, then the engine's blocking all-reduce of `t` by its address with "
        "no check (`Client.allreduce_now`): torch.floor with a Python backend, torch.floor.native with "
        'torch\'s own C++ one ("fake"), the least a torch call through a backend of that kind can cost. '
        "Slowest rank: the median over rounds of the slowest rank's time (it also carries "
        "the barrier's skew); a rank's own: the median over ranks of each rank's median.",
        "",
        f"Command: `{report['command']}`",
        "",
        *_table(report, tuple(calls)),
    ]
    verdict = [
        f"{c} at most {x}x ({why}): {'met' if med[c] / med['blocking'] <= x else 'missed'}"
        for c, (x, why) in TARGETS.items()
        if c in med
    ]
    floors = [
        f"{c} {med[c] / med['blocking']:.2f}x" for c in ("torch.floor", "torch.floor.native") if c in med
    ]
    lines += ["", "Targets, slowest rank: " + "; ".join(verdict) + "."]
    if floors:
        lines += ["", "The floors of a torch call: " + "; ".join(floors) + "."]
    return "\n".join(lines) + "\n"


def _table(report: dict[str, Any], calls: tuple[str, ...]) -> list[str]:
    med, own = report["slowest_s"], report["own_s"]
    lines = [
        "| call | slowest rank us | x blocking | a rank's own us | x blocking |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for c in calls:
        lines.append(
            f"| {c} | {med[c] * 1e6:.1f} | {med[c] / med['blocking']:.2f} | {own[c] * 1e6:.1f} | "
            f"{own[c] / own['blocking']:.2f} |"
        )
    return lines


def _device_markdown(report: dict[str, Any]) -> str:
    """--device's report: the device path's calls against the host's blocking call (no target here:
    issue 28's is a GPU's, against its copies' floor)."""
    med = report["slowest_s"]
    lines = [
        f"{report['np']} workers on one host, {report['size']} B float32 all-reduces, a barrier before each "
        f"call, {report['rounds']} rounds of the {len(DEVICE_CALLS)} calls in one smddp-launch job, in interleaved "
        f"blocks of {DEVICE_BLOCK} of one call (the first of each block not kept: it carries what the call "
        "before it left running), "
        "on the stand-in device runtime with every operation run at once (`SMDDP_STANDIN_IMMEDIATE=1`: "
        "no copy takes time): what a device call costs beyond the host's blocking call (`smddp.allreduce(a)` "
        "of a numpy array) is smddp's and torch's own Python and hand-offs, which a GPU's 4 KiB call pays "
        "beside its copies (issue 28). device: `smddp.allreduce(d)` of a device array (as of a CuPy "
        "array); device.async.wait: `smddp.allreduce_async(d).wait()`; torch.device: `dist.all_reduce(t)` "
        "of a tensor the stand-in takes as device memory; torch.device.async: the same with "
        "`async_op=True`, then `wait()`. The stand-in's own calls (its arrays, copies and events in "
        "Python) are in these times too; on a GPU those are CUDA calls of a few microseconds each. With "
        "more ranks than cores (4 on this 2-core host, beside their daemon) the ranks' Python runs in turn.",
        "",
        f"Command: `{report['command']}`",
        "",
        *_table(report, DEVICE_CALLS),
        "",
        "Beyond the host's blocking call: "
        + "; ".join(f"{c} {(med[c] - med['blocking']) * 1e6:.0f} us" for c in DEVICE_CALLS if c != "blocking")
        + " (slowest rank).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
