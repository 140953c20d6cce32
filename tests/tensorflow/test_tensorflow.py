"""The TensorFlow front end through real smddp-launch jobs: collectives against the reference model, training against one process."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tests import reference
from tests.conftest import LAUNCHED, REPO, leftovers, smddp_launch
from tests.replicas import assert_replicas_identical

pytestmark = pytest.mark.tensorflow

HERE = Path(__file__).parent
CHECK = str(HERE / "check_tf.py")
REDUCE = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8")
BCAST_ONLY = ("bool", "int8", "int16", "uint16", "uint32", "uint64", "complex64")
OPS = ("sum", "avg", "min", "max")
# check_tf.py's fusion list: index -> dtype as tests/reference.py names it (1 is a None gradient).
FUSION = {
    0: "float32",
    2: "float16",
    3: "float64",
    4: "float32",
    5: "bfloat16",
    6: "float32",
    7: "int32",
    8: "float32",
    9: "float32",
}
STEPS = 6  # check_tf.STEPS


@pytest.fixture(scope="module", autouse=True)
def _need_tensorflow() -> None:
    # find_spec, not an import: TensorFlow costs seconds to import and the jobs import it themselves.
    if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None:
        msg = (
            "the TensorFlow tests need tensorflow and keras 3 (pip install -e '.[tensorflow]', or make setup)"
        )
        if os.environ.get("CI"):
            pytest.fail(msg + "; they must not skip in CI", pytrace=False)
        pytest.skip(msg)


def _ok(proc: Any) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _launch_clean(world: int, nodes: int, args: list[str], timeout: float = 300) -> Any:
    """smddp_launch, then the clean_host check for this one job (the results serve several tests)."""
    before = {n for n in os.listdir("/dev/shm") if "smddp" in n.lower()}
    proc = smddp_launch(world, nodes, args, timeout=timeout)
    job = LAUNCHED[-1]
    deadline = time.monotonic() + 10
    while True:
        left = [x for x in leftovers([job]) if x.removeprefix("/dev/shm/") not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"left behind: {left}"
    return proc


Run = tuple[int, int, list[dict[str, Any]], list[dict[str, np.ndarray]], Path]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], Run]:
    """check_tf.py's results per (workers, nodes), each job run once; the 2-worker job ends failing on purpose."""
    cache: dict[tuple[int, int], Run] = {}

    def get(world: int, nodes: int) -> Run:
        if (world, nodes) not in cache:
            out = tmp_path_factory.mktemp(f"tf-w{world}-n{nodes}")
            args = [CHECK, "--out", str(out)] + (["--fail"] if world == 2 else [])
            _ok(_launch_clean(world, nodes, args))
            js = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
            npz = [dict(np.load(out / f"rank{r}.npz")) for r in range(world)]
            cache[(world, nodes)] = (world, nodes, js, npz, out)
        return cache[(world, nodes)]

    return get


# CI runs every check on 4 workers over 2 nodes; on 2 workers of one node: `make test-long`.
JOBS = pytest.mark.parametrize(
    ("world", "nodes"),
    [pytest.param(2, 1, id="W2-N1", marks=pytest.mark.long), pytest.param(4, 2, id="W4-N2")],
)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@JOBS
def test_ranks_and_aliases(world: int, nodes: int, runs: Callable[[int, int], Run]) -> None:
    _, _, js, _, _ = runs(world, nodes)
    g = world // nodes
    for r, d in enumerate(js):
        assert d["ids"] == [r, world, r % g, g, r, world]
        assert d["aliases"] == [True] * 4  # smdistributed.dataparallel.tensorflow(.keras) are smddp's objects
        assert d["before_init"].startswith("NotInitializedError")
        failed = [k for k, v in d["checks"].items() if not v]
        assert not failed and len(d["checks"]) >= 7 * 4 + 17 + 4, failed


@JOBS
def test_allreduce_every_dtype_and_op_matches_reference(
    world: int, nodes: int, runs: Callable[[int, int], Run]
) -> None:
    """Eagerly and in tf.function, bit for bit what the independent model of smddp's summation order gives."""
    _, _, _, npz, _ = runs(world, nodes)
    for dtype in REDUCE:
        inputs = [a[f"in/{dtype}"].ravel() for a in npz]
        for op in OPS:
            want = reference.allreduce(inputs, dtype, op, nodes)
            for r, a in enumerate(npz):
                for mode in ("eager", "graph"):
                    got = a[f"{mode}/{dtype}/{op}"]
                    assert got.shape == (5, 7) and _same_bits(got.ravel(), want), (dtype, op, mode, r)


@JOBS
def test_fp16_compression_rounds_inputs_and_result(
    world: int, nodes: int, runs: Callable[[int, int], Run]
) -> None:
    """float32 in and out; on the wire float16, summed in float32 by smddp: reference on the rounded inputs."""
    _, _, _, npz, _ = runs(world, nodes)
    sent = [a["fp16/in"].ravel().astype(np.float16) for a in npz]
    want = reference.allreduce(sent, "float16", "avg", nodes).astype(np.float32)
    exact = reference.allreduce([a["fp16/in"].ravel() for a in npz], "float32", "avg", nodes)
    assert not _same_bits(want, exact)  # the rounding shows, so this test can tell
    for a in npz:
        for mode in ("eager", "graph"):
            assert a[f"fp16/{mode}"].dtype == np.float32 and _same_bits(a[f"fp16/{mode}"].ravel(), want)


@JOBS
def test_broadcast_every_dtype(world: int, nodes: int, runs: Callable[[int, int], Run]) -> None:
    _, _, _, npz, _ = runs(world, nodes)
    root = world - 1
    for dtype in REDUCE + BCAST_ONLY:
        want = npz[root][f"bin/{dtype}"]
        assert not _same_bits(npz[0][f"bin/{dtype}"], want)  # every rank started with its own values
        for r, a in enumerate(npz):
            assert _same_bits(a[f"beager/{dtype}"], want) and _same_bits(a[f"bgraph/{dtype}"], want), (
                dtype,
                r,
            )


@JOBS
def test_fusion_buffers_of_mixed_tensors(world: int, nodes: int, runs: Callable[[int, int], Run]) -> None:
    """Dense, sparse (IndexedSlices), scalar, empty, 4 dtypes, 64-byte buffers: each tensor as if reduced alone."""
    _, _, _, npz, _ = runs(world, nodes)
    for comp in ("none", "fp16"):
        for i, dtype in FUSION.items():
            sent = [a[f"fusion_sent/{comp}/{i}"].ravel() for a in npz]
            sent_dtype = dtype
            if comp == "fp16" and dtype != "int32":
                sent_dtype = "float16"
                original = [a[f"fusion_in/{i}"].ravel() for a in npz]
                if dtype == "float32":  # float32 -> float16: round to nearest even
                    assert all(
                        _same_bits(s, o.astype(np.float16)) for s, o in zip(sent, original, strict=True)
                    )
            assert all(s.dtype == reference.storage(sent_dtype) for s in sent), (comp, i)
            want = reference.allreduce(sent, sent_dtype, "avg", nodes)
            if sent_dtype != dtype:  # back to the gradient's dtype
                wide = want.astype(np.float32)
                want = (
                    wide.astype(ml_dtypes.bfloat16).view(np.uint16)
                    if dtype == "bfloat16"
                    else wide.astype(dtype)
                )
            for r, a in enumerate(npz):
                for mode in ("eager", "graph"):
                    got = a[f"fusion/{comp}/{mode}/{i}"]
                    assert got.shape == a[f"fusion_in/{i}"].shape and _same_bits(got.ravel(), want), (
                        comp,
                        i,
                        mode,
                        r,
                    )


@JOBS
def test_training_matches_one_process_on_the_global_batch(
    world: int, nodes: int, runs: Callable[[int, int], Run]
) -> None:
    """DistributedGradientTape (eager, tf.function, small buffers, fp16) and model.fit with DistributedOptimizer."""
    _, _, js, npz, _ = runs(world, nodes)
    for mode in (
        "tape/eager",
        "tape/function",
        "tape/buckets",
        "tape/fp16",
        "fit/final",
        "fit/optimizer",
        "sagemaker/final",
        "sagemaker/optimizer",
    ):
        for r in range(world):
            assert _same_bits(npz[r][mode], npz[0][mode]), (mode, r)  # every rank holds the same bits
    ref_tape, ref_fit = npz[0]["reference/function"], npz[0]["reference/fit"]
    for mode in ("tape/eager", "tape/function", "tape/buckets"):  # about 6e-8 apart here
        np.testing.assert_allclose(npz[0][mode], ref_tape, rtol=1e-4, atol=1e-5, err_msg=mode)
    # float16 on the wire: close to the float32 run (about 5e-5 apart here), but not the same.
    np.testing.assert_allclose(npz[0]["tape/fp16"], ref_tape, rtol=0, atol=5e-4)
    assert not np.array_equal(npz[0]["tape/fp16"], npz[0]["tape/buckets"])
    submits = js[0]["submits"]
    assert submits["function"] == 1 and submits["buckets"] > 1 and submits["fp16"] > 1, submits
    # model.fit: the ranks started apart, the callback gave them rank 0's weights before the first step.
    assert not np.array_equal(npz[0]["fit/initial"], npz[1]["fit/initial"])
    np.testing.assert_allclose(npz[0]["fit/final"], ref_fit, rtol=1e-4, atol=1e-5)


@JOBS
def test_fit_callbacks_and_checkpoint(world: int, nodes: int, runs: Callable[[int, int], Run]) -> None:
    _, _, js, _, _ = runs(world, nodes)
    fits = [d["fit"] for d in js]
    for f in fits:
        assert f["iterations"] == 2 * STEPS and f["optimizer_class"] == "SGD"
        assert f["avg_logs"] == fits[0]["avg_logs"]  # MetricAverageCallback: every rank logs the same
    assert fits[0]["raw_logs"] != fits[1]["raw_logs"]  # ... which were different before it
    for epoch in range(2):
        raw = [f["raw_logs"][epoch]["loss"] for f in fits]
        assert fits[0]["avg_logs"][epoch]["loss"] == pytest.approx(sum(raw) / world, rel=1e-12)
    # A checkpoint saved with the DistributedOptimizer loads as the plain Keras optimizer, weights intact.
    assert fits[0]["loaded_optimizer"] == "keras.src.optimizers.sgd.SGD" and fits[0]["loaded_equal"]


@JOBS
def test_broadcast_variables_and_tf1_hook(world: int, nodes: int, runs: Callable[[int, int], Run]) -> None:
    _, _, js, npz, _ = runs(world, nodes)
    assert not np.array_equal(npz[0]["bv/before"], npz[1]["bv/before"])
    for r, a in enumerate(npz):
        assert _same_bits(a["bv/after"], npz[0]["bv/before"]), r  # eager, model and optimizer variables
        assert a["bv/iterations"].tolist() == [5]  # rank 0's optimizer step counter (int64)
        # bool, int8, float16, int64, complex64 variables from the last rank, inside a tf.function
        assert _same_bits(a["bv/extra_after"], npz[world - 1]["bv/extra_before"]), r
    for d in js:
        assert d["tf1"]["op"] == [[float(world - 1)] * 3, [i * world for i in range(4)]]
        assert d["tf1"]["hook"] == [10.0, 10.0]


@JOBS
def test_bad_input_raises_before_anything_is_sent(
    world: int, nodes: int, runs: Callable[[int, int], Run]
) -> None:
    _, _, js, _, _ = runs(world, nodes)
    for d in js:
        e = d["errors"]
        for key, word in [("string", "string"), ("complex", "complex64"), ("broadcast_string", "string")]:
            assert e[key].startswith("UnsupportedBufferError: ") and f"dtype {word}" in e[key], e[key]
        assert "nothing was sent" in e["string"]
        # Raised while a tf.function is traced: still smddp's type (AutoGraph keeps it), naming the tensor.
        assert (
            e["int8_in_function"].startswith("UnsupportedBufferError: ")
            and "dtype int8" in e["int8_in_function"]
        )
        assert (
            e["broadcast_variables_string"].startswith("UnsupportedBufferError: ")
            and "variable 0" in e["broadcast_variables_string"]
        )
        assert e["xla"].startswith("InvalidArgumentError: ") and "jit_compile=False" in e["xla"]
        expect = {
            "op": "'prod'",
            "root": f"root_rank {world} is out of range",
            "param_index": "param_index 2",
            "num_params_type": "num_params must be an int, got 1.5",
            "compression": "compression must be",
            "tape_op": "not reduced with MIN",
            "tape_device": "device_dense",
            "tape_not_a_tape": "wraps a tf.GradientTape",
            "bucket": "bucket_cap_mb",
            "optimizer_type": "keras.optimizers.Optimizer",
            "optimizer_twice": "already a DistributedOptimizer",
            "global_variables_eager": "broadcast_variables(model.variables",
        }
        for key, text in expect.items():
            assert e[key].startswith("InvalidArgumentError: ") and text in e[key], (key, e[key])
        # None of them reached the daemons: the next collective lines up on every rank.
        assert d["after_errors_sum"] == world * (world + 1) / 2


def test_mismatch_inside_tf_function_names_the_cause(runs: Callable[[int, int], Run]) -> None:
    _, _, _, _, out = runs(2, 1)
    for r in range(2):
        d = json.loads((out / f"fail{r}.json").read_text())
        # TF wraps what a numpy_function raises; the text is smddp's, naming both ranks' collectives.
        assert (
            "CollectiveMismatchError: " in d["graph"] and "count=4" in d["graph"] and "count=5" in d["graph"]
        ), d
        assert (
            d["eager_after"].startswith("CollectiveMismatchError: ")
            and d["eager_is_collective_error"] == "yes"
        )


def test_example_keras_digits(clean_host: None, tmp_path: Path) -> None:
    example = [
        str(REPO / "examples" / "tensorflow" / "train_keras.py"),
        "--epochs",
        "3",
        "--save-params",
        str(tmp_path),
    ]
    proc = smddp_launch(4, 2, example)
    _ok(proc)
    acc = [float(m) for m in re.findall(r"test accuracy (\d\.\d+)", proc.stdout)]
    assert len(acc) == 3 and acc[-1] > 0.9, proc.stdout[-3000:]
    assert "replicas agree bit for bit: True" in proc.stdout
    assert_replicas_identical(tmp_path, 4)
