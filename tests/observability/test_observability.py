"""smddp status, Prometheus metrics, the timeline and the stall inspector, against real jobs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from smddp.transport.netif import service_port
from tests.conftest import BIN, REPO, job_env, need_module, need_programs

pytestmark = pytest.mark.observability

WORKER = str(Path(__file__).parent / "obs_worker.py")


def launch(args: list[str], worker_args: list[str], env: dict[str, str]) -> subprocess.Popen:
    cmd = [str(BIN / "smddp-launch"), "-np", "4", "--local-nodes", "2", *args]
    cmd += ["--", sys.executable, WORKER, *worker_args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env
    )


def smddp_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "smddp"), "status", *args], capture_output=True, text=True, timeout=30)


def wait_for_job(proc: subprocess.Popen, job: str, timeout: float = 60, last_node: int = 1) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listed = smddp_status("--json")
        if listed.returncode == 0 and any(
            d["job"] == job and d["node"] == last_node for d in json.loads(listed.stdout)
        ):
            return
        assert proc.poll() is None and time.monotonic() < deadline, "the job did not come up"
        time.sleep(0.1)


def free_port() -> int:
    return service_port()  # never one the kernel may hand a daemon's listener meanwhile


def test_status_of_a_running_multi_node_job(tmp_path, own_runtime_dir, clean_host):
    env = job_env()
    job = env["SMDDP_JOB_ID"]
    # The job runs until the last status call is done: on a loaded machine five calls of `smddp status`
    # (a Python start each) took longer than 400 iterations did, and the last found no job.
    stop = tmp_path / "stop"
    proc = launch([], ["--iterations", "400", "--pause", "0.01", "--until-file", str(stop)], env)
    try:
        wait_for_job(proc, job)
        # One job on the host: plain `smddp status` shows its table; --list the one-line list.
        single = smddp_status()
        listing = smddp_status("--list")
        time.sleep(1.0)
        first = json.loads(smddp_status("--job", job[:10], "--json").stdout)
        time.sleep(1.5)
        second = json.loads(smddp_status("--job", job[:10], "--json").stdout)
        table = smddp_status("--job", job).stdout
    finally:
        stop.touch()
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-2000:]
    assert single.returncode == 0 and f"job {job}" in single.stdout and "NODE" in single.stdout, single.stdout
    assert listing.stdout.splitlines()[0].startswith("JOB") and job in listing.stdout, listing.stdout
    assert first["job"] == job and first["nnodes"] == 2 and first["world"] == 4
    for a, b in zip(first["daemons"], second["daemons"], strict=True):
        # Every daemon, not only the local one: node, host, pid, state, workers, peers, numbers.
        assert a["node"] == b["node"] and a["pid"] == b["pid"] and a["state"] == "running"
        assert a["workers"] == {"connected": 2, "expected": 2, "ranks": a["workers"]["ranks"]}
        assert sorted(a["workers"]["ranks"]) == [2 * a["node"], 2 * a["node"] + 1]
        assert [p["connected"] for p in a["peers"]] == [True]
        # Numbers that move between two calls.
        assert b["collectives"]["done"] > a["collectives"]["done"]
        assert b["peers"][0]["bytes_out"] > a["peers"][0]["bytes_out"] > 0
        assert b["uptime_s"] > a["uptime_s"]
        assert b["reduction"]["gbytes_per_s"] > 0
        assert b["peers"][0]["rate_out"] > 0
    assert "NODE" in table and "running" in table and "current throughput" in table


def test_metrics_scrape_parses(tmp_path, clean_host):
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    env = job_env()
    stop = tmp_path / "stop"  # the job's daemons serve their metrics until both are scraped
    worker_args = ["--iterations", "300", "--pause", "0.01", "--until-file", str(stop)]
    proc = launch(["--metrics-port", str(port)], worker_args, env)
    try:
        wait_for_job(proc, env["SMDDP_JOB_ID"])
        time.sleep(1.0)
        scraped = {}
        for node in (0, 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{port + node}/metrics", timeout=10) as r:
                scraped[node] = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    finally:
        stop.touch()
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-2000:]
    for node, families in scraped.items():
        for name in (
            "smddp_collectives",
            "smddp_peer_bytes",
            "smddp_collective_latency_seconds",
            "smddp_queue_depth",
            "smddp_collectives_in_flight",
            "smddp_reduced_bytes",
        ):
            assert name in families, (node, sorted(families))
        done = [s for s in families["smddp_collectives"].samples if s.name == "smddp_collectives_total"]
        assert sum(s.value for s in done) > 0
        buckets = [
            s for s in families["smddp_collective_latency_seconds"].samples if s.name.endswith("_bucket")
        ]
        assert any(s.labels["le"] == "+Inf" and s.value > 0 for s in buckets)
        # The first attempt of the job (smddp-launch --max-restarts counts them).
        assert [s.value for s in families["smddp_job_attempt"].samples] == [0], (node, sorted(families))


@pytest.mark.parametrize("front", ["numpy", pytest.param("torch", marks=pytest.mark.torch)])
def test_timeline_has_every_phase_of_every_collective(front, tmp_path, clean_host):
    """Every phase of every collective on the timeline, from smddp's calls and from torch's through
    its C++ backend (the engine's table: the same collectives, the same lanes)."""
    if front == "torch":
        need_module("torch", "pip install -e '.[torch]'")
    trace = tmp_path / "trace.json"
    proc = launch(
        ["--timeline", str(trace)],
        ["--iterations", "5", *(["--torch"] if front == "torch" else [])],
        job_env(),
    )
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-2000:]
    events = json.loads(trace.read_text())["traceEvents"]
    boxes = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in boxes)
    seqs = range(1, 5 + 3 + 1)  # 5 all-reduces, a broadcast, an all-gather, a final all-reduce
    by = {}
    for e in boxes:
        by.setdefault((e["pid"], e["cat"]), set()).add(e["args"]["seq"])
    for r in range(4):
        for phase in ("copy in", "in flight", "copy out"):
            assert by[(f"rank {r}", phase)] == set(seqs), (r, phase)
    reduces = {1, 2, 3, 4, 5, 8}
    for node in (0, 1):
        daemon = f"node {node} daemon"
        assert by[(daemon, "wait for local ranks")] == set(seqs)
        assert by[(daemon, "local reduce")] == reduces
        assert by[(daemon, "server reduce")] == reduces
        assert by[(daemon, "send")] == set(seqs)
        assert by[(daemon, "receive")] == set(seqs)
    assert by[("node 1 daemon", "local copy")] >= {6, 7}  # broadcast root and all-gather block


def poll_stalled(job: str, timeout: float = 30) -> list:
    """`smddp status --json` until some daemon of `job` shows a stalled collective (or `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = smddp_status("--job", job, "--json")
        if got.returncode == 0:
            stalled = [s for d in json.loads(got.stdout)["daemons"] for s in d.get("stalled", [])]
            if stalled:
                return stalled
        time.sleep(0.2)
    return []


def test_stalled_rank_named_by_inspector_and_status(clean_host):
    env = job_env()
    job = env["SMDDP_JOB_ID"]
    proc = launch(["--stall-warning-s", "1"], ["--iterations", "2", "--late-rank", "3", "--late-s", "6"], env)
    try:
        wait_for_job(proc, job)
        stalled = poll_stalled(job)
    finally:
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-2000:]
    assert stalled, "status never showed the stall"
    assert any(any(w.startswith("rank 3 ") for w in s["waiting_for"]) for s in stalled), stalled
    warnings = [line for line in out.splitlines() if "has waited" in line]
    assert any("rank 3 (node 1" in line for line in warnings), out[-2000:]
    assert any("node 0" in line and "node 1 (" in line for line in warnings)  # node 0 waits for node 1


def test_one_node_on_the_engine_status_and_stalls(clean_host):
    """A job on one node runs on the engine data plane: `smddp status` counts its collectives and the
    stall inspector names the late rank from the plane's own record of who has submitted."""
    env = job_env()
    job = env["SMDDP_JOB_ID"]
    args = ["--local-nodes", "1", "--stall-warning-s", "1"]
    proc = launch(args, ["--iterations", "2", "--late-rank", "3", "--late-s", "6"], env)
    try:
        wait_for_job(proc, job, last_node=0)
        stalled = poll_stalled(job)
        time.sleep(7)  # the late rank comes; the job finishes its iterations
        final = smddp_status("--job", job, "--json")
    finally:
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-2000:]
    assert stalled, "status never showed the stall"
    assert all(s["waiting_for"] == [w for w in s["waiting_for"] if w.startswith("rank 3 ")] for s in stalled)
    assert any("allreduce(" in s["what"] or "barrier(" in s["what"] for s in stalled), stalled
    warnings = [line for line in out.splitlines() if "has waited" in line]
    assert any("rank 3 (node 0" in line for line in warnings), out[-2000:]
    if final.returncode == 0:  # the job may have ended already
        done = json.loads(final.stdout)["daemons"][0]["collectives"]["done"]
        assert done > 0, final.stdout


def _doc_scrape_config() -> str:
    """The scrape configuration docs/observability.md gives users."""
    doc = (REPO / "docs" / "observability.md").read_text()
    block = re.search(r"```yaml\n(scrape_configs:.*?)```", doc, re.S)
    assert block, "docs/observability.md has no scrape configuration"
    return block.group(1)


def _prom_query(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _per_node(port: int, query: str) -> dict[int, float]:
    return {int(s["metric"]["node"]): float(s["value"][1]) for s in _prom_query(port, query)}


def test_prometheus_scrapes_a_job(tmp_path, own_runtime_dir, clean_host):
    """A real Prometheus with the documented scrape configuration: counters read back through its
    HTTP API rise during the job and, once it is quiet, equal what `smddp status --json` says."""
    need_programs("prometheus", install="prometheus")
    metrics, prom_port = free_port(), free_port()
    while metrics + 1 == prom_port:
        prom_port = free_port()
    config = _doc_scrape_config()
    config = re.sub(r"scrape_interval: \S+", "scrape_interval: 500ms", config)
    config = re.sub(
        r"- targets: \[.*\]", f'- targets: ["127.0.0.1:{metrics}", "127.0.0.1:{metrics + 1}"]', config
    )
    (tmp_path / "prometheus.yml").write_text(config)
    prom_log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 (closed in finally)
    prom = subprocess.Popen(
        [
            shutil.which("prometheus") or "/usr/bin/prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=prom_log,
        stderr=prom_log,
        start_new_session=True,
    )
    # Prometheus up and scraping (its first scrapes follow target discovery by seconds) before the
    # job starts, so that it sees the counters rise; the targets are down until then.
    ready = time.monotonic() + 60
    while True:
        try:
            url = f"http://127.0.0.1:{prom_port}/api/v1/targets"
            with urllib.request.urlopen(url, timeout=2) as r:
                targets = json.loads(r.read())["data"]["activeTargets"]
            if len(targets) == 2 and all(t["lastScrape"] > "2000" for t in targets):
                break
        except OSError:
            pass
        assert prom.poll() is None and time.monotonic() < ready, (tmp_path / "prometheus.log").read_text()[
            -2000:
        ]
        time.sleep(0.1)
    quiet = tmp_path / "quiet"
    env = job_env()
    job = env["SMDDP_JOB_ID"]
    proc = launch(
        ["--metrics-port", str(metrics)],
        ["--iterations", "400", "--pause", "0.01", "--quiet-file", str(quiet), "--linger-s", "8"],
        env,
    )
    try:
        wait_for_job(proc, job)
        rising: list[dict[int, float]] = []
        deadline = time.monotonic() + 60
        while not quiet.exists() and time.monotonic() < deadline:
            try:
                got = _per_node(prom_port, "sum by (node) (smddp_collectives_total)")
            except OSError:  # Prometheus still starting
                got = {}
            if len(got) == 2 and (not rising or got != rising[-1]):
                rising.append(got)
            time.sleep(0.3)
        assert quiet.exists(), "the job did not finish its collectives"
        # Quiet now: wait for a scrape of both targets that started after the last collective.
        since = float(quiet.read_text())
        while time.monotonic() < deadline:
            last = _per_node(prom_port, "timestamp(smddp_collectives_in_flight)")
            if len(last) == 2 and min(last.values()) > since + 0.2:
                break
            time.sleep(0.2)
        from_prom = {
            "done": _per_node(prom_port, "sum by (node) (smddp_collectives_total)"),
            "bytes_out": _per_node(prom_port, 'sum by (node) (smddp_peer_bytes_total{direction="out"})'),
            "bytes_in": _per_node(prom_port, 'sum by (node) (smddp_peer_bytes_total{direction="in"})'),
            "reduced": _per_node(prom_port, "smddp_reduced_bytes_total"),
        }
        status = json.loads(smddp_status("--job", job, "--json").stdout)
        up = [float(r["value"][1]) for r in _prom_query(prom_port, 'up{job="smddp"}')]
    finally:
        out = proc.communicate(timeout=120)[0]
        prom.terminate()
        try:
            prom.wait(timeout=15)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        prom_log.close()
    assert proc.returncode == 0, out[-2000:]
    assert up == [1.0, 1.0], up  # both targets scraped
    # They moved: distinct readings during the job, each node's count never falling.
    assert len(rising) >= 2, (rising, (tmp_path / "prometheus.log").read_text()[-2000:])
    for node in (0, 1):
        seq = [r[node] for r in rising]
        assert seq == sorted(seq) and seq[-1] > seq[0], seq
    for d in status["daemons"]:
        n = d["node"]
        assert from_prom["done"][n] == d["collectives"]["done"], (n, from_prom, d["collectives"])
        assert from_prom["bytes_out"][n] == sum(p["bytes_out"] for p in d["peers"])
        assert from_prom["bytes_in"][n] == sum(p["bytes_in"] for p in d["peers"])
        assert from_prom["reduced"][n] == d["reduction"]["bytes"]
        assert d["collectives"]["done"] >= 403  # the 400 all-reduces and the 3 after them
