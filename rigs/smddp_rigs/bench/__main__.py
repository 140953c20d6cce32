"""`python -m smddp_rigs.bench {targets,model,node-model,kernels,benchmarks}`: the runs behind BENCHMARKS.md (make bench)."""

from __future__ import annotations

import argparse
import shlex
import sys

from smddp.bench.cli import common_flags, run_options
from smddp.bench.flags import parse_list, parse_size
from smddp.bench.runner import BenchError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m smddp_rigs.bench", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("targets", help="run the T1-T6 setups of issue 4 and write the ratio table")
    t.add_argument("--only", default="", help="comma list of T1..T6 (default: all)")
    t.add_argument("--t6-collectives", type=int, default=10000)
    common_flags(t)
    m = sub.add_parser("model", help="the scaling model: all-reduce time against node count")
    m.add_argument("--from", dest="source", default="", help="targets.json with measured parameters")
    m.add_argument("--size", default="64M", help="all-reduce size")
    m.add_argument("--check", action="store_true", help="measure 2, 4 and 8 simulated nodes against it")
    m.add_argument("--out", default="bench-results")
    m.add_argument("--repeats", type=int, default=3)
    k = sub.add_parser("kernels", help="the reduction kernels on one thread: the engine's against numpy")
    k.add_argument("--rounds", type=int, default=7)
    k.add_argument("--out", default="bench-results")
    nm = sub.add_parser(
        "node-model",
        help="one DDP step's averaging on nodes of 8 GPUs: host path, GPU step, NCCL ring (on paper)",
    )
    nm.add_argument(
        "--gpu-json", default="bench-results/gpu/gpu.json", help="a lent GPU's smddp-bench gpu run"
    )
    r = sub.add_parser("benchmarks", help="write BENCHMARKS.md from the targets, model and sweep JSON")
    r.add_argument("--targets", default="bench-results/targets.json")
    r.add_argument("--model", default="bench-results/model.json")
    r.add_argument("--sweeps", default="bench-results", help="directory with sweep-*.json to include")
    r.add_argument("--out", default="BENCHMARKS.md")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = _parser().parse_args(argv)
    try:
        if a.cmd == "targets":
            from smddp_rigs.bench.targets import TargetsConfig, run_targets

            run_targets(
                TargetsConfig(
                    only=parse_list(a.only),
                    options=run_options(a),
                    rounds=a.rounds or 5,
                    t6_collectives=a.t6_collectives,
                    outdir=a.out,
                    command=shlex.join(["python", "-m", "smddp_rigs.bench", *argv]),
                )
            )
        elif a.cmd == "model":
            from smddp_rigs.bench.model import ModelConfig, run_model

            run_model(
                ModelConfig(
                    source=a.source, size=parse_size(a.size), check=a.check, outdir=a.out, repeats=a.repeats
                )
            )
        elif a.cmd == "node-model":
            from smddp_rigs.bench.node_model import main as node_model

            print(node_model(a.gpu_json or None))
        elif a.cmd == "kernels":
            from smddp_rigs.bench.kernels import KernelsConfig, run_kernels

            run_kernels(KernelsConfig(rounds=a.rounds, outdir=a.out))
        else:
            from smddp_rigs.bench.benchmarks_md import ReportConfig, write_benchmarks_md

            write_benchmarks_md(ReportConfig(targets=a.targets, model=a.model, sweeps=a.sweeps, out=a.out))
    except (BenchError, ValueError, OSError) as e:
        print(f"smddp_rigs.bench: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
