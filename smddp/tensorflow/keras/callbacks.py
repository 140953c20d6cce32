"""Keras callbacks: broadcast the initial variables from one rank, average the epoch's metrics."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

import smddp
from smddp.tensorflow.errors import InvalidArgumentError
from smddp.tensorflow.ops import broadcast_variables, check_root

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start `model.fit` from root's variables: the model's and the optimizer's.

    At the start of training, when the model is built, the optimizer is built too (as Keras would
    on the first step) and all variables are broadcast, so the first step already starts from the
    same weights everywhere. A model that is not built until it sees data (a subclassed model
    never called) is broadcast after the first batch instead, as Horovod does. Only once per
    callback, however many times fit() is called. `device` is Horovod's argument and must be ''.
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
        if not after_first_batch and not (model.built and model.variables):
            return  # variables appear with the first batch: broadcast after it
        opt = getattr(model, "optimizer", None)
        if opt is not None and not opt.built:
            opt.build(model.trainable_variables)
        variables = list(model.variables) + (list(opt.variables) if opt is not None else [])
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._broadcast(after_first_batch=False)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._broadcast(after_first_batch=True)


class MetricAverageCallback(keras.callbacks.Callback):
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


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True
