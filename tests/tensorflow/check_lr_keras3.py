"""Worker script: Horovod's learning-rate callbacks in a Keras 3 model.fit; records the rate at every batch."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import smddp.tensorflow as sdp
from smddp.tensorflow.keras import callbacks


class Recorder(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))


def main() -> int:
    sdp.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=sdp.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    rec = Recorder()
    cbs = [
        callbacks.BroadcastGlobalVariablesCallback(0),
        callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2),
        callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=lambda e: 0.1 * e, start_epoch=2),
        rec,
    ]
    hist = model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=2, epochs=4, verbose=0, callbacks=cbs)
    with open(os.path.join(sys.argv[1], f"rank{sdp.rank()}.json"), "w") as f:
        json.dump({"lrs": rec.lrs, "logged": [float(v) for v in hist.history["lr"]]}, f)
    sdp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
