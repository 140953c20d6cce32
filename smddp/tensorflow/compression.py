"""Gradient compression for the TensorFlow front end: `Compression.none` and `Compression.fp16`."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Compressor:
    """Turns a tensor into what travels (`compress`) and back (`decompress`); the base sends it as is."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """The tensor to reduce, and the context `decompress` needs to restore the original."""
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class NoneCompressor(Compressor):
    """No compression: tensors travel in their own dtype."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and are cast back after the reduction.

    smddp sums and averages float16 in float32 and rounds once at the end (docs/architecture.md),
    so the error is the float16 rounding of the inputs and of the result, not of every partial sum.
    Integer tensors are not touched.
    """

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The compression algorithms, by the names SageMaker's and Horovod's APIs use."""

    none = NoneCompressor
    fp16 = FP16Compressor
