"""The per-rank benchmark program: every implementation runs this same loop under its own launcher.

    python -m smddp.bench.worker --impl smddp|mpi|gloo --case BYTES:DTYPE:OP ... --repeats R --out DIR

smddp runs it under smddp-launch, the mpi4py and gloo baselines under a plain mpirun. For every
case: one checked all-reduce (inputs of ones, the result must be W for SUM, 1 for MIN/MAX/AVG),
`warmup` untimed rounds, then `repeats` timed rounds. A round is a barrier followed by `iters`
back-to-back blocking all-reduces of the same buffer (zeros, so that 16-bit sums never overflow);
its time per all-reduce is `elapsed / iters`. Every rank writes `DIR/rank<r>.json`; the driver
takes, per round, the slowest rank's time (the round ends when the last rank has its result).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

#: What each implementation can reduce; other cases are reported as unsupported, not run.
SUPPORTED_DTYPES = {
    "smddp": {"float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8"},
    "mpi": {"float32", "float64", "int32", "int64", "uint8"},
    "gloo": {"float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8"},
}
SUPPORTED_OPS = {
    "smddp": {"sum", "avg", "min", "max"},
    "mpi": {"sum", "min", "max"},
    "gloo": {"sum", "min", "max"},
}
# How often rank 0 writes its progress for `smddp-bench profile`. A write (a file and a rename) costs
# far more than a small all-reduce: every 20 of them at 4 KiB it added 25 us of system time per
# all-reduce to rank 0, and 17 us to each (39 against 22 us on one host), so it goes by time.
PROGRESS_S = 0.05
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8, "uint8": 1}


@dataclass(frozen=True)
class Case:
    nbytes: int
    dtype: str
    op: str

    @classmethod
    def parse(cls, spec: str) -> Case:
        size, dtype, op = spec.split(":")
        return cls(int(size), dtype, op)

    def spec(self) -> str:
        return f"{self.nbytes}:{self.dtype}:{self.op}"

    @property
    def count(self) -> int:
        return max(1, self.nbytes // ITEMSIZE[self.dtype])


def iters_for(nbytes: int, budget_bytes: int, max_iters: int) -> int:
    """All-reduces per timed round: enough that small messages are not timer noise, identical on every rank."""
    return max(1, min(max_iters, budget_bytes // max(1, nbytes)))


class Impl:
    """One implementation's buffer, all-reduce and barrier."""

    name = ""
    rank = 0
    size = 1

    def settings(self) -> dict[str, Any]:
        return {}

    def buffer(self, case: Case) -> Any:
        raise NotImplementedError

    def fill(self, buf: Any, value: float) -> None:
        raise NotImplementedError

    def values(self, buf: Any) -> np.ndarray:
        raise NotImplementedError

    def allreduce(self, case: Case) -> Callable[[Any], None]:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _bf16_numpy() -> Any:
    try:
        import ml_dtypes

        return ml_dtypes.bfloat16
    except ImportError:
        return None


class SmddpImpl(Impl):
    name = "smddp"

    def __init__(self) -> None:
        import smddp

        self.m = smddp
        smddp.init()
        self.rank, self.size = smddp.rank(), smddp.size()
        self._torch: Any = None

    def settings(self) -> dict[str, Any]:
        job = self.m.client().job
        return {
            "nodes": job.nnodes,
            "workers_per_node": job.local_size,
            "daemon_pids": [d.pid for d in job.daemons],
            "daemon_hosts": [d.tcp_host for d in job.daemons],
        }

    def buffer(self, case: Case) -> Any:
        if case.dtype == "bfloat16":
            bf = _bf16_numpy()
            if bf is not None:
                return np.zeros(case.count, bf)
            import torch

            self._torch = torch
            return torch.zeros(case.count, dtype=torch.bfloat16)
        return np.zeros(case.count, case.dtype)

    def fill(self, buf: Any, value: float) -> None:
        buf[:] = value

    def values(self, buf: Any) -> np.ndarray:
        if self._torch is not None and isinstance(buf, self._torch.Tensor):
            return buf.float().numpy()
        return np.asarray(buf, dtype=np.float64)

    def allreduce(self, case: Case) -> Callable[[Any], None]:
        op = {"sum": self.m.SUM, "avg": self.m.AVG, "min": self.m.MIN, "max": self.m.MAX}[case.op]
        allreduce = self.m.allreduce
        return lambda buf: allreduce(buf, op)

    def barrier(self) -> None:
        self.m.barrier()

    def close(self) -> None:
        self.m.shutdown()


class MpiImpl(Impl):
    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def settings(self) -> dict[str, Any]:
        # Only the parameters a user sets (mpirun's own bookkeeping variables left out).
        internal = {"PREFIXES", "cpu_type", "initial_wdir", "num_procs"}
        keys = sorted(k for k in os.environ if k.startswith("OMPI_MCA_") and k[9:] not in internal)
        return {
            "mpi_library": self.MPI.Get_library_version().strip("\x00 \n").split(",")[0],
            "mca": {k[9:]: os.environ[k] for k in keys},
        }

    def buffer(self, case: Case) -> Any:
        return np.zeros(case.count, case.dtype)

    def fill(self, buf: Any, value: float) -> None:
        buf[:] = value

    def values(self, buf: Any) -> np.ndarray:
        return np.asarray(buf, dtype=np.float64)

    def allreduce(self, case: Case) -> Callable[[Any], None]:
        MPI = self.MPI
        op = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}[case.op]
        comm, in_place = self.comm, MPI.IN_PLACE
        return lambda buf: comm.Allreduce(in_place, buf, op=op)

    def barrier(self) -> None:
        self.comm.Barrier()


class GlooImpl(Impl):
    name = "gloo"

    def __init__(self, threads: int) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        self.torch, self.dist = torch, dist
        self.rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        self.size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
        dist.init_process_group("gloo", rank=self.rank, world_size=self.size)

    def settings(self) -> dict[str, Any]:
        return {
            "torch": self.torch.__version__,
            "torch_threads": self.torch.get_num_threads(),
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", ""),
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", ""),
        }

    def buffer(self, case: Case) -> Any:
        return self.torch.zeros(case.count, dtype=getattr(self.torch, case.dtype))

    def fill(self, buf: Any, value: float) -> None:
        buf.fill_(value)

    def values(self, buf: Any) -> np.ndarray:
        return buf.double().numpy()

    def allreduce(self, case: Case) -> Callable[[Any], None]:
        R = self.dist.ReduceOp
        op = {"sum": R.SUM, "min": R.MIN, "max": R.MAX}[case.op]
        all_reduce = self.dist.all_reduce
        return lambda buf: all_reduce(buf, op=op)

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


def make_impl(name: str, threads: int) -> Impl:
    if name == "smddp":
        return SmddpImpl()
    if name == "mpi":
        return MpiImpl()
    if name == "gloo":
        return GlooImpl(threads)
    raise ValueError(f"unknown implementation {name!r}")


def run_case(
    impl: Impl, case: Case, repeats: int, warmup: int, budget: int, max_iters: int, progress: str = ""
) -> dict[str, Any]:
    rec: dict[str, Any] = {"case": case.spec(), "nbytes": case.nbytes, "dtype": case.dtype, "op": case.op}
    if case.dtype not in SUPPORTED_DTYPES[impl.name] or case.op not in SUPPORTED_OPS[impl.name]:
        rec["supported"] = False
        return rec
    buf = impl.buffer(case)
    ar = impl.allreduce(case)
    impl.fill(buf, 1.0)
    ar(buf)
    want = float(impl.size) if case.op == "sum" else 1.0
    got = impl.values(buf)
    ok = bool(np.all(got == want))
    impl.fill(buf, 0.0)
    iters = iters_for(case.nbytes, budget, max_iters)
    for _ in range(warmup * iters):
        ar(buf)
    times = []
    report = progress if progress and impl.rank == 0 else ""
    for _ in range(repeats):
        impl.barrier()
        t0 = time.perf_counter()
        if report:  # for `smddp-bench profile`: completed all-reduces, at most every PROGRESS_S
            due = t0 + PROGRESS_S
            for i in range(iters):
                ar(buf)
                now = time.perf_counter()
                if now >= due:
                    _write_progress(report, i + 1)
                    due = now + PROGRESS_S
        else:
            for _ in range(iters):
                ar(buf)
        times.append((time.perf_counter() - t0) / iters)
    rec.update(supported=True, ok=ok, iters=iters, times=times)
    return rec


def _write_progress(path: str, done: int) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{done} {time.time()}")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smddp.bench.worker")
    ap.add_argument("--impl", required=True, choices=sorted(SUPPORTED_DTYPES))
    ap.add_argument("--case", action="append", default=[], help="BYTES:DTYPE:OP, repeatable")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--budget-bytes", type=int, default=4 << 20, help="bytes per timed round, at most")
    ap.add_argument("--max-iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (gloo)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", default="", help="rank 0 writes its completed all-reduces here")
    args = ap.parse_args(argv)
    impl = make_impl(args.impl, args.threads)
    t_start = time.time()
    records = [
        run_case(
            impl, Case.parse(s), args.repeats, args.warmup, args.budget_bytes, args.max_iters, args.progress
        )
        for s in args.case
    ]
    settings = impl.settings()
    result = {
        "impl": impl.name,
        "rank": impl.rank,
        "world": impl.size,
        "pid": os.getpid(),
        "settings": settings,
        "started": t_start,
        "finished": time.time(),
        "records": records,
    }
    os.makedirs(args.out, exist_ok=True)
    tmp = os.path.join(args.out, f".rank{impl.rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(args.out, f"rank{impl.rank}.json"))
    impl.close()
    bad = [r["case"] for r in records if r.get("supported") and not r["ok"]]
    if bad:
        print(f"smddp.bench.worker rank {impl.rank}: wrong results for {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
