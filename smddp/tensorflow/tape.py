"""DistributedGradientTape: tf.GradientTape whose gradients are averaged across ranks in fusion buffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from smddp.tensorflow.compression import Compression, Compressor
from smddp.tensorflow.errors import InvalidArgumentError
from smddp.tensorflow.ops import (
    ReduceOp,
    check_compression,
    check_op,
    fusion_bytes,
    no_autograph,
    reduce_tensors,
)


@dataclass(frozen=True)
class GradientReduction:
    """How gradients are reduced: op, compression and fusion-buffer size (a tape's or optimizer's settings)."""

    op: ReduceOp
    compression: type[Compressor]
    cap_bytes: int

    @classmethod
    def make(
        cls,
        op: Any,
        compression: Any,
        bucket_cap_mb: float | None,
        device_dense: str,
        device_sparse: str,
        who: str,
    ) -> GradientReduction:
        if device_dense or device_sparse:
            # smddp reduces in host memory through its node daemon; there is no device to choose.
            raise InvalidArgumentError(
                f"{who}: device_dense/device_sparse are not supported (got {device_dense!r}, {device_sparse!r})"
            )
        rop = check_op(op)
        if rop not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise InvalidArgumentError(
                f"{who}: gradients are averaged or summed, not reduced with {rop.name}"
            )
        return cls(rop, check_compression(compression), fusion_bytes(bucket_cap_mb))

    def reduce(self, grads: list[Any]) -> list[Any]:
        return reduce_tensors(grads, self.op, self.compression, self.cap_bytes)


class DistributedGradientTape(tf.GradientTape):
    """Wraps a tf.GradientTape: `gradient()` returns gradients averaged over every rank.

    ``tape = smddp.tensorflow.DistributedGradientTape(tape)`` after the ``with tf.GradientTape()``
    block, as in SageMaker's and Horovod's APIs. The gradients are packed, last variables first,
    into fusion buffers of `bucket_cap_mb` MiB (default: smddp's fusion size, smddp-launch
    --fusion-mb), one dtype per buffer; each buffer is submitted asynchronously as soon as it is
    packed and all are awaited at the end. None gradients stay None; sparse ones are made dense.
    Works eagerly and inside tf.function. Everything else (watch, jacobian, reset, a `with` block)
    is the wrapped tape's.
    """

    def __init__(
        self,
        gradtape: tf.GradientTape,
        device_dense: str = "",
        device_sparse: str = "",
        compression: Any = Compression.none,
        sparse_as_dense: bool = False,
        op: Any = ReduceOp.AVERAGE,
        bucket_cap_mb: float | None = None,
    ) -> None:
        if not isinstance(gradtape, tf.GradientTape):
            raise InvalidArgumentError(
                f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}"
            )
        super().__init__(
            persistent=gradtape._persistent, watch_accessed_variables=gradtape._watch_accessed_variables
        )
        self._inner = gradtape
        # Sparse gradients are always reduced dense, so sparse_as_dense only has to be a bool.
        if not isinstance(sparse_as_dense, bool):
            raise InvalidArgumentError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
        self._reduction = GradientReduction.make(
            op, compression, bucket_cap_mb, device_dense, device_sparse, "DistributedGradientTape"
        )

    def __enter__(self) -> DistributedGradientTape:
        self._inner.__enter__()
        return self

    def __exit__(self, typ: Any, value: Any, traceback: Any) -> None:
        self._inner.__exit__(typ, value, traceback)

    def watch(self, tensor: Any) -> None:
        self._inner.watch(tensor)

    def stop_recording(self) -> Any:
        return self._inner.stop_recording()

    def reset(self) -> None:
        self._inner.reset()

    def watched_variables(self) -> Any:
        return self._inner.watched_variables()

    def jacobian(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped tape's jacobian, not reduced (as Horovod's)."""
        return self._inner.jacobian(*args, **kwargs)

    def batch_jacobian(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.batch_jacobian(*args, **kwargs)

    @no_autograph
    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        grads = self._inner.gradient(
            target, sources, output_gradients=output_gradients, unconnected_gradients=unconnected_gradients
        )
        flat = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, self._reduction.reduce(flat))
