"""Step time of a tf.function training step with DistributedGradientTape, against one process on the global batch.

    python examples/tensorflow/bench_step.py --single                  # one process, no smddp
    smddp-launch -np 2 -- python examples/tensorflow/bench_step.py     # 2 workers, global batch split
    smddp-launch -np 4 -- python examples/tensorflow/bench_step.py --model mlp

Every run processes the same global batch per step (--global-batch), so the step times compare
directly. Rank 0 prints one JSON line of medians over --steps timed steps (after --warmup): the
whole step, and on smddp also the step with a plain tape (the same local work, no reduction),
the reduction alone (the same gradients through the TensorFlow front end, nothing else running)
and smddp's client alone on one numpy buffer of the same size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf


def build(name: str, width: int, depth: int) -> tuple[keras.Model, tuple[int, ...]]:
    if name == "digits":  # the model of examples/tensorflow/train_keras.py
        layers: list[Any] = [
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
        shape: tuple[int, ...] = (8, 8, 1)
    else:
        layers = [keras.layers.Dense(width, activation="relu") for _ in range(depth)] + [
            keras.layers.Dense(10)
        ]
        shape = (256,)
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(shape), *layers]), shape


def median_ms(fn: Callable[[], Any], steps: int, warmup: int, sync: Callable[[], None]) -> float:
    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--single", action="store_true", help="one process on the global batch, without smddp")
    ap.add_argument("--model", choices=["digits", "mlp"], default="digits")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=None, help="fusion buffer size (default: smddp's)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="TF intra-op threads (0: cores / workers)")
    args = ap.parse_args()
    world, rank = 1, 0
    sdp: Any = None
    if not args.single:
        import smddp.tensorflow as sdp

        sdp.init()
        world, rank = sdp.size(), sdp.rank()
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    net, shape = build(args.model, args.width, args.depth)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    local = args.global_batch // world
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.normal(size=(local, *shape)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, size=local).astype(np.int32))
    variables = net.trainable_variables

    def step(distributed: bool) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x, training=True))
        if distributed:
            tape = sdp.DistributedGradientTape(tape, bucket_cap_mb=args.bucket_mb)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables, strict=True))
        return loss

    dist_step = tf.function(lambda: step(True))
    plain_step = tf.function(lambda: step(False))

    def sync() -> None:
        if sdp is not None:
            import smddp

            smddp.barrier()

    out: dict[str, Any] = {
        "model": args.model,
        "params": net.count_params() if net.built else sum(int(np.prod(v.shape)) for v in variables),
        "workers": world,
        "global_batch": args.global_batch,
        "threads_per_worker": threads,
    }
    if args.single:
        out["step_ms"] = median_ms(plain_step, args.steps, args.warmup, sync)
    else:
        out["step_ms"] = median_ms(dist_step, args.steps, args.warmup, sync)
        out["step_no_reduction_ms"] = median_ms(plain_step, args.steps, args.warmup, sync)
        grads = [tf.ones_like(v) for v in variables]
        red = sdp.GradientReduction.make(
            sdp.ReduceOp.AVERAGE, sdp.Compression.none, args.bucket_mb, "", "", "bench"
        )
        reduce_only = tf.function(lambda: red.reduce(grads))
        out["reduction_alone_ms"] = median_ms(reduce_only, args.steps, args.warmup, sync)
        # The client alone on one numpy buffer of the same size: what the front end adds is the rest.
        import smddp

        flat = np.ones(sum(int(np.prod(v.shape)) for v in variables), np.float32)
        out["client_allreduce_ms"] = median_ms(
            lambda: smddp.allreduce(flat, op=smddp.AVG), args.steps, args.warmup, sync
        )
    if rank == 0:
        print(json.dumps(out), flush=True)
    if sdp is not None:
        sdp.shutdown()


if __name__ == "__main__":
    main()
