"""smddp-bench: parses flags into a frozen config and calls the library, nothing more."""

from __future__ import annotations

import argparse
import shlex
import sys

from smddp.bench.runner import IMPLS, BenchError, RunOptions, Topology


def _size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def _list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per launch")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    p.add_argument("--rounds", type=int, default=None, help="launches per implementation, interleaved")
    p.add_argument("--out", default="bench-results", help="output directory")
    p.add_argument("--chunk-kb", type=int, default=1024, help="smddp-launch --chunk-kb")
    p.add_argument("--threads", type=int, default=2, help="smddp-launch --threads")
    p.add_argument("--replicate-kb", type=int, default=256, help="smddp-launch --replicate-kb")
    p.add_argument("--pipeline-kb", type=int, default=8192, help="smddp-launch --pipeline-kb")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--prefix", default="smddpb", help="simulated cluster name prefix")
    p.add_argument("--subnet", default="10.77.9", help="simulated cluster subnet (three octets)")


def _options(a: argparse.Namespace) -> RunOptions:
    return RunOptions(
        repeats=a.repeats,
        warmup=a.warmup,
        chunk_kb=a.chunk_kb,
        threads=a.threads,
        replicate_kb=a.replicate_kb,
        pipeline_kb=a.pipeline_kb,
        timeout_s=a.timeout,
        prefix=a.prefix,
        subnet=a.subnet,
    )


def _topology(a: argparse.Namespace) -> Topology:
    return Topology(nodes=a.nodes, per_node=a.per_node, sim=a.sim, rate_mbit=a.rate_mbit, delay_ms=a.delay_ms)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smddp-bench",
        description="All-reduce benchmarks of smddp against Open MPI (mpi4py) and torch.distributed gloo.",
    )
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("sweep", help="sizes x dtypes x ops for every implementation (the default)")
    s.add_argument("--sizes", default="4K-256M", help="comma list (4K,1M) or a range FROM-TO in steps of 4x")
    s.add_argument("--dtypes", default="float32")
    s.add_argument("--ops", default="sum")
    s.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    s.add_argument(
        "--nodes", type=int, default=1, help="nodes (simulated with --sim, else smddp --local-nodes)"
    )
    s.add_argument("--per-node", type=int, default=4, help="workers per node")
    s.add_argument("--sim", action="store_true", help="run on a simulated cluster (network namespaces, root)")
    s.add_argument("--rate-mbit", type=float, default=None, help="shape simulated links (tbf)")
    s.add_argument(
        "--delay-ms", type=float, default=None, help="one-way delay between simulated nodes (delay line)"
    )
    s.add_argument("--name", default="sweep", help="output file stem")
    _common(s)
    t = sub.add_parser("targets", help="run the T1-T6 setups of issue 4 and write the ratio table")
    t.add_argument("--only", default="", help="comma list of T1..T6 (default: all)")
    t.add_argument("--t6-collectives", type=int, default=10000)
    _common(t)
    m = sub.add_parser("model", help="the scaling model: all-reduce time against node count")
    m.add_argument("--from", dest="source", default="", help="targets.json with measured parameters")
    m.add_argument("--size", default="64M", help="all-reduce size")
    m.add_argument("--check", action="store_true", help="measure 2, 4 and 8 simulated nodes against it")
    m.add_argument("--out", default="bench-results")
    m.add_argument("--repeats", type=int, default=3)
    pr = sub.add_parser("profile", help="CPU per all-reduce of every smddp process (and py-spy)")
    pr.add_argument("--size", default="4K")
    pr.add_argument("--dtype", default="float32")
    pr.add_argument("--nodes", type=int, default=1)
    pr.add_argument("--per-node", type=int, default=4)
    pr.add_argument("--sim", action="store_true")
    pr.add_argument("--rate-mbit", type=float, default=None)
    pr.add_argument("--delay-ms", type=float, default=None, help="one-way delay between simulated nodes")
    pr.add_argument("--seconds", type=float, default=8.0, help="the measuring window")
    pr.add_argument("--py-spy", action="store_true", help="also sample one daemon and one worker")
    pr.add_argument("--name", default="profile")
    _common(pr)
    r = sub.add_parser("report", help="write BENCHMARKS.md from a targets JSON (and model JSON)")
    r.add_argument("--targets", default="bench-results/targets.json")
    r.add_argument("--model", default="bench-results/model.json")
    r.add_argument("--sweeps", default="bench-results", help="directory with sweep-*.json to include")
    r.add_argument("--out", default="BENCHMARKS.md")
    return p


def _sizes(text: str) -> tuple[int, ...]:
    if "-" in text and "," not in text:
        lo, hi = (_size(x) for x in text.split("-"))
        out = []
        s = lo
        while s <= hi:
            out.append(s)
            s *= 4
        return tuple(out)
    return tuple(_size(x) for x in _list(text))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["smddp-bench", *argv])
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["sweep", *argv]
    a = _parser().parse_args(argv)
    try:
        if a.cmd == "sweep":
            from smddp.bench.sweep import SweepConfig, run_sweep

            cfg = SweepConfig(
                sizes=_sizes(a.sizes),
                dtypes=_list(a.dtypes),
                ops=_list(a.ops),
                impls=_list(a.impls),
                topology=_topology(a),
                options=_options(a),
                rounds=a.rounds or 1,
                outdir=a.out,
                name=a.name,
                command=command,
            )
            run_sweep(cfg)
            return 0
        if a.cmd == "targets":
            from smddp.bench.targets import TargetsConfig, run_targets

            tcfg = TargetsConfig(
                only=_list(a.only),
                options=_options(a),
                rounds=a.rounds or 5,
                t6_collectives=a.t6_collectives,
                outdir=a.out,
                command=command,
            )
            run_targets(tcfg)
            return 0
        if a.cmd == "model":
            from smddp.bench.model import ModelConfig, run_model

            run_model(
                ModelConfig(
                    source=a.source, size=_size(a.size), check=a.check, outdir=a.out, repeats=a.repeats
                )
            )
            return 0
        if a.cmd == "profile":
            from smddp.bench.profile import ProfileConfig, run_profile

            run_profile(
                ProfileConfig(
                    topology=_topology(a),
                    nbytes=_size(a.size),
                    dtype=a.dtype,
                    seconds=a.seconds,
                    pyspy=a.py_spy,
                    options=_options(a),
                    outdir=a.out,
                    name=a.name,
                )
            )
            return 0
        if a.cmd == "report":
            from smddp.bench.benchmarks_md import ReportConfig, write_benchmarks_md

            write_benchmarks_md(ReportConfig(targets=a.targets, model=a.model, sweeps=a.sweeps, out=a.out))
            return 0
    except (BenchError, ValueError, OSError) as e:
        print(f"smddp-bench: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
