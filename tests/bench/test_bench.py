"""smddp-bench: a tiny sweep through real launches (smddp and Open MPI on one host), its outputs checked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from smddp.bench.flags import parse_sizes
from smddp.bench.runner import OMPI_RING, busbw_factor, mpi_settings
from tests.conftest import BIN, REPO, need_module

pytestmark = pytest.mark.bench


def test_busbw_factor_and_sizes():
    assert busbw_factor(1) == 1.0
    assert busbw_factor(2) == 1.0
    assert busbw_factor(4) == 1.5
    assert parse_sizes("4K-256M") == tuple(4096 << (2 * i) for i in range(9))
    assert parse_sizes("4K,1M") == (4096, 1 << 20)


def test_mpi_settings_are_fair_and_ring_is_forced():
    assert mpi_settings("mpi", 2, 2) == ["--oversubscribe", "--bind-to", "none"]
    assert "mpi_yield_when_idle" in mpi_settings("mpi", 4, 2)
    ring = mpi_settings("mpi-ring", 4, 2)
    assert (
        ring[-4:]
        == [
            "--mca",
            "coll_tuned_use_dynamic_rules",
            "1",
            "--mca",
            "coll_tuned_allreduce_algorithm",
            str(OMPI_RING),
        ][-4:]
    )
    assert "coll_tuned_use_dynamic_rules" in ring


@pytest.mark.timeout(120)
def test_tiny_sweep_writes_consistent_json_and_markdown(tmp_path):
    workers = 4
    cmd = [
        str(BIN / "smddp-bench"),
        *("sweep", "--sizes", "4K,256K", "--repeats", "2", "--impls", "smddp,mpi"),
        *("--per-node", str(workers), "--out", str(tmp_path), "--name", "tiny", "--timeout", "100"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "tiny.json").read_text())
    assert result["kind"] == "sweep" and result["ranks"] == workers
    assert result["machine"]["cores"] >= 1
    assert [r["impl"] for r in result["runs"]] == ["smddp", "mpi"]
    for run in result["runs"]:
        assert run["command"] and run["ranks"] == workers
        assert [c["nbytes"] for c in run["cases"]] == [4096, 256 * 1024]
        for c in run["cases"]:
            assert c["supported"] and c["dtype"] == "float32" and c["op"] == "sum"
            assert len(c["times"]) == 2 and c["iters"] >= 1
            assert c["min_s"] <= c["median_s"] <= c["max_s"]
            assert c["algbw"] == pytest.approx(c["nbytes"] / c["median_s"])
            assert c["busbw"] == pytest.approx(c["algbw"] * 2 * (workers - 1) / workers)
    assert "Mode: **back-to-back**" in (tmp_path / "tiny.md").read_text()
    mpi = result["runs"][1]
    assert "--oversubscribe" in mpi["command"] and "--bind-to none" in mpi["command"]
    assert mpi["settings"]["mpi_library"].startswith("Open MPI")
    md = (tmp_path / "tiny.md").read_text()
    assert "| size | dtype | op | smddp time | mpi time |" in md
    assert "## smddp" in md and "## mpi" in md
    assert md.count("| 4 KiB |") == 3 and md.count("| 256 KiB |") == 3  # side by side + one per impl
    if importlib.util.find_spec("matplotlib") is not None:
        png = (tmp_path / "tiny.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # `smddp-bench report` writes the same markdown again from the JSON alone.
    again = tmp_path / "again"
    proc = subprocess.run(
        [str(BIN / "smddp-bench"), "report", str(tmp_path / "tiny.json"), "--out", str(again)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert (again / "tiny.md").read_text() == md


@pytest.mark.timeout(120)
def test_isolated_sweep_times_each_call_after_a_barrier(tmp_path):
    """`--isolated`: one all-reduce per timed round (iters 1), ten times the rounds."""
    cmd = [
        str(BIN / "smddp-bench"),
        *("sweep", "--isolated", "--sizes", "4K", "--repeats", "2", "--impls", "smddp,mpi"),
        *("--per-node", "2", "--out", str(tmp_path), "--name", "iso", "--timeout", "100"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "iso.json").read_text())
    assert result["config"]["options"]["max_iters"] == 1
    for run in result["runs"]:
        (c,) = run["cases"]
        assert c["iters"] == 1 and len(c["times"]) == 20 and c["median_s"] > 0
    assert "Mode: **isolated**" in (tmp_path / "iso.md").read_text()


def tiny_ddp(tmp_path: Path, name: str, order: list[str], *extra: str) -> dict[str, Any]:
    """`smddp-bench ddp` of a tiny MLP on 2 ranks, one launch each, `extra` flags added: its JSON,
    once the launches ran in `order`."""
    need_module("torch", "make setup installs it")
    cmd = [
        str(BIN / "smddp-bench"),
        *("ddp", "--width", "64", "--depth", "1", "--steps", "3", "--warmup", "1", "--rounds", "1"),
        *("--nodes", "1", "--per-node", "2", *extra),
        *("--out", str(tmp_path), "--name", name, "--timeout", "120"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = [line.split()[-1] for line in proc.stderr.splitlines() if "smddp-bench ddp: round" in line]
    assert ran == order, proc.stderr
    return json.loads((tmp_path / f"{name}.json").read_text())


@pytest.mark.timeout(420)
def test_tiny_ddp_step_benchmark(tmp_path):
    """`smddp-bench ddp --launcher torchrun`: stock DDP on smddp under smddp-launch, under torchrun, and
    on gloo under mpirun and under torchrun (torchrun's own start-up), launches interleaved; the same
    bits under both launchers."""
    res = tiny_ddp(
        tmp_path, "tinyddp", ["smddp", "smddp-torchrun", "gloo", "gloo-torchrun"], "--launcher", "torchrun"
    )
    assert res["kind"] == "ddp" and res["ranks"] == 2
    assert res["params"] == 256 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    for impl in ("smddp", "smddp-torchrun", "gloo", "gloo-torchrun"):
        (run,) = res["runs"][impl]
        assert len(run["step_s"]) == 3 and all(s > 0 for s in run["step_s"])
        assert run["torch_threads"] == 1 and run["startup_s"] > 0
    assert res["runs"]["smddp"][0]["command"].split()[0].endswith("smddp-launch")
    assert res["runs"]["smddp-torchrun"][0]["command"].split()[0].endswith("torchrun")
    assert res["runs"]["gloo"][0]["command"].split()[0].endswith("mpirun")
    assert res["runs"]["gloo-torchrun"][0]["command"].split()[0].endswith("torchrun")
    assert res["ratio"] == pytest.approx(res["median_s"]["smddp"] / res["median_s"]["gloo"])
    t = res["torchrun"]
    assert t["same_bits"] is True
    assert t["step_ratio"] == pytest.approx(res["median_s"]["smddp-torchrun"] / res["median_s"]["smddp"])
    md = (tmp_path / "tinyddp.md").read_text()
    assert f"smddp / gloo: **{res['ratio']:.3f}**" in md and "| gloo |" in md and "| smddp-torchrun |" in md
    assert f"step **{t['step_ratio']:.3f}**" in md
    assert t["gloo_startup_ratio"] == pytest.approx(
        res["startup_s"]["gloo-torchrun"] / res["startup_s"]["gloo"]
    )
    assert f"gloo under torchrun / under mpirun, start-up: {t['gloo_startup_ratio']:.2f}" in md
    assert res["device"] == "cpu" and ", on the CPU:" in md
    # smddp's launches say which torch backend they ran on (the C++ one: CI has a compiler)
    assert (
        res["runs"]["smddp"][0]["torch_backend"] == "native" and "torch_backend" not in res["runs"]["gloo"][0]
    )
    assert "(smddp on its native torch backend)" in md


def test_ddp_step_benchmark_reads_the_compute_floor(tmp_path):
    """`smddp-bench ddp`: smddp, gloo and the step without its all-reduces (compute, launched as gloo,
    DDP's averaging replaced by a hook that keeps each bucket), interleaved; the floor read from them.
    compute's replicas differ (nothing is averaged); smddp's and gloo's are the same bits."""
    res = tiny_ddp(tmp_path, "floor", ["smddp", "gloo", "compute"])
    assert res["runs"]["compute"][0]["command"].split()[0].endswith("mpirun")
    assert "--impl compute" in res["runs"]["compute"][0]["command"]
    m, f = res["median_s"], res["floor"]
    assert f["smddp_s"] == pytest.approx(m["smddp"] - m["compute"])
    assert f["gloo_s"] == pytest.approx(m["gloo"] - m["compute"])
    assert f["best_ratio"] == pytest.approx(m["compute"] / m["gloo"])
    md = (tmp_path / "floor.md").read_text()
    assert "| compute |" in md and f"smddp / gloo would be {f['best_ratio']:.3f}" in md


@pytest.mark.timeout(150)
def test_ddp_benchmark_on_cuda(tmp_path):
    """`smddp-bench ddp --device cuda`: on a GPU, DDP on CUDA with both backends, the device named;
    where torch reaches no GPU (CI), the first launch fails at once and says why."""
    torch = need_module("torch", "make setup installs it")
    cmd = [
        str(BIN / "smddp-bench"),
        *("ddp", "--device", "cuda", "--nodes", "1", "--width", "64", "--depth", "1", "--steps", "2"),
        *("--warmup", "1", "--rounds", "1", "--out", str(tmp_path), "--name", "cudaddp", "--timeout", "120"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140, cwd=REPO)
    if not torch.cuda.is_available():
        assert proc.returncode != 0
        assert "--device cuda, but torch" in proc.stdout + proc.stderr, (
            proc.stdout[-3000:] + proc.stderr[-3000:]
        )
        assert not (tmp_path / "cudaddp.json").exists()
        return
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "cudaddp.json").read_text())
    assert res["device"] == torch.cuda.get_device_name(0)
    assert f"on CUDA ({res['device']}" in (tmp_path / "cudaddp.md").read_text()


def test_module_entry_point_prints_help():
    proc = subprocess.run(
        [sys.executable, "-m", "smddp.bench", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert proc.returncode == 0
    assert all(cmd in proc.stdout for cmd in ("sweep", "profile", "ddp", "gpu", "report")), proc.stdout
    # The runs behind BENCHMARKS.md are rigs, outside the package.
    assert "targets" not in proc.stdout and "model" not in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "smddp_rigs.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0
    assert all(cmd in proc.stdout for cmd in ("targets", "model", "benchmarks")), proc.stdout


def test_target_checks_and_table():
    from smddp_rigs.bench.benchmarks_md import _miss
    from smddp_rigs.bench.targets import Check, target_table

    ok = Check("T1", "busbw", 0.95, 0.93, ">=", "Gbit/s", [0.94, 0.96])
    bad = Check("T4", "time ratio", 3.0, 2.0, "<=")
    assert ok.met and not bad.met
    table = target_table([ok, bad])
    assert "| T1 | busbw | 0.95 Gbit/s | >= 0.93 Gbit/s | 0.94, 0.96 | - | met |" in table
    assert "**missed**" in table
    assert _miss(ok) == "" and "1.50x the limit" in _miss(bad)


def test_kernels_benchmark_writes_both_kernels(tmp_path):
    """`python -m smddp_rigs.bench kernels`: one row per dtype and size, both kernels timed."""
    from smddp_rigs.bench.kernels import KernelsConfig, run_kernels

    from smddp.proto.dtypes import DType

    cfg = KernelsConfig(sizes=(4096,), rounds=1, dtypes=(DType.FLOAT32, DType.BFLOAT16), outdir=str(tmp_path))
    rows = run_kernels(cfg)
    saved = json.loads((tmp_path / "kernels.json").read_text())
    assert saved == rows and [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    assert all(r["numpy_s"] > 0 and r["compiled_s"] > 0 and r["bytes"] == 4096 for r in rows)


def sweep(name, times):
    """A sweep's JSON as the figures read it: each implementation's float32 sums, size -> median s."""
    runs = [
        {
            **{"impl": impl, "topology": {}, "ranks": 4, "command": "", "settings": {}, "wall_s": 1.0},
            "cases": [{"nbytes": n, "dtype": "float32", "op": "sum", "median_s": t} for n, t in by.items()],
        }
        for impl, by in times.items()
    ]
    return {"config": {"name": name}, "runs": runs}


def test_engine_figures_from_sweeps_profiles_and_ddp():
    """Issue 17's section: each figure computed from the runs' JSON, the misses named with their factor."""
    from smddp_rigs.bench.engine_md import engine_section

    host = sweep(
        "sweep-host4",
        {
            "smddp": {4096: 40e-6, 1 << 20: 3e-3, 16 << 20: 9e-3},
            "mpi": {4096: 20e-6, 1 << 20: 2e-3, 16 << 20: 10e-3},
            "mpi-ring": {4096: 30e-6, 1 << 20: 1e-3, 16 << 20: 12e-3},
            "gloo": {4096: 5e-3, 1 << 20: 6e-3, 16 << 20: 20e-3},
        },
    )
    large = sweep("sweep-host2-large", {"smddp": {256 << 20: 0.2, 1 << 30: 0.9}, "mpi": {256 << 20: 0.15}})

    def profile(nbytes, wall_us, daemon_us):
        procs = [{"role": "daemon", "user_us": daemon_us / 2, "sys_us": daemon_us / 2}, {"role": "worker"}]
        return {"config": {"nbytes": nbytes}, "wall_us": wall_us, "processes": procs}

    # T3 has a check of the same name: the T1 one is taken.
    targets = {
        "checks": [
            {"target": "T3", "name": "time smddp / gloo, 64 MiB", "value": 0.35},
            {"target": "T1", "name": "time smddp / gloo, 64 MiB", "value": 0.98},
        ]
    }
    out = "\n".join(
        engine_section(
            targets,
            {"sweep-host4": host, "sweep-host2-large": large},
            {"profile-host4-4k": profile(4096, 50.0, 30.0)},
            {"profile-host4-4k": profile(4096, 700.0, 360.0)},
            {"ddp-sim4": {"ratio": 0.9}},
        )
    )
    assert "| 1 host, 4 workers: 4 KiB, smddp / Open MPI | 2 | <= 2 | 40 us against 20 us | met |" in out
    # 1 MiB: 3 ms against mpi-ring's 1 ms is the slowest (3x); 16 MiB is below the best (9 against 10).
    assert (
        "slowest size against the best of mpi, mpi-ring, gloo | 3 | <= 1.5 | 1 MiB against mpi-ring |" in out
    )
    assert "above 1: 1 MiB 3.00 |" in out
    assert "| 1 host, 2 daemons x 1 worker: 1 GiB time / 256 MiB time | 4.5 | <= 4.2 |" in out
    assert "| T1: 64 MiB, smddp / gloo | 0.98 | <= 1 | - | met |" in out
    assert "| DDP step, 4 simulated nodes: smddp / gloo | 0.9 | <= 0.85 | - | **missed** |" in out
    assert "daemon CPU per 4 KiB all-reduce, before / now | 12 | >= 5 | 360 us -> 30 us | met |" in out
    assert "1.06x the limit" in out  # the DDP miss, named with its factor
    assert "| 1 host, 4 workers, 4 KiB | 700 us |" in out and "| 12.0x |" in out


def test_worker_figures_from_sweeps_ddp_and_calls():
    """Issue 29's section: each figure from the runs' JSON, the calls against the blocking call with
    the floors of a Python and a C++ backend beside the torch ones."""
    from smddp_rigs.bench.engine_md import worker_section

    sweeps = {
        "sweep-host4-isolated": sweep("sweep-host4-isolated", {"smddp": {4096: 30e-6}, "mpi": {4096: 20e-6}}),
        "sweep-sim4-isolated": sweep("sweep-sim4-isolated", {"smddp": {4096: 260e-6}, "mpi": {4096: 80e-6}}),
        "sweep-host4": sweep(
            "sweep-host4",
            {
                "smddp": {4096: 25e-6, 16 << 20: 5.5e-3},
                "mpi": {4096: 24e-6, 16 << 20: 5.3e-3},
                "mpi-ring": {4096: 33e-6, 16 << 20: 4.1e-3},
            },
        ),
    }
    calls = [
        {
            "size": 4096,
            "slowest_s": {
                "blocking": 25e-6,
                "async.wait": 26e-6,
                "torch": 45e-6,
                "torch.async": 60e-6,
                "torch.floor": 32e-6,
                "torch.floor.native": 40e-6,
            },
        }
    ]
    out = "\n".join(worker_section(sweeps, {"ddp-host1x4": {"ratio": 0.81}}, calls))
    assert (
        "| 1 host, 4 workers, isolated: 4 KiB, smddp / Open MPI | 1.5 | <= 1.5 | 30 us against 20 us | met |"
        in out
    )
    assert "| 4 simulated nodes x 1 at 1 Gbit/s, isolated: 4 KiB, smddp / Open MPI | 3.25 | <= 1.3 |" in out
    # 16 MiB: 5.5 ms against the ring's 4.1 ms is the slowest (1.34x); 4 KiB (1.04x) is under the limit.
    assert "4 KiB to 256 MiB: slowest size against the best of mpi, mpi-ring, gloo | 1.34 | <= 1.2 |" in out
    assert "16 MiB against mpi-ring; above 1.2: 16 MiB 1.34 | **missed** |" in out
    assert "| DDP step, 1 host, 4 workers: smddp / gloo | 0.81 | <= 0.75 | - | **missed** |" in out
    assert (
        "| async.wait at 4 KiB: time / the blocking call | 1.04 | <= 1.2 | 26.0 us against 25.0 us | met |"
        in out
    )
    assert "| torch at 4 KiB: time / the blocking call | 1.8 | <= 1.2 |" in out
    assert (
        "45.0 us against 25.0 us; a Python backend's floor: 1.28x; a C++ backend's floor: 1.60x | **missed** |"
        in out
    )
    assert worker_section({}, {}, []) == []


def test_ofi_beside_tcp(tmp_path):
    """smddp-ofi (the daemons on libfabric's tcp provider) runs beside smddp in one sweep, and the
    BENCHMARKS.md section of issue 18 reads the pair from a setup that ran both."""
    from smddp_rigs.bench.benchmarks_md import ofi_section

    from smddp.bench.runner import ImplRun

    cmd = [
        str(BIN / "smddp-bench"),
        *("sweep", "--sizes", "4K,64M", "--repeats", "2", "--impls", "smddp,smddp-ofi"),
        *("--nodes", "2", "--per-node", "1", "--out", str(tmp_path), "--name", "ofi", "--timeout", "100"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "ofi.json").read_text())
    runs = {r["impl"]: r for r in result["runs"]}
    assert "--fabric ofi --ofi-provider tcp" in runs["smddp-ofi"]["command"]
    assert "--fabric tcp" in runs["smddp"]["command"]
    assert runs["smddp-ofi"]["settings"]["fabric"] == "ofi tcp"
    for impl in runs:
        assert all(c["median_s"] > 0 for c in runs[impl]["cases"])
    setup = {
        "topology": result["config"]["topology"],
        "runs": runs,
        "rounds": {i: [r] for i, r in runs.items()},
    }
    text = "\n".join(ofi_section({"setups": {"sim4": setup}}))
    tcp4k = ImplRun.from_json(runs["smddp"]).case(4096, "float32").median_s
    assert "## The ofi fabric beside TCP (issue 18)" in text
    assert f"| 4 KiB | {tcp4k * 1e3:.3f} ms |" in text and "| 64 MiB |" in text
    assert ofi_section({"setups": {}}) == []


def test_gpu_section_reads_a_lent_gpus_results(tmp_path):
    """BENCHMARKS.md's GPU section from bench-results/gpu/ (what tests/gpu/on_gpu.sh brought back from
    an H200): the tests' verdict, wrong reads per consumer path, the overlap, each benchmark's table;
    a stand-in run or none at all says that there are no GPU numbers."""
    from smddp_rigs.bench.benchmarks_md import gpu_section

    text = "\n".join(gpu_section(REPO / "bench-results" / "gpu"))
    assert "On NVIDIA H200" in text and "**10 passed in" in text
    assert "| 2 | 0 of 480 | 0 of 480 | 0 of 480 | 0 of 480 | 0 of 480 |" in text
    assert "| 4 | 0 of 960 |" in text
    assert "a kernel of 447 ms alone took 400, 400, 400 ms" in text
    assert "This run: smddp at 16db982" in text  # the newest run's notes, before its tables
    for title in (
        "### Device buffers through the client",
        "### torch.distributed on CUDA tensors",
        "### Stock DDP on CUDA",
    ):
        assert title in text
    # The newest run's two DDP tables, then the earlier runs' (bench-results/gpu/<date>/), newest
    # first: each one's notes, its settings, its consumer checks, its two DDP tables.
    assert text.count("smddp / gloo: **") == 8
    third = text.index("### An earlier run: 2026-11-28")
    second = text.index("### An earlier run: 2026-11-27")
    first = text.index("### An earlier run: 2026-11-26")
    assert text.index("### Stock DDP on CUDA") < third < second < first
    assert "This run: smddp at 78c45a3" in text[third:second]
    assert "Settings: --threads 2, device buffers whole" in text[second:first]
    assert "| 2 | 0 of 480 |" in text[second:first]  # its own consumer checks
    assert "on smddp at 124c217" in text[first:] and "a kernel of 427 ms alone" in text[first:]
    (tmp_path / "gpu.json").write_text(json.dumps({"runtime": "standin"}))
    assert "**No GPU numbers**" in "\n".join(gpu_section(tmp_path))
    assert "**No GPU numbers**" in "\n".join(gpu_section(tmp_path / "absent"))


@pytest.mark.timeout(180)
def test_calls_rig_writes_what_benchmarks_md_quotes(tmp_path):
    """`python -m smddp_rigs.bench.calls --out` (make bench): every call interleaved in one job of
    2 workers, each timed; NAME.json and NAME.md with the ratios to the blocking call and the target's
    verdict, which BENCHMARKS.md's section renders."""
    need_module("torch", "make setup installs it")
    from smddp_rigs.bench.benchmarks_md import render
    from smddp_rigs.bench.calls import CALLS, TARGETS

    cmd = [sys.executable, "-m", "smddp_rigs.bench.calls", "--np", "2", "--rounds", "20", "--warmup", "3"]
    cmd += ["--out", str(tmp_path), "--name", "calls-t"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "calls-t.json").read_text())
    assert report["kind"] == "calls" and report["np"] == 2 and report["rounds"] == 20
    assert set(report["slowest_s"]) == set(CALLS) and all(v > 0 for v in report["slowest_s"].values())
    md = (tmp_path / "calls-t.md").read_text()
    ratio = report["slowest_s"]["torch"] / report["slowest_s"]["blocking"]
    assert f"| torch | {report['slowest_s']['torch'] * 1e6:.1f} | {ratio:.2f} |" in md
    x, why = TARGETS["torch"]
    assert f"torch at most {x}x ({why}): {'met' if ratio <= x else 'missed'}" in md
    assert report["torch_backend"] == "native"  # (the default group; torch.python is the Python one)
    targets = json.loads((REPO / "bench-results" / "targets.json").read_text())
    text = render(targets, None, [], calls=[report])
    assert "## One call, the way a training step meets it (issues 29 and 58)" in text and md.strip() in text


@pytest.mark.timeout(180)
def test_calls_rig_times_the_device_path_on_the_stand_in(tmp_path):
    """`python -m smddp_rigs.bench.calls --device` (make bench, issue 28): the device path's calls on
    the stand-in with its operations at once, beside the host's blocking call, in BENCHMARKS.md's own
    section and not among issue 29's figures."""
    need_module("torch", "make setup installs it")
    from smddp_rigs.bench.benchmarks_md import render
    from smddp_rigs.bench.calls import DEVICE_CALLS

    cmd = [sys.executable, "-m", "smddp_rigs.bench.calls", "--device", "--np", "2", "--rounds", "20"]
    cmd += ["--warmup", "3", "--out", str(tmp_path), "--name", "calls-dev"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "calls-dev.json").read_text())
    assert report["kind"] == "calls-device" and report["np"] == 2
    assert set(report["slowest_s"]) == set(DEVICE_CALLS) and all(v > 0 for v in report["slowest_s"].values())
    md = (tmp_path / "calls-dev.md").read_text()
    extra = (report["slowest_s"]["torch.device"] - report["slowest_s"]["blocking"]) * 1e6
    assert f"torch.device {extra:.0f} us" in md and "SMDDP_STANDIN_IMMEDIATE=1" in md
    targets = json.loads((REPO / "bench-results" / "targets.json").read_text())
    text = render(targets, None, [], calls=[report])
    assert "## One device call's own cost, on the stand-in (issue 28)" in text and md.strip() in text
    assert "## One call, the way a training step meets it" not in text and "torch.device at" not in text


@pytest.mark.timeout(120)
def test_copies_rig_sums_to_the_bit_both_ways(monkeypatch):
    """`python -m smddp_rigs.bench.copies` (docs/performance.md's copy-fewer figures): both ways leave
    the ranks' left-to-right float32 sum in every rank's buffer, on either page size, and a way that
    leaves anything else is refused rather than timed."""
    from smddp_rigs.bench import copies

    for huge in (False, True):
        cfg = copies.CopiesConfig(workers=3, sizes=(1 << 20, 3 << 20), chunk=64 << 10, rounds=1, huge=huge)
        res = copies.run(cfg)
        assert set(res) == {str(1 << 20), str(3 << 20)}
        assert all(t["staging"] > 0 and t["cma"] > 0 for t in res.values())
    real, skipped = copies._move, []

    def short(fn, pid, remote, n, local):  # one chunk of the sum never written back to its rank
        if fn.__name__ == "process_vm_writev" and not skipped:
            skipped.append(pid)
            return
        real(fn, pid, remote, n, local)

    monkeypatch.setattr(copies, "_move", short)
    with pytest.raises(AssertionError, match="cma left another sum"):
        copies.run(copies.CopiesConfig(workers=2, sizes=(1 << 20,), chunk=64 << 10, rounds=1))
