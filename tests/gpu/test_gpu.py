"""The device path on a real GPU (marked `gpu`): every dtype, the compute stream not blocked, DDP on CUDA.

Skipped, with the reason shown, where CuPy cannot reach a CUDA device; the stand-in runs of the same
worker scripts (tests/gpu/test_standin*.py) cover the path everywhere else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, REPO, job_env


def _gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _torch_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


GPUS = _gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU reachable through CuPy here"),
]
needs_torch_cuda = pytest.mark.skipif(not _torch_cuda(), reason="torch has no CUDA here")

HERE = Path(__file__).parent


def launch(world: int, nodes: int, args: list[str], timeout: float = 900, **env: str) -> None:
    cmd = [str(BIN / "smddp-launch"), "-np", str(world), "--local-nodes", str(nodes), "--", sys.executable]
    proc = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, env=job_env(**env), cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def results(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def keep(name: str, data: Any) -> None:
    """Measured figures for BENCHMARKS.md: to $SMDDP_GPU_RESULTS/NAME.json when set (tests/gpu/on_gpu.sh
    sets it), and printed (pytest -s shows them)."""
    print(json.dumps(data))
    where = os.environ.get("SMDDP_GPU_RESULTS")
    if where:
        Path(where, f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")


@pytest.mark.parametrize(
    ("world", "nodes", "array", "node_reduce"),
    [
        (2, 1, "cupy", "host"),
        (4, 2, "cupy", "host"),
        pytest.param(2, 1, "torch", "host", marks=needs_torch_cuda),
        (4, 1, "cupy", "gpu"),
        (4, 2, "cupy", "gpu"),
    ],
    ids=["W2-N1-cupy", "W4-N2-cupy", "W2-N1-torch", "W4-N1-cupy-gpu-step", "W4-N2-cupy-gpu-step"],
)
def test_every_dtype_and_collective_on_the_gpu(
    world: int, nodes: int, array: str, node_reduce: str, tmp_path: Path, clean_host: None
):
    """Workers share the GPU(s); results bit-exact against the reference (torch adds bfloat16). With
    node_reduce gpu every device collective takes the GPU step (the ranks reach each other's staging
    memory on the one device through CUDA IPC), in pieces of 64 KiB slots."""
    from tests.gpu.test_standin import check_records

    args = [str(HERE / "check_device.py"), "--out", str(tmp_path), "--nnodes", str(nodes)]
    env = {"SMDDP_NODE_REDUCE": node_reduce, "SMDDP_STEP_SLOT_KB": "64"} if node_reduce == "gpu" else {}
    launch(world, nodes, [*args, "--runtime", "cupy", "--array", array, "--big"], **env)
    runs = results(tmp_path, world)
    check_records([d["records"] for d in runs], inflight=24)
    for d in runs:
        assert d["runtime"] == "cupy"
        if node_reduce == "gpu":
            assert d["node_reduce_why"] == "" and d["step_count"] == sum(d["device_kinds"].values()), d
        dtypes = {rec["case"]["dtype"] for rec in d["records"]}
        want = {"uint8", "int32", "int64", "float16", "float32", "float64"} | (
            {"bfloat16"} if array == "torch" else set()
        )
        assert want <= dtypes, dtypes


def test_compute_stream_is_not_blocked(tmp_path: Path, clean_host: None):
    """The all-reduce finishes while a long kernel still runs on the stream that produced its buffer,
    and that kernel takes no longer than alone."""
    launch(1, 1, [str(HERE / "check_overlap.py"), "--out", str(tmp_path)])
    (d,) = results(tmp_path, 1)
    keep("overlap", d)
    alone = d["kernel_alone_ms"]
    assert alone > 100
    for r in d["rounds"]:
        assert r["correct"]
        assert r["kernel_running_when_result_ready"], r
        assert r["comm_ms"] < r["kernel_with_comm_ms"], r
        assert r["kernel_with_comm_ms"] < 1.25 * alone, (r, alone)
        assert r["submit_ms"] < 50, r


@needs_torch_cuda
def test_ddp_on_the_gpu_matches_the_cpu_path(tmp_path: Path, clean_host: None):
    import torch

    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    gpu.mkdir()
    cpu.mkdir()
    script = str(HERE / "check_ddp_gpu.py")
    launch(2, 1, [script, "--out", str(gpu), "--device", "cuda"])
    launch(2, 1, [script, "--out", str(cpu), "--device", "cpu"])
    g = [torch.load(gpu / f"rank{r}.pt") for r in range(2)]
    c = [torch.load(cpu / f"rank{r}.pt") for r in range(2)]
    for mode in g[0]:
        for name, t in g[0][mode]["params"].items():
            # Every rank holds the same bits (one all-reduce result), on the GPU as on the CPU ...
            assert torch.equal(t, g[1][mode]["params"][name]), (mode, name)
            assert torch.equal(g[0][mode]["grads"][name], g[1][mode]["grads"][name]), (mode, name)
            # ... and the GPU run follows the CPU run to float32 rounding of the kernels.
            assert torch.allclose(t, c[0][mode]["params"][name], rtol=1e-4, atol=1e-5), (mode, name)
        assert all(abs(a - b) < 1e-4 for a, b in zip(g[0][mode]["losses"], c[0][mode]["losses"], strict=True))


@needs_torch_cuda
@pytest.mark.parametrize("world", [2, 4])
def test_every_consumer_of_a_cuda_work_sees_its_result(world: int, tmp_path: Path, clean_host: None):
    """Issue 28's raw case: `wait()`, `get_future().wait()`, its value, `then()` callbacks and
    chains, the blocking call and a blocking Work's late future, read the exact result, for all-reduce, broadcast, all-gather and
    reduce-scatter, 256 KiB to 64 MiB, one and four in flight."""
    kinds = "allreduce,broadcast,allgather,reduce_scatter"
    args = [str(HERE / "check_ordering.py"), "--out", str(tmp_path), "--device", "cuda", "--rounds", "3"]
    launch(world, 1, [*args, "--kinds", kinds])
    rows = [row for d in results(tmp_path, world) for row in d["rows"]]
    keep(f"consumers-{world}", rows)
    from tests.gpu.check_ordering import PATHS

    assert len(rows) == world * 4 * 4 * 2 * len(PATHS)
    wrong = [row for row in rows if row["wrong"]]
    assert not wrong, wrong


# Issue 28's DDP case: 25.2 M parameters, 25 MB buckets and 4 MiB-or-less ones, the hook too.
BIG_DDP = ["--model", "mlp", "--modes", "default:25,default:1,bucket_view:4,hook:25", "--steps", "10"]


@needs_torch_cuda
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_on_cuda_at_realistic_sizes_matches_gloo_on_cuda(world: int, tmp_path: Path, clean_host: None):
    """Every rank holds the same bits after training; with 2 ranks they are gloo's bits (both add
    the same two addends), with 4 they follow gloo to float32 rounding of the additions' order."""
    import torch

    runs = {b: tmp_path / b for b in ("smddp", "gloo")}
    for backend, out in runs.items():
        out.mkdir()
        args = [str(HERE / "check_ddp_gpu.py"), "--out", str(out), "--device", "cuda", "--backend", backend]
        launch(world, 1, [*args, *BIG_DDP])
    got = {b: [torch.load(out / f"rank{r}.pt") for r in range(world)] for b, out in runs.items()}
    s, g = got["smddp"], got["gloo"]
    for mode in s[0]:
        for name, t in s[0][mode]["params"].items():
            for r in range(1, world):
                assert torch.equal(t, s[r][mode]["params"][name]), (mode, name, r)
                assert torch.equal(g[0][mode]["params"][name], g[r][mode]["params"][name]), (
                    "gloo",
                    mode,
                    name,
                )
            if world == 2:
                assert torch.equal(t, g[0][mode]["params"][name]), (mode, name)
            else:
                assert torch.allclose(t, g[0][mode]["params"][name], rtol=1e-3, atol=1e-5), (mode, name)


def test_gpu_benchmark_runs(tmp_path: Path, clean_host: None):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "smddp.bench.gpu", "--sizes", "1M,16M", "--workers", "1,2", "--repeats", "3"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=job_env(),
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "gpu.json").read_text())
    assert all(r["correct"] for run in report["allreduce"] for r in run["rows"])
    assert all(r["arena_d2h_gbs"] > 0.5 * r["plain_d2h_gbs"] for r in report["copy"]["rows"][-1:])
