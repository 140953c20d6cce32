"""Worker script: a tf-keras (Keras 2, TF_USE_LEGACY_KERAS=1) model.fit with DistributedOptimizer and Horovod's callbacks."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow: tf.keras is tf-keras (Keras 2)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import smdistributed.dataparallel.tensorflow.keras as sdp  # the old SageMaker import
from smdistributed.dataparallel.tensorflow.keras import callbacks as sdp_callbacks

GLOBAL_BATCH = 16
FEATURES = 8
CLASSES = 4
SAMPLES = 64  # 4 steps an epoch


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, SAMPLES)


def local(x: np.ndarray, y: np.ndarray, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's part of every global batch, in order: fit's batches of GLOBAL_BATCH // world."""
    b = GLOBAL_BATCH // world
    idx = np.concatenate(
        [np.arange(s + rank * b, s + (rank + 1) * b) for s in range(0, SAMPLES, GLOBAL_BATCH)]
    )
    return x[idx], y[idx]


def model(seed: int) -> Any:
    tf.keras.utils.set_random_seed(seed)
    m = tf.keras.Sequential(
        [
            tf.keras.layers.Dense(16, activation="tanh", input_shape=(FEATURES,)),
            tf.keras.layers.Dense(CLASSES),
        ]
    )
    return m


def flat(variables: list[Any]) -> list[float]:
    return np.concatenate([np.asarray(v).ravel() for v in variables]).astype(np.float64).tolist()


class LrRecorder(tf.keras.callbacks.Callback):
    """The learning rate in force at every batch, and the momentum (legacy optimizers keep it as a variable)."""

    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []
        self.momenta: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))
        m = getattr(self.model.optimizer, "momentum", 0.0)
        self.momenta.append(float(np.asarray(m)))


class LrReplay(tf.keras.callbacks.Callback):
    """For the one-process reference: sets the recorded rate (and momentum, where it is a variable
    that momentum correction changed) before every batch."""

    def __init__(self, lrs: list[float], momenta: list[float]) -> None:
        super().__init__()
        self.lrs = lrs
        self.momenta = momenta
        self.i = 0

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        opt = self.model.optimizer
        opt.learning_rate = self.lrs[self.i]
        if isinstance(getattr(opt, "momentum", None), tf.Variable):
            opt.momentum.assign(self.momenta[self.i])
        self.i += 1


def optimizer(kind: str, lr: float) -> Any:
    if kind == "legacy":
        return tf.keras.optimizers.legacy.SGD(lr, momentum=0.9)
    return tf.keras.optimizers.SGD(lr, momentum=0.9)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizer", choices=["new", "legacy"], required=True)
    args = ap.parse_args()
    sdp.init()
    r, w = sdp.rank(), sdp.size()
    x, y = data()
    xl, yl = local(x, y, r, w)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out: dict[str, Any] = {"keras": tf.keras.__name__}

    # 1. Different initial weights on every rank: the broadcast after the first batch makes them one.
    m = model(100 + r)
    out["sync_initial"] = flat(m.variables)
    m.compile(optimizer=sdp.DistributedOptimizer(optimizer(args.optimizer, 0.05)), loss=loss)
    m.fit(xl, yl, batch_size=GLOBAL_BATCH // w, epochs=2, shuffle=False, verbose=0,
          callbacks=[sdp_callbacks.BroadcastGlobalVariablesCallback(0)])  # fmt: skip
    out["sync_final"] = flat(m.variables)
    out["optimizer_class"] = f"{type(m.optimizer).__module__}.{type(m.optimizer).__name__}"

    # 2. The same start everywhere, warmup then a schedule; against one process on the global batch.
    m = model(7)
    m.compile(optimizer=sdp.DistributedOptimizer(optimizer(args.optimizer, 0.1)), loss=loss)
    rec = LrRecorder()
    cbs = [
        sdp_callbacks.BroadcastGlobalVariablesCallback(0),
        sdp_callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2),
        sdp_callbacks.LearningRateScheduleCallback(
            initial_lr=0.1, multiplier=0.5, start_epoch=2, end_epoch=3
        ),
        sdp_callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=lambda e: 0.25, start_epoch=3),
        rec,
    ]
    hist = m.fit(xl, yl, batch_size=GLOBAL_BATCH // w, epochs=4, shuffle=False, verbose=0, callbacks=cbs)
    out["lrs"] = rec.lrs
    out["momenta"] = rec.momenta
    out["logged_lr"] = [float(v) for v in hist.history["lr"]]
    out["final"] = flat(m.variables)
    if r == 0:
        ref = model(7)
        ref.compile(optimizer=optimizer(args.optimizer, 0.1), loss=loss)
        ref.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            epochs=4,
            shuffle=False,
            verbose=0,
            callbacks=[LrReplay(rec.lrs, rec.momenta)],
        )
        out["reference"] = flat(ref.variables)
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
        json.dump(out, f)
    sdp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
