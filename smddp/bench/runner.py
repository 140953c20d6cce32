"""Running one implementation on one topology: the launch command, the run, and its statistics."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from smddp.bench.worker import ITEMSIZE, Case
from smddp.launcher.mpirun import new_session_base, remove_session_base
from smddp.settings import default
from smddp.transport.netif import service_port

#: Every implementation the bench knows; "mpi-ring" is Open MPI with the ring algorithm forced;
#: "smddp-ofi" is smddp with its daemons on libfabric (--fabric ofi, provider RunOptions.ofi_provider).
IMPLS = ("smddp", "mpi", "mpi-ring", "gloo", "smddp-ofi")
#: What a sweep runs unless told: smddp-ofi only where asked (it differs from smddp only across nodes).
DEFAULT_IMPLS = ("smddp", "mpi", "mpi-ring", "gloo")
#: coll/tuned's number for the ring all-reduce in Open MPI 5 (`ompi_info --param coll tuned --level 9`:
#: "0 ignore, 1 basic linear, 2 nonoverlapping, 3 recursive doubling, 4 ring, 5 segmented ring, ...").
OMPI_RING = 4


class BenchError(RuntimeError):
    """A benchmark run failed (non-zero exit, a timeout, missing results)."""


@dataclass(frozen=True)
class Topology:
    """Where the ranks run: one host, or `nodes` simulated nodes with `per_node` workers each."""

    nodes: int = 1
    per_node: int = 4
    sim: bool = False  # network namespaces (smddp_rigs.simcluster); needs root
    rate_mbit: float | None = None  # tbf rate of every simulated node's egress
    burst: str = "256kb"
    # One-way delay between simulated nodes: SimCluster's userspace delay line (the kernel has no netem).
    delay_ms: float | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise ValueError("nodes and per_node must be at least 1")
        if self.rate_mbit is not None and not self.sim:
            raise ValueError("rate_mbit shapes simulated links only (sim=True)")
        if self.delay_ms is not None and not self.sim:
            raise ValueError("delay_ms delays simulated links only (sim=True)")

    @property
    def workers(self) -> int:
        return self.nodes * self.per_node

    def label(self) -> str:
        if not self.sim:
            extra = f", smddp --local-nodes {self.nodes}" if self.nodes > 1 else ""
            return f"1 host, {self.workers} workers{extra}"
        rate = f", {self.rate_mbit:g} Mbit/s links (tbf burst {self.burst})" if self.rate_mbit else ""
        delay = (
            f", {self.delay_ms:g} ms one-way delay (userspace delay line)"
            if self.delay_ms is not None
            else ""
        )
        per = f"{self.per_node} worker" + ("s" if self.per_node != 1 else "")
        return f"{self.nodes} simulated nodes x {per}{rate}{delay}"


@dataclass(frozen=True)
class RunOptions:
    """How each implementation is run and timed."""

    repeats: int = 5
    warmup: int = 1
    budget_bytes: int = 4 << 20  # bytes moved per timed round at most (small sizes loop)
    max_iters: int = 50
    chunk_kb: int = default("chunk_kb")  # smddp-launch's settings (smddp.settings)
    threads: int = default("threads")
    replicate_kb: int = default("replicate_kb")
    pipeline_kb: int = default("pipeline_kb")
    ofi_provider: str = "tcp"  # smddp-ofi's libfabric provider (tcp: no EFA here)
    torch_threads: int = 1  # gloo ranks: torch.set_num_threads
    progress: str = ""  # worker rank 0 writes its completed all-reduces here (smddp-bench profile)
    timeout_s: float = 900.0
    prefix: str = "smddpb"  # simulated cluster names
    subnet: str = "10.77.9"


@dataclass
class CaseResult:
    nbytes: int
    dtype: str
    op: str
    supported: bool = True
    iters: int = 0
    times: list[float] = field(default_factory=list)  # per round: the slowest rank's time per all-reduce
    median_s: float = 0.0
    min_s: float = 0.0
    max_s: float = 0.0
    spread: float = 0.0  # (max - min) / median over the rounds
    algbw: float = 0.0  # bytes/s, from the median
    busbw: float = 0.0  # algbw * 2 (n-1) / n, n = ranks

    @property
    def count(self) -> int:
        return self.nbytes // ITEMSIZE[self.dtype]


@dataclass
class ImplRun:
    impl: str
    topology: dict[str, Any]
    ranks: int
    command: str
    settings: dict[str, Any]
    wall_s: float
    cases: list[CaseResult]

    def case(self, nbytes: int, dtype: str = "float32", op: str = "sum") -> CaseResult:
        for c in self.cases:
            if (c.nbytes, c.dtype, c.op) == (nbytes, dtype, op):
                return c
        raise KeyError((self.impl, nbytes, dtype, op))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ImplRun:
        return cls(**{**d, "cases": [CaseResult(**c) for c in d["cases"]]})


def busbw_factor(n: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor 2 (n-1)/n: what each rank's link must carry."""
    return 2.0 * (n - 1) / n if n > 1 else 1.0


def stats(case: CaseResult, ranks: int) -> CaseResult:
    """Fill median/min/max/spread/algbw/busbw from `case.times`."""
    if not case.times:
        return case
    med = statistics.median(case.times)
    case.median_s, case.min_s, case.max_s = med, min(case.times), max(case.times)
    case.spread = (case.max_s - case.min_s) / med if med > 0 else 0.0
    case.algbw = case.nbytes / med if med > 0 else 0.0
    case.busbw = case.algbw * busbw_factor(ranks)
    return case


# -- environments ------------------------------------------------------------------------------


class Place:
    """A topology made real: nothing for one host, a SimCluster for simulated nodes."""

    def __init__(self, topo: Topology, opts: RunOptions) -> None:
        self.topo, self.opts = topo, opts
        self.cluster: Any = None
        #: The delay line's counters (delay_ms), once the cluster is down: frames, lateness, CPU seconds.
        self.delayline_stats: dict[str, Any] | None = None

    def __enter__(self) -> Place:
        if self.topo.sim:
            try:
                from smddp_rigs.simcluster import ClusterConfig, SimCluster, SimClusterError, cleanup_stale
            except ImportError as e:
                raise BenchError(
                    "simulated nodes run on the simulated cluster of smddp's development rigs, which the "
                    f"installed package does not ship ({e}); from a source checkout: pip install -e rigs/"
                ) from e
            if os.geteuid() != 0:
                raise BenchError("simulated nodes need root (network namespaces)")

            cleanup_stale(self.opts.prefix)
            cfg = ClusterConfig(
                nodes=self.topo.nodes,
                rate_mbit=self.topo.rate_mbit,
                burst=self.topo.burst,
                prefix=self.opts.prefix,
                subnet=self.opts.subnet,
                uplink=True,
                delay_ms=self.topo.delay_ms,
            )
            try:
                self.cluster = SimCluster(cfg).up()
            except SimClusterError as e:
                raise BenchError(f"simulated cluster: {e}") from e
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cluster is not None:
            from smddp_rigs.simcluster import cleanup_stale

            try:
                self.cluster.down()
                self.delayline_stats = self.cluster.delayline_stats
            finally:
                cleanup_stale(self.opts.prefix)
                self.cluster = None


@contextmanager
def place(topo: Topology, opts: RunOptions) -> Iterator[Place]:
    with Place(topo, opts) as p:
        yield p


def _bin(name: str) -> str:
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    if not found:
        raise BenchError(f"{name} not found beside {sys.executable} or on PATH")
    return found


def mpi_settings(impl: str, ranks_here: int, cores: int) -> list[str]:
    """The Open MPI options of a baseline run: the fair defaults, plus the forced ring for mpi-ring."""
    args = ["--oversubscribe", "--bind-to", "none"]
    if ranks_here > cores:
        # Ranks outnumber cores: a rank waiting for a message must give its core to the one sending it.
        args += ["--mca", "mpi_yield_when_idle", "1"]
    if impl == "mpi-ring":
        # coll/han (priority 35) takes COMM_WORLD when it spans hosts; without it coll/tuned does the
        # all-reduce, and its dynamic rules force the ring whatever the size.
        args += ["--mca", "coll", "^han"]
        args += ["--mca", "coll_tuned_use_dynamic_rules", "1"]
        args += ["--mca", "coll_tuned_allreduce_algorithm", str(OMPI_RING)]
    return args


def build_command(
    impl: str,
    p: Place,
    cases: Sequence[Case],
    outdir: str,
    job_id: str = "",
    opts: RunOptions | None = None,
    program: Sequence[str] = (),
) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """The command line, extra environment and printed settings of one implementation's run.

    Every rank runs the all-reduce loop of `smddp.bench.worker` over `cases`, or `program` instead.
    """
    topo, opts = p.topo, opts or p.opts
    cores = os.cpu_count() or 1
    worker = [sys.executable, "-m", "smddp.bench.worker", "--impl", impl.split("-")[0]]
    worker += ["--repeats", str(opts.repeats), "--warmup", str(opts.warmup), "--out", outdir]
    worker += ["--budget-bytes", str(opts.budget_bytes), "--max-iters", str(opts.max_iters)]
    worker += ["--threads", str(opts.torch_threads)]
    if opts.progress:
        worker += ["--progress", opts.progress]
    for c in cases:
        worker += ["--case", c.spec()]
    if program:
        worker = list(program)
    env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
    settings: dict[str, Any] = {}
    if impl.endswith("-torchrun"):
        return _torchrun_command(p, opts, worker)
    if impl in ("smddp", "smddp-ofi"):
        cmd = [_bin("smddp-launch"), "-np", str(topo.workers)]
        if p.cluster is not None:
            cmd += ["-H", p.cluster.host_list(topo.per_node), "--iface", p.cluster.config.cidr]
            cmd += ["--launch-agent", p.cluster.launch_agent_path()]
        elif topo.nodes > 1:
            cmd += ["--local-nodes", str(topo.nodes)]
        cmd += ["--chunk-kb", str(opts.chunk_kb), "--threads", str(opts.threads)]
        # smddp over sockets unless asked for libfabric (auto would take EFA where there is one).
        fabric = (
            ["--fabric", "ofi", "--ofi-provider", opts.ofi_provider]
            if impl == "smddp-ofi"
            else ["--fabric", "tcp"]
        )
        cmd += fabric
        cmd += [
            "--replicate-kb",
            str(opts.replicate_kb),
            "--pipeline-kb",
            str(opts.pipeline_kb),
            "--",
            *worker,
        ]
        settings = {
            "chunk_kb": opts.chunk_kb,
            "daemon_threads": opts.threads,
            "replicate_kb": opts.replicate_kb,
            "pipeline_kb": opts.pipeline_kb,
            "fabric": " ".join(fabric[1::2]),
        }
        env["SMDDP_JOB_ID"] = job_id or os.urandom(16).hex()
        return cmd, env, settings
    cmd = [_bin("mpirun")]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    mpi = mpi_settings(impl, topo.workers, cores)
    cmd += mpi
    settings["mpirun_options"] = " ".join(mpi)
    if impl == "gloo":
        master = p.cluster.addr(0) if p.cluster is not None else "127.0.0.1"
        gloo_env = {
            "MASTER_ADDR": master,
            "MASTER_PORT": str(service_port()),
            "GLOO_SOCKET_IFNAME": _gloo_ifname(p),
        }
        for k, v in gloo_env.items():
            cmd += ["-x", f"{k}={v}"]
        settings.update(gloo_env, torch_threads=opts.torch_threads)
    cmd += ["-np", str(topo.workers)]
    if p.cluster is not None:
        cmd += [*p.cluster.mpirun_args(), "-H", p.cluster.host_list(topo.per_node)]
    cmd += worker
    return cmd, env, settings


def _gloo_ifname(p: Place) -> str:
    """The interface gloo's ranks talk on: a simulated node's eth0, else loopback."""
    return "eth0" if p.cluster is not None else "lo"


def _torchrun_command(
    p: Place, opts: RunOptions, worker: Sequence[str]
) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """smddp (or gloo) under torchrun: one torchrun per node (through the cluster's launch agent on
    simulated nodes, run together by smddp.bench.fanout), the c10d rendezvous on node 0, the same
    daemon settings as the smddp-launch runs (as the environment variables the daemons read)."""
    topo = p.topo
    if worker[:2] != [sys.executable, "-m"]:
        raise BenchError("under torchrun the per-rank program must be a module (python -m ...)")
    host0 = p.cluster.hosts()[0] if p.cluster is not None else "127.0.0.1"
    port, run_id = service_port(), f"bench-{os.urandom(6).hex()}"
    per_node = [
        _bin("torchrun"),
        *("--nnodes", str(topo.nodes), "--nproc-per-node", str(topo.per_node)),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host0}:{port}", "--rdzv-id", run_id),
        *("--monitor-interval", "0.1"),
        *worker[1:],
    ]
    env = {
        "PYTHONUNBUFFERED": "1",
        "SMDDP_CHUNK_KB": str(opts.chunk_kb),
        "SMDDP_THREADS": str(opts.threads),
        "SMDDP_FABRIC": "tcp",
        "SMDDP_REPLICATE_KB": str(opts.replicate_kb),
        "SMDDP_PIPELINE_KB": str(opts.pipeline_kb),
    }
    env["GLOO_SOCKET_IFNAME"] = _gloo_ifname(p)  # gloo's (gloo-torchrun), as its mpirun runs have it
    if p.cluster is not None:
        env["SMDDP_IFACE"] = p.cluster.config.cidr
        agent = p.cluster.launch_agent_path()
        cmd = [
            sys.executable,
            "-m",
            "smddp.bench.fanout",
            json.dumps([[agent, h, *per_node] for h in p.cluster.hosts()]),
        ]
    elif topo.nodes > 1:
        raise BenchError(
            "smddp under torchrun on one host runs one node (--nodes 1), or simulated nodes (--sim)"
        )
    else:
        cmd = per_node
    settings = {
        "launcher": "torchrun",
        "chunk_kb": opts.chunk_kb,
        "daemon_threads": opts.threads,
        "replicate_kb": opts.replicate_kb,
        "pipeline_kb": opts.pipeline_kb,
        "fabric": "tcp",
    }
    return cmd, env, settings


def run_command(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    # A session directory base of the run's own, as smddp-launch gives its mpiruns (one a killed
    # mpirun left in /tmp stops a later mpirun given the same pid from starting); by the environment,
    # so that the command the results record stays as it was.
    # So is torchrun's log directory (PET_LOG_DIR: its --log-dir, from the environment), removed after:
    # without one, every torchrun leaves a torchelastic_* directory in /tmp.
    base = new_session_base()
    logs = tempfile.mkdtemp(prefix="smddp-bench-torchrun-")
    try:
        return _run_command(
            cmd, {**env, "PRTE_MCA_prte_local_tmpdir_base": base, "PET_LOG_DIR": logs}, timeout
        )
    finally:
        remove_session_base(base)
        shutil.rmtree(logs, ignore_errors=True)


def _run_command(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends the whole job, nothing else
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise BenchError(f"timed out after {timeout:g}s: {shlex.join(cmd)}\n{out[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def launch_ranks(
    impl: str,
    p: Place,
    cases: Sequence[Case],
    log: Any = None,
    job_id: str = "",
    opts: RunOptions | None = None,
    program: Callable[[str], Sequence[str]] | None = None,
) -> tuple[list[str], dict[str, Any], float, list[dict[str, Any]]]:
    """One launch of `impl`, every rank writing DIR/rank<r>.json: the command, its settings, the wall
    time and each rank's record. `program(DIR)`, when given, is what every rank runs instead of the
    all-reduce loop over `cases`."""
    with tempfile.TemporaryDirectory(prefix="smddp-bench-") as outdir:
        os.chmod(outdir, 0o755)
        cmd, env, settings = build_command(
            impl, p, cases, outdir, job_id, opts, program=program(outdir) if program else ()
        )
        if log is not None:
            print(f"# {impl}: {shlex.join(cmd)}", file=log, flush=True)
        t0 = time.monotonic()
        proc = run_command(cmd, env, (opts or p.opts).timeout_s)
        wall = time.monotonic() - t0
        files = [Path(outdir) / f"rank{r}.json" for r in range(p.topo.workers)]
        missing = [f.name for f in files if not f.exists()]
        if proc.returncode or missing:
            raise BenchError(
                f"{impl} run failed (exit {proc.returncode}, missing {missing}): {shlex.join(cmd)}\n"
                + proc.stdout[-4000:]
            )
        return cmd, settings, wall, [json.loads(f.read_text()) for f in files]


def run_impl(
    impl: str,
    p: Place,
    cases: Sequence[Case],
    log: Any = None,
    job_id: str = "",
    opts: RunOptions | None = None,
) -> ImplRun:
    """Run one implementation over `cases` and reduce every rank's times to per-round maxima."""
    if impl not in IMPLS:
        raise BenchError(f"unknown implementation {impl!r} (known: {', '.join(IMPLS)})")
    cmd, settings, wall, per_rank = launch_ranks(impl, p, cases, log, job_id, opts)
    ranks = p.topo.workers
    settings.update(per_rank[0]["settings"])
    results = []
    for i, rec in enumerate(per_rank[0]["records"]):
        case = CaseResult(rec["nbytes"], rec["dtype"], rec["op"], supported=rec["supported"])
        if rec["supported"]:
            case.iters = rec["iters"]
            rounds = zip(*(pr["records"][i]["times"] for pr in per_rank), strict=True)
            case.times = [max(r) for r in rounds]
            stats(case, ranks)
        results.append(case)
    return ImplRun(
        impl=impl,
        topology={**asdict(p.topo), "label": p.topo.label()},
        ranks=ranks,
        command=shlex.join(cmd),
        settings=settings,
        wall_s=wall,
        cases=results,
    )


# -- the machine -------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare numbers: CPU, cores, memory, kernel, versions, load."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "loadavg_1_5_15": list(os.getloadavg()),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    import numpy

    import smddp

    info["numpy"] = numpy.__version__
    info["smddp"] = smddp.__version__
    try:
        import mpi4py

        info["mpi4py"] = mpi4py.__version__
        out = subprocess.run([_bin("ompi_info"), "--version"], capture_output=True, text=True, timeout=30)
        info["open_mpi"] = out.stdout.split("\n")[0].strip()
    except (ImportError, BenchError, OSError, subprocess.SubprocessError):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def have_torch() -> bool:
    try:
        import torch  # noqa: F401

        return True
    except ImportError:
        return False
