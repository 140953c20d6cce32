"""smddp-bench: nccl-tests style all-reduce benchmarks of smddp against Open MPI and gloo.

- `smddp.bench.worker`: the per-rank timing loop every implementation runs under its own launcher;
- `smddp.bench.runner`: topologies (one host, simulated nodes), launch commands, statistics;
- `smddp.bench.sweep`: sizes x dtypes x ops, written as JSON, markdown and PNG;
- `smddp_rigs.bench.targets`: the T1-T6 setups of issue 4 and their ratios;
- `smddp_rigs.bench.model`: the scaling model of all-reduce time against node count;
- `smddp_rigs.bench.benchmarks_md`: BENCHMARKS.md from the targets' JSON;
- `smddp.bench.cli`: the `smddp-bench` command line.

Nothing is imported here, so that `python -m smddp.bench.worker` starts clean.
"""
