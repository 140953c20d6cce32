"""smddp's development rigs: the simulated cluster, the CUDA stand-in and the benchmark targets (never shipped)."""
