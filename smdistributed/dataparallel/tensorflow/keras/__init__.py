"""smdistributed.dataparallel.tensorflow.keras: SageMaker's Keras API, which is smddp.tensorflow.keras."""

from smddp.tensorflow.keras import (
    Average,
    Compression,
    DistributedOptimizer,
    Max,
    Min,
    ReduceOp,
    Sum,
    allreduce,
    broadcast,
    broadcast_variables,
    init,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from smdistributed.dataparallel.tensorflow.keras import callbacks

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
