"""DistributedOptimizer: a Keras optimizer (Keras 3 or tf-keras) that first averages the gradients across ranks."""

from __future__ import annotations

from typing import Any

import keras

from smddp.tensorflow.compression import Compression
from smddp.tensorflow.errors import InvalidArgumentError
from smddp.tensorflow.ops import ReduceOp, no_autograph
from smddp.tensorflow.tape import GradientReduction

_MARK = "_smddp_reduction"


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = ReduceOp.AVERAGE,
    bucket_cap_mb: float | None = None,
) -> Any:
    """A copy of `optimizer` (same class, same config) that averages gradients over every rank.

    Keras 3 optimizers and tf-keras (Keras 2) ones, new and legacy: what `tf.keras.optimizers`
    gives under TF_USE_LEGACY_KERAS=1, as old SageMaker and Horovod `model.fit` scripts use.

    The copy is an instance of a subclass made for the optimizer's class, whose entry point for
    gradients (`apply()` in Keras 3, which `apply_gradients()` and `model.fit` call;
    `apply_gradients()` in Keras 2) reduces them in fusion buffers first, as
    DistributedGradientTape does; clipping, loss scaling and weight decay then act on the averaged
    gradients, as they would in one process on the global batch. Wrap before training: the copy
    is built from `optimizer.get_config()`, without its variables. Saved models record the
    original class, so they load without smddp.

    `use_locking` is accepted for SageMaker's signature and has no effect.
    """
    del use_locking
    keras2 = _is_tf_keras_optimizer(optimizer)
    if not (keras2 or isinstance(optimizer, keras.optimizers.Optimizer)):
        raise InvalidArgumentError(
            "DistributedOptimizer takes a keras.optimizers.Optimizer (Keras 3) or a tf-keras one "
            f"(tf.keras.optimizers under TF_USE_LEGACY_KERAS=1), got {type(optimizer).__name__}; for "
            "other optimizers wrap the tape instead (smddp.tensorflow.DistributedGradientTape)"
        )
    if getattr(optimizer, _MARK, None) is not None:
        raise InvalidArgumentError("the optimizer is already a DistributedOptimizer")
    if not isinstance(sparse_as_dense, bool):
        raise InvalidArgumentError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
    reduction = GradientReduction.make(
        op, compression, bucket_cap_mb, device_dense, device_sparse, "DistributedOptimizer"
    )
    base = type(optimizer)
    _Distributed: type
    if keras2:

        class _Keras2(base):  # type: ignore[valid-type, misc]
            @no_autograph
            def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
                pairs = list(grads_and_vars)
                grads = [g for g, _ in pairs]
                if grads:
                    grads = getattr(self, _MARK).reduce(grads)
                return super().apply_gradients(
                    list(zip(grads, [v for _, v in pairs], strict=True)), *args, **kwargs
                )

        _Distributed = _Keras2
    else:

        class _Keras3(base):  # type: ignore[valid-type, misc]
            @no_autograph
            def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
                grads = list(grads)
                if grads:
                    grads = getattr(self, _MARK).reduce(grads)
                return super().apply(grads, trainable_variables)

        _Distributed = _Keras3

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


def is_tf_keras(obj: Any) -> bool:
    """Whether `obj` is a tf-keras (Keras 2) object (a model, an optimizer), without importing
    tf-keras where it is not in use."""
    return any(c.__module__.startswith("tf_keras.") for c in type(obj).__mro__)


def _is_tf_keras_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer` is a tf-keras optimizer, new or legacy."""
    if not is_tf_keras(optimizer):
        return False
    import tf_keras

    return isinstance(optimizer, (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer))
