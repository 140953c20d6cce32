"""The reduction kernel on one thread, interleaved: the engine's (the daemon's) against numpy's ufuncs, per dtype and size."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

from smddp.proto.dtypes import DType, ReduceOp
from smddp_rigs import _engine_testing


def numpy_sum(xs: list[np.ndarray], out: np.ndarray, dtype: DType, acc: np.ndarray) -> None:
    """The same sum by numpy's ufuncs: folded left to right, 16-bit floats carried in float32 (`acc`)."""
    if dtype.accumulator == dtype.storage:
        np.add(xs[0], xs[1], out=out)
        for x in xs[2:]:
            np.add(out, x, out=out)
        return
    if dtype == DType.FLOAT16:
        np.copyto(acc, xs[0])
        for x in xs[1:]:
            np.add(acc, x, out=acc)
        np.copyto(out, acc, casting="unsafe")
        return
    wide = acc.view(np.uint32)  # bfloat16 bits widen exactly by a shift; truncated back (a baseline)
    np.left_shift(xs[0].astype(np.uint32), 16, out=wide)
    for x in xs[1:]:
        np.add(acc, np.left_shift(x.astype(np.uint32), 16).view(np.float32), out=acc)
    np.right_shift(wide, 16, out=wide)
    np.copyto(out, wide, casting="unsafe")


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
            acc = np.empty(n, np.float32)
            reps = max(1, (64 << 20) // (size * cfg.inputs))
            times: dict[str, list[float]] = {"numpy": [], "compiled": []}
            for _ in range(cfg.rounds):
                for name in times:
                    t = time.perf_counter()
                    for _ in range(reps):
                        if name == "numpy":
                            numpy_sum(xs, out, dtype, acc)
                        else:
                            _engine_testing.reduce(int(dtype), int(ReduceOp.SUM), xs, out, 0)
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
