"""Data-parallel training of a Keras digit classifier with smddp's TensorFlow API (SageMaker / Horovod style).

    smddp-launch -np 4 -- python examples/tensorflow/train_keras.py

The data set is scikit-learn's bundled handwritten digits (1797 8x8 images, no download). The
smddp-specific lines are the ones that use `sdp`: init, the learning rate scaled by the number of
workers, DistributedOptimizer, and the callbacks that broadcast rank 0's initial variables and
average the epoch's metrics.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import smddp.tensorflow as sdp


def datasets() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    x, y = load_digits(return_X_y=True)
    x = (x.reshape(-1, 8, 8, 1) / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    perm = np.random.default_rng(0).permutation(len(x))  # the same split on every rank
    train, test = perm[:1400], perm[1400:]
    return (x[train], y[train]), (x[test], y[test])


def model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


class TestAccuracy(keras.callbacks.Callback):
    """After each epoch: accuracy on the whole test set (each rank scores its share), printed by rank 0."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        super().__init__()
        self.x, self.y = x, y
        self.t0 = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        pred = np.argmax(self.model.predict(self.x, verbose=0), axis=1)
        counts = sdp.allreduce(tf.constant([int((pred == self.y).sum()), len(self.y)]), op=sdp.ReduceOp.SUM)
        correct, seen = counts.numpy().tolist()
        if sdp.rank() == 0 and logs is not None:
            print(
                f"epoch {epoch + 1}: loss {logs['loss']:.4f}  accuracy {logs['accuracy']:.4f}  "
                f"test accuracy {correct / seen:.4f}  time {time.perf_counter() - self.t0:.2f} s",
                flush=True,
            )


def replicas_agree(variables: list[Any]) -> bool:
    """True when every rank holds the same bits: the elementwise MIN and MAX over the ranks coincide."""
    flat = tf.concat([tf.reshape(v, [-1]) for v in variables], 0)
    lo = sdp.allreduce(flat, op=sdp.ReduceOp.MIN)
    hi = sdp.allreduce(flat, op=sdp.ReduceOp.MAX)
    return bool(np.array_equal(lo.numpy().view(np.uint32), hi.numpy().view(np.uint32)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="per worker")
    ap.add_argument(
        "--save-params", default="", help="each rank writes its final parameters to DIR/rank<r>.bin"
    )
    ap.add_argument("--lr", type=float, default=0.001, help="for one worker; scaled by the number of workers")
    args = ap.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    sdp.init()
    rank, world = sdp.rank(), sdp.size()
    (x_train, y_train), (x_test, y_test) = datasets()
    keras.utils.set_random_seed(rank)  # different initial weights per rank: the callback broadcasts rank 0's
    net = model()
    opt = sdp.DistributedOptimizer(keras.optimizers.Adam(args.lr * world))
    net.compile(
        optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    if rank == 0:
        print(
            f"training {net.count_params()} parameters on {world} workers, global batch {args.batch * world}",
            flush=True,
        )
    callbacks = [
        sdp.BroadcastGlobalVariablesCallback(0),
        sdp.MetricAverageCallback(),  # before anything that reads the epoch's metrics
        TestAccuracy(x_test[rank::world], y_test[rank::world]),
    ]
    # Each rank trains on its own 1/world of the training set; every step averages the gradients.
    net.fit(
        x_train[rank::world],
        y_train[rank::world],
        batch_size=args.batch,
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=0,
    )
    agree = replicas_agree(net.variables)
    if args.save_params:  # to be compared without the collectives under test (tests/replicas.py)
        flat = np.concatenate([np.asarray(v).reshape(-1) for v in net.variables])
        Path(args.save_params, f"rank{rank}.bin").write_bytes(flat.tobytes())
    if rank == 0:
        print(
            f"replicas agree bit for bit: {agree} ({net.count_params()} parameters, {world} workers)",
            flush=True,
        )
    sdp.shutdown()


if __name__ == "__main__":
    main()
