"""Data-parallel training of a numpy MLP with smddp: broadcast, fused async all-reduce, allgather check."""

from __future__ import annotations

import os

# Several workers and daemons share a few cores: one BLAS thread per worker avoids oversubscription,
# which would cost far more than the parallel matmuls gain at these sizes. Must precede numpy's import.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import smddp  # noqa: E402

# Sizes: small enough that 4 workers + 2 daemons on 2 cores finish well within a minute.
N_IN, N_HIDDEN, N_CLASSES = 32, 128, 4
N_TRAIN, N_TEST = 16384, 4096
GLOBAL_BATCH = 256
EPOCHS = 5
BLOBS_PER_CLASS, CENTRE_SCALE = 4, 0.7
LR, MOMENTUM = 0.05, 0.9
DATA_SEED, INIT_SEED, SHUFFLE_SEED = 1234, 42, 7
# Chance is 1/N_CLASSES; anything below this after training means it did not learn.
MIN_TEST_ACCURACY = 0.80

Params = list[np.ndarray]


def make_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Gaussian blobs, BLOBS_PER_CLASS per class so no linear model suffices; same bytes on every rank."""
    rng = np.random.default_rng(DATA_SEED)
    centres = rng.standard_normal((N_CLASSES * BLOBS_PER_CLASS, N_IN)) * CENTRE_SCALE
    blob = rng.integers(0, len(centres), N_TRAIN + N_TEST)
    x = (centres[blob] + rng.standard_normal((len(blob), N_IN))).astype(np.float32)
    y = (blob % N_CLASSES).astype(np.int64)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def param_shapes() -> list[tuple[int, ...]]:
    return [
        (N_IN, N_HIDDEN),
        (N_HIDDEN,),
        (N_HIDDEN, N_HIDDEN),
        (N_HIDDEN,),
        (N_HIDDEN, N_CLASSES),
        (N_CLASSES,),
    ]


def init_params(rank: int) -> Params:
    """He-initialised weights drawn on rank 0 only, then broadcast, so every replica starts from its bytes."""
    shapes = param_shapes()
    if rank == 0:
        rng = np.random.default_rng(INIT_SEED)
        params = [
            (rng.standard_normal(s) * np.sqrt(2.0 / s[0])).astype(np.float32)
            if len(s) == 2
            else np.zeros(s, np.float32)
            for s in shapes
        ]
    else:
        # Garbage on purpose: only the broadcast can make these equal to rank 0's.
        params = [np.empty(s, np.float32) for s in shapes]
    for p in params:
        smddp.broadcast(p, root=0)
    return params


def fusion_views(fusion: np.ndarray, shapes: list[tuple[int, ...]]) -> Params:
    """One view per parameter into the flat buffer, so backward writes gradients straight into it."""
    views, off = [], 0
    for s in shapes:
        n = int(np.prod(s))
        views.append(fusion[off : off + n].reshape(s))
        off += n
    return views


def forward_logits(params: Params, x: np.ndarray) -> np.ndarray:
    w1, b1, w2, b2, w3, b3 = params
    h1 = np.maximum(x @ w1 + b1, 0)
    h2 = np.maximum(h1 @ w2 + b2, 0)
    return h2 @ w3 + b3


def forward_backward(params: Params, grads: Params, x: np.ndarray, y: np.ndarray, scale: float) -> float:
    """Write scale * d(sum of sample losses)/d(params) into `grads`; return the sum of sample losses."""
    w1, b1, w2, b2, w3, b3 = params
    g_w1, g_b1, g_w2, g_b2, g_w3, g_b3 = grads
    n = x.shape[0]
    if n == 0:
        for g in grads:
            g.fill(0)
        return 0.0
    h1 = np.maximum(x @ w1 + b1, 0)
    h2 = np.maximum(h1 @ w2 + b2, 0)
    logits = h2 @ w3 + b3
    # Softmax cross-entropy, shifted by the row max so exp() cannot overflow.
    z = logits - logits.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss_sum = float(-log_p[np.arange(n), y].sum(dtype=np.float64))
    d = np.exp(log_p)
    d[np.arange(n), y] -= 1
    d *= np.float32(scale)
    np.matmul(h2.T, d, out=g_w3)
    np.sum(d, axis=0, out=g_b3)
    d = (d @ w3.T) * (h2 > 0)
    np.matmul(h1.T, d, out=g_w2)
    np.sum(d, axis=0, out=g_b2)
    d = (d @ w2.T) * (h1 > 0)
    np.matmul(x.T, d, out=g_w1)
    np.sum(d, axis=0, out=g_b1)
    return loss_sum


def evaluate(params: Params, x: np.ndarray, y: np.ndarray, rank: int, size: int) -> float:
    """Held-out accuracy: each rank scores its slice, one all-reduce sums the counts."""
    lo, hi = rank * len(x) // size, (rank + 1) * len(x) // size
    correct = np.count_nonzero(np.argmax(forward_logits(params, x[lo:hi]), axis=1) == y[lo:hi])
    counts = np.array([correct, hi - lo], np.float64)
    smddp.allreduce(counts, op=smddp.SUM)
    return float(counts[0] / counts[1])


def main() -> int:
    ap = argparse.ArgumentParser(description="data-parallel training of a small MLP on smddp, in numpy")
    ap.add_argument(
        "--save-params", default="", help="each rank writes its final parameters to DIR/rank<r>.bin"
    )
    args = ap.parse_args()
    smddp.init()
    rank, size = smddp.rank(), smddp.size()
    # Count nodes as the ranks that are first on theirs: local_size alone is wrong when nodes are uneven.
    leaders = np.array([smddp.local_rank() == 0], np.float64)
    n_nodes = int(smddp.allreduce(leaders, op=smddp.SUM)[0])

    x_train, y_train, x_test, y_test = make_data()
    shapes = param_shapes()
    params = init_params(rank)
    n_params = sum(p.size for p in params)
    fusion = np.zeros(n_params, np.float32)
    grads = fusion_views(fusion, shapes)
    velocity = [np.zeros_like(p) for p in params]

    # Rank r takes rows [r*B/W, (r+1)*B/W) of each global batch; the bounds cover B exactly even when W
    # does not divide B, so the job trains on the same global batches whatever the worker count.
    lo, hi = rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size
    # Scaling local loss sums by W/B makes AVG over W ranks the exact mean over the global batch,
    # even when shards differ in size by one sample.
    grad_scale = size / GLOBAL_BATCH
    steps = N_TRAIN // GLOBAL_BATCH
    shuffle_rng = np.random.default_rng(SHUFFLE_SEED)  # same seed everywhere: same permutation everywhere

    nodes = f"{n_nodes} node{'s' if n_nodes != 1 else ''}"
    if rank == 0:
        print(f"training {n_params} parameters on {size} workers, {nodes}, global batch {GLOBAL_BATCH}")
    accuracy = 0.0
    for epoch in range(1, EPOCHS + 1):
        order = shuffle_rng.permutation(N_TRAIN)
        stats = np.zeros(2, np.float64)  # [sum of sample losses, samples] on this rank
        smddp.barrier()  # start every rank's clock together so the time covers the slowest rank
        t0 = time.perf_counter()
        for step in range(steps):
            idx = order[step * GLOBAL_BATCH + lo : step * GLOBAL_BATCH + hi]
            stats[0] += forward_backward(params, grads, x_train[idx], y_train[idx], grad_scale)
            stats[1] += len(idx)
            smddp.allreduce_async(fusion, op=smddp.AVG).wait()
            for p, g, v in zip(params, grads, velocity, strict=True):
                v *= MOMENTUM
                v += g
                p -= LR * v
        elapsed = time.perf_counter() - t0
        smddp.allreduce(stats, op=smddp.SUM)
        accuracy = evaluate(params, x_test, y_test, rank, size)
        if rank == 0:
            print(
                f"epoch {epoch}: loss {stats[0] / stats[1]:.4f}  test accuracy {accuracy:.4f}  "
                f"time {elapsed:.2f} s",
                flush=True,
            )

    # Data parallelism is only correct if every replica holds exactly the same weights.
    flat = np.concatenate([p.ravel() for p in params])
    if args.save_params:  # to be compared without the collectives under test (tests/replicas.py)
        Path(args.save_params, f"rank{rank}.bin").write_bytes(flat.tobytes())
    gathered = smddp.allgather(flat)
    ref = gathered[0].view(np.uint8)
    differ = [r for r in range(size) if not np.array_equal(gathered[r].view(np.uint8), ref)]
    ok = not differ
    if rank == 0:
        print(f"replicas agree bit for bit: {ok} ({n_params} parameters, {size} workers on {nodes})")
        if differ:
            print(f"ranks whose parameters differ from rank 0: {differ}")
        if accuracy < MIN_TEST_ACCURACY:
            print(f"training failed: test accuracy {accuracy:.4f} < {MIN_TEST_ACCURACY}")
    smddp.shutdown()
    return 0 if ok and accuracy >= MIN_TEST_ACCURACY else 1


if __name__ == "__main__":
    sys.exit(main())
