"""Worker script: the TensorFlow front end's collectives, fusion, training and errors; results for the pytest side."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import ml_dtypes
import numpy as np
import tensorflow as tf

import smddp
import smddp.tensorflow as sdp
import smdistributed.dataparallel.tensorflow as sm_sdp
import smdistributed.dataparallel.tensorflow.keras as sm_keras
from smddp import errors
from smdistributed.dataparallel.tensorflow.keras import callbacks as sm_callbacks

REDUCE = {
    "float16": tf.float16,
    "bfloat16": tf.bfloat16,
    "float32": tf.float32,
    "float64": tf.float64,
    "int32": tf.int32,
    "int64": tf.int64,
    "uint8": tf.uint8,
}
BCAST_ONLY = {
    "bool": tf.bool,
    "int8": tf.int8,
    "int16": tf.int16,
    "uint16": tf.uint16,
    "uint32": tf.uint32,
    "uint64": tf.uint64,
    "complex64": tf.complex64,
}
OPS = {"sum": sdp.ReduceOp.SUM, "avg": sdp.ReduceOp.AVERAGE, "min": sdp.ReduceOp.MIN, "max": sdp.ReduceOp.MAX}

# Training: a small classifier on a synthetic data set, the same global batch at every world size.
GLOBAL_BATCH = 16
STEPS = 6
FEATURES = 8
CLASSES = 4
SHAPE = (5, 7)


def raw(t: Any) -> np.ndarray:
    """A tensor's elements as numpy; bfloat16 as its raw uint16 bits (as tests/reference.py takes them)."""
    a = np.asarray(t.numpy() if hasattr(t, "numpy") else t)
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a


def rank_input(dtype: str, rank: int, salt: int = 0) -> np.ndarray:
    """Rank `rank`'s input for `dtype`; every rank can make every other rank's."""
    rng = np.random.default_rng(1000 * salt + 17 * rank + len(dtype))
    if dtype in ("uint8", "int32", "int64", "int8", "int16", "uint16", "uint32", "uint64"):
        return rng.integers(0, 100, size=SHAPE).astype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=SHAPE).astype(bool)
    if dtype == "complex64":
        return (rng.normal(size=SHAPE) + 1j * rng.normal(size=SHAPE)).astype(np.complex64)
    x = rng.normal(size=SHAPE) * 8
    return x.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else x.astype(dtype)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES, CLASSES))
    return x, np.argmax(x @ w + 0.5 * rng.normal(size=(len(x), CLASSES)), axis=1).astype(np.int32)


def local_batches(x: np.ndarray, y: np.ndarray, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's share of every global batch, batch after batch: rows [r*b, (r+1)*b) of each."""
    b = GLOBAL_BATCH // world
    idx = np.concatenate(
        [np.arange(s * GLOBAL_BATCH + rank * b, s * GLOBAL_BATCH + (rank + 1) * b) for s in range(STEPS)]
    )
    return x[idx], y[idx]


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def flat(variables: list[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(v.numpy(), np.float64).ravel() for v in variables])


def err(fn: Any) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "NOT RAISED"


# -- sections -------------------------------------------------------------------------------------


def collectives(r: int, w: int, arrays: dict[str, np.ndarray], checks: dict[str, bool]) -> None:
    graph_ar = {op: tf.function(lambda x, _op=o: sdp.allreduce(x, op=_op)) for op, o in OPS.items()}
    for dtype, tfd in REDUCE.items():
        x = tf.constant(rank_input(dtype, r), dtype=tfd)
        arrays[f"in/{dtype}"] = raw(x)
        for op, o in OPS.items():
            e = sdp.allreduce(x, op=o)
            g = graph_ar[op](x)
            checks[f"shape/{dtype}/{op}"] = e.dtype == tfd and g.dtype == tfd and e.shape == g.shape == SHAPE
            arrays[f"eager/{dtype}/{op}"] = raw(e)
            arrays[f"graph/{dtype}/{op}"] = raw(g)
    # The other spellings of the ops reach the same collectives.
    x = tf.constant(rank_input("float32", r))
    checks["default_is_average"] = np.array_equal(sdp.allreduce(x).numpy(), arrays["eager/float32/avg"])
    checks["none_is_average"] = np.array_equal(sdp.allreduce(x, op=None).numpy(), arrays["eager/float32/avg"])
    checks["horovod_sum"] = np.array_equal(sdp.allreduce(x, op=sdp.Sum).numpy(), arrays["eager/float32/sum"])
    checks["smddp_max"] = np.array_equal(sdp.allreduce(x, op=smddp.MAX).numpy(), arrays["eager/float32/max"])
    checks["positional_sagemaker"] = np.array_equal(
        sm_sdp.allreduce(x, 0, 1, sm_sdp.Compression.none, sm_sdp.ReduceOp.SUM).numpy(),
        arrays["eager/float32/sum"],
    )
    checks["oob_allreduce"] = np.array_equal(sm_sdp.oob_allreduce(x).numpy(), arrays["eager/float32/avg"])
    # fp16 compression: float32 in and out, float16 on the wire.
    xc = tf.constant(rank_input("float32", r, salt=3))
    arrays["fp16/in"] = xc.numpy()
    fe = sdp.allreduce(xc, compression=sdp.Compression.fp16)
    fg = tf.function(lambda t: sdp.allreduce(t, compression=sdp.Compression.fp16))(xc)
    checks["fp16/dtype"] = fe.dtype == tf.float32 and fg.dtype == tf.float32
    arrays["fp16/eager"] = fe.numpy()
    arrays["fp16/graph"] = fg.numpy()
    # broadcast: reducible dtypes and the ones that travel as bytes only.
    root = w - 1
    graph_bc = tf.function(lambda t: sdp.broadcast(t, root_rank=root))
    for dtype, tfd in {**REDUCE, **BCAST_ONLY}.items():
        x = tf.constant(rank_input(dtype, r, salt=5), dtype=tfd)
        arrays[f"bin/{dtype}"] = raw(x)
        e, g = sdp.broadcast(x, root), graph_bc(x)
        checks[f"bshape/{dtype}"] = e.dtype == g.dtype == tfd and e.shape == g.shape == SHAPE
        arrays[f"beager/{dtype}"] = raw(e)
        arrays[f"bgraph/{dtype}"] = raw(g)


def fusion(r: int, arrays: dict[str, np.ndarray], checks: dict[str, bool]) -> None:
    """Many tensors of several dtypes (None, sparse, scalar, empty) through fusion buffers of 64 bytes."""

    def tensors(salt: int) -> list[Any]:
        rng = np.random.default_rng(50 * salt + r)
        values = tf.constant(rng.normal(size=(2, 3)).astype(np.float32))
        return [
            tf.constant(rng.normal(size=(3, 4)).astype(np.float32)),
            None,
            tf.constant(rng.normal(size=(5,)).astype(np.float16)),
            tf.constant(rng.normal(size=(2, 2))),
            tf.constant(np.float32(rng.normal())),
            tf.constant(rng.normal(size=(6,)).astype(ml_dtypes.bfloat16)),
            tf.IndexedSlices(values, tf.constant([0, 2]), tf.constant([4, 3])),
            tf.constant(rng.integers(0, 9, size=(7,)).astype(np.int32)),
            tf.zeros((0,), tf.float32),
            tf.constant(rng.normal(size=(40,)).astype(np.float32)),
        ]

    for comp_name, comp in (("none", sdp.Compression.none), ("fp16", sdp.Compression.fp16)):
        red = sdp.GradientReduction(sdp.ReduceOp.AVERAGE, comp, 64)
        inputs = tensors(1)
        eager = red.reduce(inputs)

        @tf.function
        def graph(_red: Any = red) -> list[Any]:
            return [t for t in _red.reduce(tensors(1)) if t is not None]

        got = graph()
        checks[f"fusion/{comp_name}/none_kept"] = eager[1] is None and len(got) == len(inputs) - 1
        for i, t in enumerate(inputs):
            if t is None:
                continue
            dense = tf.convert_to_tensor(t)
            arrays[f"fusion_in/{i}"] = raw(dense)
            arrays[f"fusion_sent/{comp_name}/{i}"] = raw(comp.compress(dense)[0])
            arrays[f"fusion/{comp_name}/eager/{i}"] = raw(eager[i])
            arrays[f"fusion/{comp_name}/graph/{i}"] = raw(got[i if i < 1 else i - 1])
        ops = graph.get_concrete_function().graph.get_operations()
        checks[f"fusion/{comp_name}/many_buffers"] = (
            sum(op.name.startswith("smddp_allreduce_submit") for op in ops) > 2
        )


def bad_input(r: int, w: int, out: dict[str, Any]) -> None:
    x = tf.constant([1.0, 2.0])
    opt = sdp.DistributedOptimizer(keras.optimizers.SGD(0.1))
    tape = tf.GradientTape()
    e: dict[str, str] = {
        "string": err(lambda: sdp.allreduce(tf.constant(["a", "b"]))),
        "complex": err(lambda: sdp.allreduce(tf.constant([1 + 2j], tf.complex64))),
        "int8_in_function": err(lambda: tf.function(lambda t: sdp.allreduce(t))(tf.constant([1], tf.int8))),
        "broadcast_string": err(lambda: sdp.broadcast(tf.constant(["a"]), 0)),
        "broadcast_variables_string": err(lambda: sdp.broadcast_variables([tf.Variable(["a"])], 0)),
        "op": err(lambda: sdp.allreduce(x, op="prod")),
        "root": err(lambda: sdp.broadcast(x, root_rank=w)),
        "param_index": err(lambda: sdp.allreduce(x, 2, 2)),
        "num_params_type": err(lambda: sdp.allreduce(x, 0, 1.5)),  # type: ignore[arg-type]
        "compression": err(lambda: sdp.allreduce(x, compression=object())),
        "tape_op": err(lambda: sdp.DistributedGradientTape(tape, op=sdp.ReduceOp.MIN)),
        "tape_device": err(lambda: sdp.DistributedGradientTape(tape, device_dense="/gpu:0")),
        "tape_not_a_tape": err(lambda: sdp.DistributedGradientTape(object())),  # type: ignore[arg-type]
        "bucket": err(lambda: sdp.DistributedGradientTape(tape, bucket_cap_mb=0)),
        "optimizer_type": err(lambda: sdp.DistributedOptimizer(object())),  # type: ignore[arg-type]
        "optimizer_twice": err(lambda: sdp.DistributedOptimizer(opt)),
        "xla": err(lambda: tf.function(lambda t: sdp.allreduce(t), jit_compile=True)(x)),
        "global_variables_eager": err(lambda: sdp.broadcast_global_variables(0)),
    }
    out["errors"] = e
    # Nothing above reached the daemon: the next collective still lines up on every rank.
    s = sdp.allreduce(tf.constant([float(r + 1)]), op=sdp.ReduceOp.SUM)
    out["after_errors_sum"] = float(s.numpy()[0])


def train_tape(r: int, w: int, mode: str) -> tuple[keras.Model, int]:
    """STEPS steps of a custom loop with DistributedGradientTape; returns the model and submit ops per step."""
    x, y = local_batches(*data(), r, w)
    b = GLOBAL_BATCH // w
    model = make_model(0)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    kw: dict[str, Any] = {}
    if mode == "fp16":
        kw["compression"] = sdp.Compression.fp16
    if mode in ("buckets", "fp16"):
        kw["bucket_cap_mb"] = 1 / 1024  # 1 KiB buffers: several per step

    def step(xb: Any, yb: Any) -> Any:
        if mode == "eager":  # Horovod's other spelling: the wrapper records, as the tape it wraps
            with sdp.DistributedGradientTape(tf.GradientTape(), **kw) as tape:
                loss = LOSS(yb, model(xb, training=True))
        else:
            with tf.GradientTape() as tape:
                loss = LOSS(yb, model(xb, training=True))
            tape = sdp.DistributedGradientTape(tape, **kw)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    fn = step if mode == "eager" else tf.function(step)
    for s in range(STEPS):
        fn(x[s * b : (s + 1) * b], y[s * b : (s + 1) * b])
    submits = 0
    if mode != "eager":
        graph = fn.get_concrete_function(x[:b], y[:b]).graph  # type: ignore[attr-defined]
        submits = sum(op.name.startswith("smddp_allreduce_submit") for op in graph.get_operations())
    return model, submits


def train_reference(mode: str) -> np.ndarray:
    """One process, no smddp: the same model and steps on the whole global batch."""
    x, y = data()
    if mode == "fit":
        model = make_model(10)  # rank 0's initial weights, which the callback broadcast
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=LOSS)
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        return flat(model.variables)
    model = make_model(0)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    for s in range(STEPS):
        sl = slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
        with tf.GradientTape() as tape:
            loss = LOSS(y[sl], model(x[sl], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return flat(model.variables)


class Recorder(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[dict[str, float]] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epochs.append({k: float(v) for k, v in (logs or {}).items()})


def train_fit(r: int, w: int, out: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """model.fit with DistributedOptimizer; ranks start from different weights, the callback syncs them."""
    x, y = local_batches(*data(), r, w)
    model = make_model(10 + r)
    arrays["fit/initial"] = flat(model.variables)
    model.compile(optimizer=sdp.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss=LOSS)
    raw_logs, avg_logs = Recorder(), Recorder()
    callbacks = [sdp.BroadcastGlobalVariablesCallback(0), raw_logs, sdp.MetricAverageCallback(), avg_logs]
    model.fit(x, y, batch_size=GLOBAL_BATCH // w, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    arrays["fit/final"] = flat(model.variables)
    arrays["fit/optimizer"] = flat(model.optimizer.variables)
    out["fit"] = {
        "raw_logs": raw_logs.epochs,
        "avg_logs": avg_logs.epochs,
        "iterations": int(model.optimizer.iterations.numpy()),
        "optimizer_class": type(model.optimizer).__name__,
    }
    if r == 0:
        # A checkpoint records the plain optimizer: it loads without smddp.
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        out["fit"]["loaded_optimizer"] = (
            f"{type(loaded.optimizer).__module__}.{type(loaded.optimizer).__name__}"
        )
        out["fit"]["loaded_equal"] = bool(np.array_equal(flat(loaded.variables), arrays["fit/final"]))


def sagemaker_loop(r: int, w: int, arrays: dict[str, np.ndarray]) -> None:
    """The loop of SageMaker's TensorFlow guide, through smdistributed.dataparallel.tensorflow, as written there."""
    dist = sm_sdp
    x, y = local_batches(*data(), r, w)
    b = GLOBAL_BATCH // w
    model = make_model(20 + r)  # different on every rank until the first step's broadcast
    opt = keras.optimizers.Adam(0.001 * dist.size())

    @tf.function
    def training_step(images: Any, labels: Any, first_batch: bool) -> Any:
        with tf.GradientTape() as tape:
            probs = model(images, training=True)
            loss_value = LOSS(labels, probs)
        tape = dist.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first_batch:
            dist.broadcast_variables(model.variables, root_rank=0)
            dist.broadcast_variables(opt.variables, root_rank=0)
        return loss_value

    for s in range(STEPS):
        training_step(x[s * b : (s + 1) * b], y[s * b : (s + 1) * b], s == 0)
    arrays["sagemaker/final"] = flat(model.variables)
    arrays["sagemaker/optimizer"] = flat(opt.variables)


def broadcast_vars(r: int, w: int, arrays: dict[str, np.ndarray]) -> None:
    """broadcast_variables eagerly and in a tf.function, of every dtype a model and optimizer hold."""
    model = make_model(30 + r)
    opt = keras.optimizers.Adam()
    opt.build(model.trainable_variables)
    opt.iterations.assign(5 + r)
    extra = [tf.Variable(rank_input(d, r, salt=7)) for d in ("bool", "int8", "float16", "int64", "complex64")]
    arrays["bv/before"] = flat(model.variables)
    arrays["bv/extra_before"] = np.concatenate([raw(v).view(np.uint8).ravel() for v in extra])
    sdp.broadcast_variables(model.variables + opt.variables, root_rank=0)
    tf.function(lambda: sdp.broadcast_variables(extra, root_rank=w - 1))()
    arrays["bv/after"] = flat(model.variables)
    arrays["bv/iterations"] = np.array([int(opt.iterations.numpy())])
    arrays["bv/extra_after"] = np.concatenate([raw(v).view(np.uint8).ravel() for v in extra])


def tf1_graph(r: int, w: int, out: dict[str, Any]) -> None:
    """TF1 graphs: broadcast_global_variables, and the hook in a MonitoredTrainingSession."""
    res: dict[str, Any] = {}
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("v", initializer=tf.constant(np.full((3,), float(r), np.float32)))
        k = tf.compat.v1.get_variable("k", initializer=tf.constant(np.arange(4, dtype=np.int64) * (r + 1)))
        bcast = sdp.broadcast_global_variables(w - 1)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(bcast)
            res["op"] = [sess.run(v).tolist(), sess.run(k).tolist()]
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("v", initializer=tf.constant(np.full((2,), float(r + 10), np.float32)))
        hook = sm_sdp.BroadcastGlobalVariablesHook(0)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
            res["hook"] = sess.run(v).tolist()
    out["tf1"] = res


def fail(r: int, out_dir: str) -> None:
    """A mismatched collective: the tf.function's error and later eager calls name smddp's cause."""
    res: dict[str, str] = {}
    res["graph"] = err(lambda: tf.function(lambda t: sdp.allreduce(t))(tf.ones(4 + r)))
    res["eager_after"] = err(lambda: sdp.allreduce(tf.ones(3)))
    try:
        sdp.allreduce(tf.ones(3))
    except errors.CollectiveError:
        res["eager_is_collective_error"] = "yes"
    with open(os.path.join(out_dir, f"fail{r}.json"), "w") as f:
        json.dump(res, f)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fail", action="store_true", help="end with a mismatched collective")
    args = ap.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.get_logger().setLevel("ERROR")  # the retracing notes of the many small tf.functions here
    out: dict[str, Any] = {}
    out["before_init"] = err(lambda: sdp.allreduce(tf.constant([1.0])))
    sm_keras.init()  # the alias package's init is smddp's: once per process
    sdp.init()
    r, w = sdp.rank(), sdp.size()
    out["ids"] = [r, w, sdp.local_rank(), sdp.local_size(), sm_sdp.rank(), sm_keras.size()]
    out["aliases"] = [
        sm_sdp.DistributedGradientTape is sdp.DistributedGradientTape,
        sm_keras.DistributedOptimizer is sdp.DistributedOptimizer,
        sm_callbacks.BroadcastGlobalVariablesCallback is sdp.BroadcastGlobalVariablesCallback,
        sm_keras.callbacks.MetricAverageCallback is sdp.MetricAverageCallback,
    ]
    arrays: dict[str, np.ndarray] = {}
    checks: dict[str, bool] = {}
    collectives(r, w, arrays, checks)
    fusion(r, arrays, checks)
    bad_input(r, w, out)
    submits: dict[str, int] = {}
    for mode in ("eager", "function", "buckets", "fp16"):
        model, submits[mode] = train_tape(r, w, mode)
        arrays[f"tape/{mode}"] = flat(model.variables)
    out["submits"] = submits
    train_fit(r, w, out, arrays)
    sagemaker_loop(r, w, arrays)
    broadcast_vars(r, w, arrays)
    tf1_graph(r, w, out)
    if r == 0:
        for mode in ("function", "fit"):
            arrays[f"reference/{mode}"] = train_reference(mode)
    out["checks"] = {k: bool(v) for k, v in checks.items()}
    np.savez(os.path.join(args.out, f"rank{r}.npz"), **arrays)
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
        json.dump(out, f)
    if args.fail:
        smddp.barrier()  # every rank's results are written before the job fails
        fail(r, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
