"""tf-keras (Keras 2, TF_USE_LEGACY_KERAS=1) scripts: DistributedOptimizer and Horovod's learning-rate callbacks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import skip_or_fail, smddp_launch

pytestmark = pytest.mark.tensorflow
HERE = Path(__file__).parent
STEPS = 4  # check_legacy_keras: SAMPLES / GLOBAL_BATCH


@pytest.fixture(scope="module", autouse=True)
def _need_tf_keras() -> None:
    for name in ("tensorflow", "tf_keras"):
        if importlib.util.find_spec(name) is None:
            skip_or_fail(f"these tests need {name} (make setup installs it)")


def expected_lrs(world: int) -> list[float]:
    """Horovod's warmup over 2 epochs to 0.1, then 0.05 for epoch 2 and 0.025 for epoch 3."""
    lrs = []
    for epoch in range(2):
        for batch in range(STEPS):
            e = epoch + batch / STEPS + 1 / STEPS
            lrs.append(0.1 * (e * (world - 1) / 2 + 1) / world)
    return lrs + [0.05] * STEPS + [0.025] * STEPS


@pytest.mark.parametrize(
    ("optimizer", "world", "nodes"),
    [
        pytest.param("new", 2, 1, id="new-2-1"),
        pytest.param("legacy", 2, 1, id="legacy-2-1", marks=pytest.mark.long),  # CI: legacy on 2 nodes
        pytest.param("legacy", 4, 2, id="legacy-4-2"),
    ],
)
def test_tf_keras_fit(optimizer: str, world: int, nodes: int, tmp_path: Path, clean_host: None) -> None:
    """Issue 15: DistributedOptimizer refused tf-keras optimizers, and the two callbacks were missing."""
    args = [str(HERE / "check_legacy_keras.py"), "--out", str(tmp_path), "--optimizer", optimizer]
    proc = smddp_launch(world, nodes, args, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    d = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert d[0]["keras"].startswith("tf_keras")
    module = "tf_keras.src.optimizers.legacy." if optimizer == "legacy" else "tf_keras.src.optimizers."
    assert d[0]["optimizer_class"].startswith(module) and d[0]["optimizer_class"].endswith(".SGD")
    # Different starts, one end: the broadcast after the first batch (Horovod's tf.keras timing).
    assert len({json.dumps(x["sync_initial"]) for x in d}) == world
    assert all(x["sync_final"] == d[0]["sync_final"] for x in d)
    # The rate at every batch, and in each epoch's logs.
    lrs = expected_lrs(world)
    for x in d:
        np.testing.assert_allclose(x["lrs"], lrs, rtol=1e-6)
        np.testing.assert_allclose(
            x["logged_lr"], [lrs[STEPS - 1], lrs[2 * STEPS - 1], 0.05, 0.025], rtol=1e-6
        )
    # Momentum correction where the momentum is a variable (legacy): scaled for the batch whose rate changed.
    prev = [0.1, *lrs[:-1]]
    momenta = [0.9 * new / old if new != old else 0.9 for new, old in zip(lrs, prev, strict=True)]
    want = momenta if optimizer == "legacy" else [0.9] * len(lrs)
    np.testing.assert_allclose(d[0]["momenta"], want, rtol=1e-5)
    # Every rank the same bits, and the one-process run on the global batch with the same rates.
    assert all(x["final"] == d[0]["final"] for x in d)
    np.testing.assert_allclose(d[0]["final"], d[0]["reference"], rtol=1e-4, atol=1e-5)


def test_learning_rate_callbacks_in_keras3_fit(tmp_path: Path, clean_host: None) -> None:
    """The same callbacks drive a Keras 3 model.fit: warmup over 2 epochs, then a schedule of the epoch."""
    proc = smddp_launch(2, 1, [str(HERE / "check_lr_keras3.py"), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    want = expected_lrs(2)[: 2 * STEPS] + [0.1 * 0.1 * 2] * STEPS + [0.1 * 0.1 * 3] * STEPS
    for r in range(2):
        d = json.loads((tmp_path / f"rank{r}.json").read_text())
        np.testing.assert_allclose(d["lrs"], want, rtol=1e-6)
        np.testing.assert_allclose(d["logged"], [want[STEPS - 1], want[2 * STEPS - 1], 0.02, 0.03], rtol=1e-6)
