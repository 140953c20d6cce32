"""smddp-bench: parses flags into a frozen config and calls the library, nothing more."""

from __future__ import annotations

import argparse
import shlex
import sys

from smddp.bench.flags import parse_list, parse_size, parse_sizes
from smddp.bench.runner import DEFAULT_IMPLS, IMPLS, BenchError, RunOptions, Topology
from smddp.settings import default


def common_flags(p: argparse.ArgumentParser, rounds: bool = True) -> None:
    """Flags every subcommand shares; `rounds`: the all-reduce loop's timed and untimed rounds too."""
    if rounds:
        p.add_argument("--repeats", type=int, default=5, help="timed rounds per launch")
        p.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    p.add_argument("--rounds", type=int, default=None, help="launches per implementation, interleaved")
    p.add_argument("--out", default="bench-results", help="output directory")
    for name, flag in (
        ("chunk_kb", "--chunk-kb"),
        ("threads", "--threads"),
        ("replicate_kb", "--replicate-kb"),
        ("pipeline_kb", "--pipeline-kb"),
    ):
        p.add_argument(flag, dest=name, type=int, default=default(name), help=f"smddp-launch {flag}")
    p.add_argument(
        "--ofi-provider", default=RunOptions.ofi_provider, help="the libfabric provider of the smddp-ofi runs"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--prefix", default="smddpb", help="simulated cluster name prefix")
    p.add_argument("--subnet", default="10.77.9", help="simulated cluster subnet (three octets)")


def run_options(a: argparse.Namespace) -> RunOptions:
    isolated = getattr(a, "isolated", False)
    return RunOptions(
        # Isolated: one all-reduce per timed round, so ten times the rounds for a median as steady.
        repeats=getattr(a, "repeats", RunOptions.repeats) * (10 if isolated else 1),
        max_iters=1 if isolated else RunOptions.max_iters,
        warmup=getattr(a, "warmup", RunOptions.warmup),
        chunk_kb=a.chunk_kb,
        threads=a.threads,
        replicate_kb=a.replicate_kb,
        pipeline_kb=a.pipeline_kb,
        ofi_provider=a.ofi_provider,
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
    s.add_argument(
        "--impls",
        default=",".join(DEFAULT_IMPLS),
        help=f"comma list of {', '.join(IMPLS)} (default: all but smddp-ofi)",
    )
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
    s.add_argument(
        "--isolated",
        action="store_true",
        help="a barrier before every all-reduce, each timed alone (as a training step meets it); "
        "default: a barrier before each round of back-to-back all-reduces",
    )
    common_flags(s)
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
    common_flags(pr)
    d = sub.add_parser("ddp", help="a DDP training step on smddp against gloo (the user's number)")
    d.add_argument(
        "--nodes", type=int, default=2, help="nodes (simulated with --sim, else smddp --local-nodes)"
    )
    d.add_argument("--per-node", type=int, default=2, help="workers per node")
    d.add_argument("--sim", action="store_true", help="run on a simulated cluster (network namespaces, root)")
    d.add_argument("--rate-mbit", type=float, default=None, help="shape simulated links (tbf)")
    d.add_argument("--width", type=int, default=1024, help="the MLP's hidden width")
    d.add_argument("--depth", type=int, default=11, help="hidden layers (11 x 1024 wide: 11.8 M parameters)")
    d.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    d.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    d.add_argument("--steps", type=int, default=20, help="timed steps per launch")
    d.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    d.add_argument("--name", default="ddp", help="output file stem")
    d.add_argument(
        "--launcher",
        choices=["smddp-launch", "torchrun"],
        default="smddp-launch",
        help="torchrun: also run smddp under torchrun, interleaved, against smddp-launch (step and start-up)",
    )
    d.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model and DDP run (cuda: GPU local rank %% GPUs)",
    )
    common_flags(d, rounds=False)
    # Parsed by smddp.bench.gpu and smddp.bench.torch_gpu themselves (main() hands them the rest).
    sub.add_parser(
        "gpu",
        add_help=False,
        help="device copies and all-reduce of device buffers (GPU, or --runtime standin)",
    )
    sub.add_parser(
        "torch-gpu",
        add_help=False,
        help="torch.distributed all-reduce of CUDA tensors: smddp, gloo, the copy floor",
    )
    r = sub.add_parser("report", help="write the markdown (and PNG) of sweep results again from their JSON")
    r.add_argument("results", nargs="+", help="sweep JSON files (NAME.json, as `sweep` wrote them)")
    r.add_argument("--out", default="", help="output directory (default: beside each JSON file)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["smddp-bench", *argv])
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["sweep", *argv]
    if argv[0] == "gpu":
        from smddp.bench.gpu import main as gpu_main

        return gpu_main(argv[1:], prog="smddp-bench gpu")
    if argv[0] == "torch-gpu":
        from smddp.bench.torch_gpu import main as torch_gpu_main

        return torch_gpu_main(argv[1:], prog="smddp-bench torch-gpu")
    a = _parser().parse_args(argv)
    try:
        if a.cmd == "sweep":
            from smddp.bench.sweep import SweepConfig, run_sweep

            cfg = SweepConfig(
                sizes=parse_sizes(a.sizes),
                dtypes=parse_list(a.dtypes),
                ops=parse_list(a.ops),
                impls=parse_list(a.impls),
                topology=_topology(a),
                options=run_options(a),
                rounds=a.rounds or 1,
                outdir=a.out,
                name=a.name,
                command=command,
            )
            run_sweep(cfg)
            return 0
        if a.cmd == "profile":
            from smddp.bench.profile import ProfileConfig, run_profile

            run_profile(
                ProfileConfig(
                    topology=_topology(a),
                    nbytes=parse_size(a.size),
                    dtype=a.dtype,
                    seconds=a.seconds,
                    pyspy=a.py_spy,
                    options=run_options(a),
                    outdir=a.out,
                    name=a.name,
                )
            )
            return 0
        if a.cmd == "ddp":
            from smddp.bench.ddp import DdpConfig, run_ddp

            run_ddp(
                DdpConfig(
                    topology=Topology(nodes=a.nodes, per_node=a.per_node, sim=a.sim, rate_mbit=a.rate_mbit),
                    options=run_options(a),
                    width=a.width,
                    depth=a.depth,
                    batch=a.batch,
                    bucket_mb=a.bucket_mb,
                    steps=a.steps,
                    warmup=a.warmup,
                    rounds=a.rounds or 3,
                    device=a.device,
                    outdir=a.out,
                    name=a.name,
                    command=command,
                    launcher=a.launcher,
                )
            )
            return 0
        if a.cmd == "report":
            from smddp.bench.sweep import rewrite_outputs

            for path in a.results:
                rewrite_outputs(path, a.out)
            return 0
    except (BenchError, ValueError, OSError) as e:
        print(f"smddp-bench: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
