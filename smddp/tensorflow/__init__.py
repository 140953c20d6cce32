"""smddp for TensorFlow: the SageMaker / Horovod style API (DistributedGradientTape, DistributedOptimizer, ...)."""

from __future__ import annotations

from smddp.tensorflow.basics import init, is_initialized, local_rank, local_size, rank, shutdown, size
from smddp.tensorflow.compression import Compression, Compressor, FP16Compressor, NoneCompressor
from smddp.tensorflow.hooks import BroadcastGlobalVariablesHook
from smddp.tensorflow.keras.callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback
from smddp.tensorflow.ops import (
    BROADCASTABLE_DTYPES,
    REDUCIBLE_DTYPES,
    Average,
    Max,
    Min,
    ReduceOp,
    Sum,
    allreduce,
    broadcast,
    broadcast_global_variables,
    broadcast_variables,
    oob_allreduce,
    overlap,
)
from smddp.tensorflow.optimizer import DistributedOptimizer
from smddp.tensorflow.tape import DistributedGradientTape, GradientReduction

__all__ = [
    "BROADCASTABLE_DTYPES",
    "REDUCIBLE_DTYPES",
    "Average",
    "BroadcastGlobalVariablesCallback",
    "BroadcastGlobalVariablesHook",
    "Compression",
    "Compressor",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "FP16Compressor",
    "GradientReduction",
    "Max",
    "MetricAverageCallback",
    "Min",
    "NoneCompressor",
    "ReduceOp",
    "Sum",
    "allreduce",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_variables",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "oob_allreduce",
    "overlap",
    "rank",
    "shutdown",
    "size",
]
