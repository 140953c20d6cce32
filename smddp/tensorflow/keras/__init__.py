"""smddp for Keras (Horovod's `horovod.tensorflow.keras` layout): the TensorFlow API plus `callbacks`."""

from __future__ import annotations

from smddp.tensorflow.basics import init, local_rank, local_size, rank, shutdown, size
from smddp.tensorflow.compression import Compression
from smddp.tensorflow.keras import callbacks
from smddp.tensorflow.ops import Average, Max, Min, ReduceOp, Sum, allreduce, broadcast, broadcast_variables
from smddp.tensorflow.optimizer import DistributedOptimizer

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Max",
    "Min",
    "ReduceOp",
    "Sum",
    "allreduce",
    "broadcast",
    "broadcast_variables",
    "callbacks",
    "init",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
