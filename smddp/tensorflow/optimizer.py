"""DistributedOptimizer: a Keras 3 optimizer whose apply() first averages the gradients across ranks."""

from __future__ import annotations

from typing import Any

import keras

from smddp.tensorflow.compression import Compression
from smddp.tensorflow.errors import InvalidArgumentError
from smddp.tensorflow.ops import ReduceOp, no_autograph
from smddp.tensorflow.tape import GradientReduction

_MARK = "_smddp_reduction"


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = ReduceOp.AVERAGE,
    bucket_cap_mb: float | None = None,
) -> keras.optimizers.Optimizer:
    """A copy of `optimizer` (same class, same config) that averages gradients over every rank.

    The copy is an instance of a subclass made for the optimizer's class, whose `apply()` (which
    `apply_gradients()` and `model.fit` call) reduces the gradients in fusion buffers first, as
    DistributedGradientTape does; clipping, loss scaling and weight decay then act on the averaged
    gradients, as they would in one process on the global batch. Wrap before training: the copy
    is built from `optimizer.get_config()`, without its variables. Saved models record the
    original class, so they load without smddp.

    `use_locking` is accepted for SageMaker's signature and has no effect (Keras 3 has no locking).
    """
    del use_locking
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"DistributedOptimizer takes a keras.optimizers.Optimizer, got {type(optimizer).__name__}; "
            "for other optimizers wrap the tape instead (smddp.tensorflow.DistributedGradientTape)"
        )
    if getattr(optimizer, _MARK, None) is not None:
        raise InvalidArgumentError("the optimizer is already a DistributedOptimizer")
    if not isinstance(sparse_as_dense, bool):
        raise InvalidArgumentError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
    reduction = GradientReduction.make(
        op, compression, bucket_cap_mb, device_dense, device_sparse, "DistributedOptimizer"
    )
    base = type(optimizer)

    class _Distributed(base):  # type: ignore[valid-type, misc]
        @no_autograph
        def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
            grads = list(grads)
            if grads:
                grads = getattr(self, _MARK).reduce(grads)
            return super().apply(grads, trainable_variables)

    # The subclass passes for the original in messages and in saved models (Keras serializes
    # the class by module and name), so a checkpoint loads as a plain optimizer.
    _Distributed.__name__ = base.__name__
    _Distributed.__qualname__ = base.__qualname__
    _Distributed.__module__ = base.__module__
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    dist = _Distributed.from_config(config)
    setattr(dist, _MARK, reduction)
    return dist
