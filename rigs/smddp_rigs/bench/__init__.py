"""The benchmark rigs behind BENCHMARKS.md: the T1-T6 targets, the scaling model and the report writer."""
