"""The device path through real smddp-launch jobs on the stand-in runtime: every dtype, op and collective.

The same worker script runs on a real GPU in tests/gpu/test_gpu.py. Each input is written by a
kernel that runs late on a compute stream, every copy is delayed, and each result is read back
on the compute stream: a missing wait anywhere gives wrong bytes, which the reference catches.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, REPO, job_env

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
SCRIPT = str(HERE / "check_device.py")
# (workers, local nodes, how the client reads the arrays)
CONFIGS = [(2, 1, "dlpack"), (2, 2, "cai"), (4, 1, "cai"), (4, 2, "dlpack")]


def launch(world: int, nodes: int, args: list[str], timeout: float = 600, **env: str) -> Any:
    cmd = [str(BIN / "smddp-launch"), "-np", str(world), "--local-nodes", str(nodes), "--", sys.executable]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, env=job_env(**env), cwd=REPO
    )


def results(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def check_records(per_rank: list[list[dict[str, Any]]], inflight: int) -> None:
    """Every result bit-exact against the reference, and the same bits on every rank."""
    n = len(per_rank[0])
    assert n > 250 and all(len(recs) == n for recs in per_rank)
    bad = [(r, rec) for r, recs in enumerate(per_rank) for rec in recs if not rec["ok"]]
    assert not bad, f"{len(bad)} results differ from the reference, first: {bad[:3]}"
    for i in range(n):
        recs = [per_rank[r][i] for r in range(len(per_rank))]
        assert len({rec["id"] for rec in recs}) == 1
        if recs[0]["case"]["kind"] != "reduce_scatter":
            assert len({rec["digest"] for rec in recs}) == 1, f"ranks disagree on {recs[0]['case']}"
    flying = [rec for rec in per_rank[0] if rec.get("inflight")]
    assert len(flying) == inflight
    assert any(rec["device"] for rec in flying) and any(not rec["device"] for rec in flying)


@pytest.mark.parametrize(("world", "nodes", "via"), CONFIGS, ids=[f"W{w}-N{n}-{v}" for w, n, v in CONFIGS])
def test_every_collective_on_device_buffers(
    world: int, nodes: int, via: str, tmp_path: Path, clean_host: None
):
    args = [SCRIPT, "--out", str(tmp_path), "--nnodes", str(nodes), "--array", via, "--delay-ms", "1"]
    if (world, nodes) == (2, 1):
        args.append("--errors")
    proc = launch(world, nodes, args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = results(tmp_path, world)
    check_records([d["records"] for d in runs], inflight=24)
    for d in runs:
        assert d["runtime"] == "standin" and d["skipped"] == 0
        st = d["stats"]
        # Every copy went through page-locked memory (no staged, blocking copy), and every
        # registration was undone at shutdown, before the segments were unmapped.
        assert st["pageable"] == 0 and st["pinned"] == st["d2h"] + st["h2d"] > 300, st
        assert d["registered"] == 0
    if (world, nodes) == (2, 1):
        for d in runs:
            e = d["errors"]
            assert all(v != "NOT REFUSED" for v in e.values()), e
            assert (
                e["noncontiguous"].startswith("UnsupportedBufferError") and "contiguous" in e["noncontiguous"]
            )
            assert "not supported" in e["int16"] and "not supported" in e["int16_cai"]
            assert e["foreign"].startswith("DeviceUnavailableError") and "not stand-in memory" in e["foreign"]
            assert "another stand-in runtime" in e["other_runtime"]
            assert "stream 0" in e["stream_0"]
            assert e["host_with_stream"].startswith("InvalidArgumentError")
            assert "host memory but the input is device memory" in e["host_out"]
            assert "device memory but the input is host memory" in e["device_out"]
            assert "int32 differs" in e["out_dtype"]


@pytest.mark.parametrize(
    ("world", "nodes", "via"),
    [(2, 1, "dlpack"), (4, 1, "cai"), (4, 2, "dlpack")],
    ids=["W2-N1", "W4-N1", "W4-N2"],
)
def test_every_collective_on_device_buffers_with_the_gpu_step(
    world: int, nodes: int, via: str, tmp_path: Path, clean_host: None
):
    """node_reduce gpu: every device collective runs on the (stand-in) GPUs through the node's ranks'
    shared staging memory; across nodes each rank's slice of its node's sum (all-reduce,
    reduce-scatter) or what it gathers goes to the daemons, and its slice of the result comes back
    (a reduce-scatter's block in place), then the node gathers; every result bit for bit as the host
    path's (the same reference), on every rank, with host collectives and device ones in flight
    together, and (4 ranks) in many pieces of small slots."""
    args = [SCRIPT, "--out", str(tmp_path), "--nnodes", str(nodes), "--array", via, "--delay-ms", "1"]
    # 4 ranks: slots of 64 KiB, so that the larger cases go through in many pieces, reusing the slots.
    slot_kb = "64" if world == 4 else "8192"
    proc = launch(world, nodes, args, SMDDP_NODE_REDUCE="gpu", SMDDP_STEP_SLOT_KB=slot_kb)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = results(tmp_path, world)
    check_records([d["records"] for d in runs], inflight=24)
    for d in runs:
        assert d["node_reduce_why"] == "", d["node_reduce_why"]
        kinds = d["device_kinds"]
        assert (
            set(kinds) == {"allreduce", "reduce_scatter", "allgather", "broadcast"}
            and min(kinds.values()) > 5
        )
        assert d["step_count"] == sum(kinds.values()), d
        assert d["registered"] == 0


def test_node_reduce_gpu_that_cannot_be_had_fails_every_rank_naming_why(tmp_path: Path, clean_host: None):
    """node_reduce gpu where the step cannot run (the driver refuses its kernels' PTX): every rank fails
    at its first device all-reduce, naming why; auto takes the host path instead, saying why in the
    log, and every result is right."""
    args = [SCRIPT, "--out", str(tmp_path), "--nnodes", "1", "--array", "dlpack"]
    proc = launch(2, 1, args, SMDDP_NODE_REDUCE="gpu", SMDDP_STANDIN_PTX_MAX="8.0")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "node_reduce gpu: the node's ranks cannot sum on their GPUs" in out, out[-3000:]
    assert "CUDA_ERROR_UNSUPPORTED_PTX_VERSION" in out, out[-3000:]
    proc = launch(2, 1, args, SMDDP_NODE_REDUCE="auto", SMDDP_STANDIN_PTX_MAX="8.0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device all-reduces go through the host (node_reduce auto)" in proc.stdout + proc.stderr
    runs = results(tmp_path, 2)
    check_records([d["records"] for d in runs], inflight=24)
    for d in runs:
        assert "CUDA_ERROR_UNSUPPORTED_PTX_VERSION" in d["node_reduce_why"] and d["step_count"] == 0


def test_device_buffer_without_a_runtime_is_a_clear_error(tmp_path: Path, clean_host: None):
    """A CUDA buffer on a machine whose runtime (CuPy by default) is not there: refused, nothing sent."""
    proc = launch(
        2, 1, [SCRIPT, "--out", str(tmp_path), "--nnodes", "1", "--runtime", "auto", "--unavailable"]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for d in results(tmp_path, 2):
        msg = d["refused"]
        assert msg.startswith("DeviceUnavailableError: buffer: StandinArray is CUDA memory, but ") or (
            "stand-in array" in msg  # where CuPy and a GPU exist, the runtime refuses a stand-in array
        ), msg
        if "CuPy" in msg and "not importable" in msg:
            assert "smddp[cuda12]" in msg
        assert d["after"] == [3.0] * 4


def test_six_hundred_device_and_host_collectives_in_flight(tmp_path: Path, clean_host: None):
    # 600 small all-reduces in flight at once, one in four on device buffers, on 2 nodes, waited for
    # last first: every result bit-exact. (The device ones are collected, so the DONE thread keeps
    # taking DONEs here; the starts' own taking past MAX_IN_FLIGHT is what tests/multiprocess's
    # host-only flood and test_local_plane's backlog check: with it disabled, this one still passes.)
    args = [SCRIPT, "--out", str(tmp_path), "--nnodes", "2", "--array", "dlpack", "--flood", "600"]
    proc = launch(4, 2, args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for d in results(tmp_path, 4):
        assert d["flood"] == {"started": 600, "bad": 0}, d["flood"]
        assert d["registered"] == 0


@pytest.mark.parametrize(("nodes", "count"), [(1, 1024), (2, 3 << 20)], ids=["whole", "in-pieces"])
def test_a_blocking_call_whose_copy_in_is_late_times_out_and_is_never_written_after(
    tmp_path: Path, clean_host: None, nodes: int, count: int
):
    # Rank 0's own stream is busy for 2 s when it calls a blocking all-reduce with a 0.3 s timeout:
    # it is told so in about that time, its collective is still sent once the copy lands (nothing is
    # skipped: the next collectives pair up right), rank 1 gets the result, and rank 0's is dropped:
    # its array still holds its input after everything completed (nothing writes it after the error).
    # Whole (its copies in line on the caller's stream: Client.device_allreduce_now), and 12 MiB on
    # 2 nodes (in pieces, waited for through collectives.waited).
    args = [SCRIPT, "--out", str(tmp_path), "--nnodes", str(nodes), "--late-copy", str(count)]
    proc = launch(2, nodes, args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = results(tmp_path, 2)
    assert first["call"] == "timed out" and "Timed out waiting 300ms for " in first["why"], first
    assert 0.25 < first["call_s"] < 1.5, first
    assert second["call"] == "returned" and second["call_s"] > 1.0, second
    assert (first["holds"], second["holds"]) == ("input", "result"), (first, second)
    for d in (first, second):
        assert d["again"] == [3.0] * 8 and d["host"] == [3.0] * 4, d
        assert d["registered"] == 0


@pytest.mark.parametrize("node_reduce", ["host", "gpu"])
def test_the_daemons_show_each_ranks_device_copies(
    tmp_path: Path, own_runtime_dir: str, clean_host: None, node_reduce: str
):
    """Each rank's engine counts what it copies between its device and smddp's memory, and the daemons
    show it (`smddp status --json`, the table, the Prometheus metrics: issue 57's S a rank on the host
    path, S/G on the GPU step): on 2 nodes of 2 ranks, the bytes each direction equal what the cases
    copy, worked out here from the cases alone (check_counts.CASES); the broadcast's root sends and
    takes nothing back, the others take it without sending; an all-gather takes back W times what it
    sends; with node_reduce gpu an all-reduce sends and takes back only the rank's slice of it, and an
    all-gather and a broadcast take back only the rank's slice of the result (W/G times what it
    sends; S/G, and the broadcast's root nothing)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tests.gpu.check_counts import CASES
    from tests.observability.test_observability import free_port, smddp_status, wait_for_job

    world, nodes = 4, 2
    port = free_port()
    env = job_env(SMDDP_STANDIN_DELAY_MS="0", SMDDP_NODE_REDUCE=node_reduce)
    cmd = [str(BIN / "smddp-launch"), "-np", str(world), "--local-nodes", str(nodes)]
    cmd += [
        "--metrics-port",
        str(port),
        "--",
        sys.executable,
        str(HERE / "check_counts.py"),
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env
    )
    try:
        wait_for_job(proc, env["SMDDP_JOB_ID"])
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready-*.json"))) < world:
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not finish their cases"
            time.sleep(0.05)
        status = json.loads(smddp_status("--job", env["SMDDP_JOB_ID"], "--json").stdout)
        table = smddp_status("--job", env["SMDDP_JOB_ID"]).stdout
        scraped = []
        for node in range(nodes):
            with urllib.request.urlopen(f"http://127.0.0.1:{port + node}/metrics", timeout=10) as r:
                scraped += [
                    s
                    for f in text_string_to_metric_families(r.read().decode())
                    for s in f.samples
                    if s.name == "smddp_device_copy_bytes_total"
                ]
    finally:
        (tmp_path / "go").touch()
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    want: dict[int, dict[str, int]] = {}
    for rank in range(world):
        d2h = h2d = d2h_n = h2d_n = 0
        for kind, n in CASES:
            nbytes = 4 * n
            if node_reduce == "gpu" and kind.startswith("allreduce"):
                g, local = world // nodes, rank % (world // nodes)
                nbytes = 4 * (n * (local + 1) // g - n * local // g)  # its slice of the node's sum
            sends = kind != "broadcast" or rank == 0
            takes = (
                nbytes * world if kind == "allgather" else 0 if kind == "broadcast" and rank == 0 else nbytes
            )
            if node_reduce == "gpu" and kind in ("broadcast", "allgather") and takes:
                # Each rank takes back its slice of the result alone (the broadcast's root nothing).
                g, local = world // nodes, rank % (world // nodes)
                takes = (
                    nbytes * world // g
                    if kind == "allgather"
                    else 4 * (n * (local + 1) // g - n * local // g)
                )
            d2h, d2h_n = d2h + (nbytes if sends else 0), d2h_n + sends
            h2d, h2d_n = h2d + takes, h2d_n + (takes > 0)
        want[rank] = {
            "rank": rank,
            "d2h_bytes": d2h,
            "h2d_bytes": h2d,
            "d2h_copies": d2h_n,
            "h2d_copies": h2d_n,
            "node_reduce": node_reduce,
        }
    shown = {c["rank"]: c for d in status["daemons"] for c in d["devices"]}
    assert shown == want
    for d in status["daemons"]:  # each daemon shows its own node's ranks (2 a node, by rank order)
        assert sorted(c["rank"] for c in d["devices"]) == [2 * d["node"], 2 * d["node"] + 1]
    assert "device copies" in table
    for rank in range(world):
        assert f"rank {rank}: to host" in table
        assert f"all-reduces summed on: {node_reduce}" in table
    metric = {(s.labels["rank"], s.labels["direction"]): s.value for s in scraped}
    assert metric == {
        (str(r), direction): float(want[r][f"{direction}_bytes"])
        for r in range(world)
        for direction in ("d2h", "h2d")
    }
