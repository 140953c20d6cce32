"""Keras callbacks: broadcast the initial variables, average the epoch's metrics, warm up and schedule the learning rate."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

import smddp
from smddp.tensorflow.errors import InvalidArgumentError
from smddp.tensorflow.ops import broadcast_variables, check_root
from smddp.tensorflow.optimizer import is_tf_keras

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]

log = logging.getLogger("smddp.tensorflow")

# tf.keras's Callback: Keras 3's, or tf-keras's (Keras 2) under TF_USE_LEGACY_KERAS=1, as the
# model.fit these callbacks are given to. Keras 2's fit cannot drive a Keras 3 callback.
_Callback: Any = tf.keras.callbacks.Callback


def _optimizer_variables(opt: Any) -> list[Any]:
    """An optimizer's variables: a list in Keras 3, a method in tf-keras."""
    v = opt.variables
    return list(v() if callable(v) else v)


class BroadcastGlobalVariablesCallback(_Callback):
    """Makes every rank start `model.fit` from root's variables: the model's and the optimizer's.

    Keras 3: at the start of training, when the model is built, the optimizer is built too (as
    Keras would on the first step) and all variables are broadcast, so the first step already
    starts from the same weights everywhere. A model that is not built until it sees data (a
    subclassed model never called) is broadcast after the first batch instead, as Horovod does.
    tf-keras (Keras 2), whose optimizers make their slots on the first step: after the first batch,
    as Horovod does there. Only once per callback, however many times fit() is called. `device`
    is Horovod's argument and must be ''.
    """

    def __init__(self, root_rank: int = 0, device: str = "") -> None:
        super().__init__()
        if device:
            raise InvalidArgumentError(
                f"BroadcastGlobalVariablesCallback: device is not supported (got {device!r})"
            )
        self.root_rank = check_root(root_rank)
        self.broadcast_done = False

    def _broadcast(self, after_first_batch: bool) -> None:
        if self.broadcast_done:
            return
        model = self.model
        opt = getattr(model, "optimizer", None)
        if is_tf_keras(model):
            if not after_first_batch:
                return
        else:
            if not after_first_batch and not (model.built and model.variables):
                return  # variables appear with the first batch: broadcast after it
            if opt is not None and not opt.built:
                opt.build(model.trainable_variables)
        variables = list(model.variables) + (_optimizer_variables(opt) if opt is not None else [])
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._broadcast(after_first_batch=False)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._broadcast(after_first_batch=True)


class MetricAverageCallback(_Callback):
    """At each epoch's end, replaces every numeric metric in `logs` with its average over the ranks.

    Put it before callbacks that read the metrics (ModelCheckpoint, EarlyStopping, ...). One
    all-reduce per epoch, of the metrics in sorted-name order (every rank has the same names).
    """

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and _is_number(v))
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        smddp.allreduce(values, op=smddp.AVG)
        for k, v in zip(keys, values, strict=True):
            logs[k] = float(v)


class LearningRateScheduleCallback(_Callback):
    """Horovod's learning-rate schedule: `lr = initial_lr * multiplier(epoch)` from `start_epoch`
    up to (not including) `end_epoch`.

    `multiplier` is a number, or a function of the epoch. With `staircase=True` (always, for a
    number) the rate is set at each epoch's first batch from the whole epoch; otherwise at every
    batch from the fractional epoch `epoch + batch / steps_per_epoch` (`steps_per_epoch` is taken
    from fit's parameters when not given). `initial_lr` defaults to the optimizer's rate when
    training begins. Each epoch's `logs` get the rate as `lr`.

    `momentum_correction` (Goyal et al., 2017): for the batch in which the rate changes, the
    momentum is scaled by new/old rate, then restored. It needs an optimizer whose momentum is a
    variable that a compiled step reads (tf-keras's legacy optimizers); with any other it is
    skipped, and that is logged once.
    """

    def __init__(
        self,
        initial_lr: float | None = None,
        multiplier: float | Callable[[float], float] = 1.0,
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        if end_epoch is not None and end_epoch < start_epoch:
            raise InvalidArgumentError(f"end_epoch {end_epoch} is before start_epoch {start_epoch}")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise InvalidArgumentError(f"steps_per_epoch must be positive, got {steps_per_epoch}")
        self.initial_lr = initial_lr
        if callable(multiplier):
            self.multiplier: Callable[[float], float] = multiplier
            self.staircase = staircase
        else:
            factor = float(multiplier)
            self.multiplier = lambda _epoch: factor
            self.staircase = True  # a constant needs setting once an epoch
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0
        self._restore: float | None = None
        self._warned = False

    # -- the optimizer's learning rate and momentum, in Keras 3 and tf-keras alike

    def _lr(self) -> float:
        return float(np.asarray(self.model.optimizer.learning_rate))

    def _set_lr(self, value: float) -> None:
        self.model.optimizer.learning_rate = value

    def _momentum_variable(self) -> Any:
        m = getattr(self.model.optimizer, "momentum", None)
        return m if isinstance(m, tf.Variable) else None

    def _adjust(self, epoch: float) -> None:
        old = self._lr()
        new = float(self.initial_lr) * float(self.multiplier(epoch))  # type: ignore[arg-type]
        self._set_lr(new)
        if not self.momentum_correction or old == new:
            return
        m = self._momentum_variable()
        if m is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "smddp: momentum correction skipped: %s keeps its momentum as a constant",
                    type(self.model.optimizer).__name__,
                )
            return
        self._restore = float(m.numpy())
        m.assign(self._restore * new / old)

    # -- Keras hooks

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = self._lr()
        if not self.staircase and self.steps_per_epoch is None:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise InvalidArgumentError(
                    f"{type(self).__name__}: pass steps_per_epoch (model.fit did not say how many steps an epoch has)"
                )
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._epoch < self.start_epoch or (self.end_epoch is not None and self._epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust(self._epoch)
        else:
            assert self.steps_per_epoch is not None
            self._adjust(self._epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._restore is not None:
            m = self._momentum_variable()
            if m is not None:
                m.assign(self._restore)
            self._restore = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = self._lr()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warmup (Goyal et al., 2017): over the first `warmup_epochs` epochs the rate
    grows, batch by batch, from `initial_lr / size` to `initial_lr`, the rate scaled for `size`
    workers: `lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)` at fractional epoch
    `e`, counted from the end of each batch so that every epoch ends on a round value.
    """

    def __init__(
        self,
        initial_lr: float | None = None,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        if warmup_epochs < 1:
            raise InvalidArgumentError(f"warmup_epochs must be at least 1, got {warmup_epochs}")
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose
        super().__init__(
            initial_lr,
            self._warmup,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )

    def _warmup(self, epoch: float) -> float:
        assert self.steps_per_epoch is not None
        size = smddp.size()
        e = epoch + 1.0 / self.steps_per_epoch
        return (e * (size - 1) / self.warmup_epochs + 1.0) / size

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch == self.warmup_epochs - 1:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self._lr():g}.")


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True
