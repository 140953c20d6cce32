"""The reduction kernels on one thread, interleaved: the engine's against the numpy path, per dtype and size."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

from smddp.daemon.kernels import Reducer
from smddp.proto.dtypes import DType, ReduceOp


@dataclass(frozen=True)
class KernelsConfig:
    sizes: tuple[int, ...] = (4 << 10, 256 << 10, 8 << 20)  # bytes per input
    inputs: int = 4
    rounds: int = 7
    dtypes: tuple[DType, ...] = tuple(DType)
    outdir: str = "bench-results"


def run_kernels(cfg: KernelsConfig) -> list[dict]:
    """Median seconds per reduce of `inputs` inputs for each kernel; rounds alternate the kernels."""
    rows = []
    for dtype in cfg.dtypes:
        for size in cfg.sizes:
            n = size // dtype.itemsize
            rng = np.random.default_rng(0)
            xs = [rng.integers(0, 100, n).astype(dtype.storage) for _ in range(cfg.inputs)]
            out = np.empty(n, dtype.storage)
            reps = max(1, (64 << 20) // (size * cfg.inputs))
            times: dict[str, list[float]] = {"numpy": [], "compiled": []}
            for _ in range(cfg.rounds):
                for name in times:
                    r = Reducer(name)
                    t = time.perf_counter()
                    for _ in range(reps):
                        r.reduce(xs, out, dtype, ReduceOp.SUM)
                    times[name].append((time.perf_counter() - t) / reps)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append(
                {
                    "dtype": dtype.label,
                    "bytes": size,
                    "inputs": cfg.inputs,
                    "numpy_s": med["numpy"],
                    "compiled_s": med["compiled"],
                    "compiled_gbps": size * cfg.inputs / med["compiled"] / 1e9,
                    "speedup": med["numpy"] / med["compiled"],
                }
            )
            r0 = rows[-1]
            print(
                f"{dtype.label:>9} {size:>9} B x{cfg.inputs}: numpy {med['numpy'] * 1e6:9.1f} us, "
                f"compiled {med['compiled'] * 1e6:9.1f} us ({r0['compiled_gbps']:.1f} GB/s), {r0['speedup']:.2f}x"
            )
    os.makedirs(cfg.outdir, exist_ok=True)
    with open(os.path.join(cfg.outdir, "kernels.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows
