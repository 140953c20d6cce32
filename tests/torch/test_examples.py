"""The real-client examples (FSDP2, DeepSpeed, Hugging Face Trainer) under smddp-launch, and HF's SageMaker route."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, need_module, smddp_launch
from tests.replicas import assert_replicas_identical

torch = need_module("torch", "pip install -e '.[torch]'")

pytestmark = pytest.mark.torch
HERE = Path(__file__).parent
EXAMPLES = REPO / "examples" / "torch"
AGREE = "[rank 0] replicas agree bit for bit: True"


# The DeepSpeed example is `long` (100 s here, most of it DeepSpeed's own start): CI runs DeepSpeed
# through tests/torch/test_deepspeed.py, whose ZeRO-3 job it compares with gloo's.
@pytest.mark.parametrize(
    "script", ["train_fsdp2.py", pytest.param("train_deepspeed.py", marks=pytest.mark.long)]
)
def test_sharded_examples_train_on_two_nodes(script: str, clean_host: None) -> None:
    if script == "train_deepspeed.py":
        need_module("deepspeed", "make setup installs it")
    proc = smddp_launch(4, 2, [str(EXAMPLES / script), "--epochs", "3"], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert AGREE in "\n".join(lines), proc.stdout[-2000:]
    accuracy = [float(x.split("test accuracy ")[1].split()[0]) for x in lines if "test accuracy" in x]
    assert len(accuracy) == 3 and accuracy[-1] > 0.85, accuracy  # it learns: digits are easy


def test_hf_trainer_example_matches_gloo(tmp_path: Path, clean_host: None) -> None:
    need_module("transformers", "make setup installs it")
    got = {}
    for backend in ("smddp", "gloo"):
        save = tmp_path / f"{backend}.pt"
        params = tmp_path / backend
        params.mkdir()
        args = [str(EXAMPLES / "train_hf_trainer.py"), "--epochs", "2", "--backend", backend]
        args += ["--save", str(save), "--save-params", str(params)]
        proc = smddp_launch(2, 1, args, timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert AGREE in proc.stdout and f"backend {backend}, 2 workers" in proc.stdout, proc.stdout[-2000:]
        got[backend] = torch.load(save)
        # Each rank's own bytes, compared here (the printed line is decided by smddp's all_gather).
        assert_replicas_identical(params, 2)
    assert torch.equal(got["smddp"], got["gloo"])


def test_hf_sagemaker_dp_route_starts_smddp(
    tmp_path: Path, clean_host: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SageMaker data-parallel mode: Hugging Face finds smdistributed, accelerate starts the "smddp"
    group through it, and SMDATAPARALLEL_LOCAL_RANK is there. On a CPU accelerate then stops at its
    own CUDA device lookup (docs/torch.md): that part is theirs."""
    need_module("transformers", "make setup installs it")
    monkeypatch.setenv(
        "SM_FRAMEWORK_PARAMS", json.dumps({"sagemaker_distributed_dataparallel_enabled": True})
    )
    proc = smddp_launch(2, 1, [str(HERE / "check_hf_sagemaker.py"), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(2):
        d = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert d["sagemaker_dp"] is True and d["smdataparallel_local_rank"] == r
        assert (d["backend"], d["rank"], d["world"]) == ("smddp", r, 2), d
        if not torch.cuda.is_available():
            assert d["stopped_at"] is not None and d["where"] == "set_device", d
