"""DeepSpeed ZeRO stage 3 on smddp (init_distributed(dist_backend="smddp")), bit for bit against gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import need_module, smddp_launch

torch = need_module("torch", "pip install -e '.[torch]'")
need_module("deepspeed", "make setup installs it")

pytestmark = pytest.mark.torch
HERE = Path(__file__).parent


def _run(tmp: Path, backend: str, world: int) -> list[dict[str, Any]]:
    out = tmp / backend
    out.mkdir()
    args = [str(HERE / "check_deepspeed.py"), "--out", str(out), "--backend", backend]
    proc = smddp_launch(world, 1, args, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def test_deepspeed_zero3_matches_gloo(tmp_path: Path, clean_host: None) -> None:
    """Issue 15: DeepSpeed stopped on LOCAL_RANK != OMPI_COMM_WORLD_LOCAL_RANK (the daemons were in
    the workers' MPI world). Now ZeRO-3 trains on smddp and gives gloo's losses and parameters."""
    ours, ref = _run(tmp_path, "smddp", 2), _run(tmp_path, "gloo", 2)
    for r in range(2):
        assert ours[r]["backend"] == "smddp" and ref[r]["backend"] == "gloo"
        assert ours[r]["zero"] == 3
        assert ours[r]["losses"] == ref[r]["losses"]
        assert ours[r]["params"].keys() == ref[r]["params"].keys() and ours[r]["params"]
        for name, t in ours[r]["params"].items():
            assert t.numel() > 0, name  # gathered, not a ZeRO-3 placeholder
            assert torch.equal(t, ref[r]["params"][name]), name
            assert torch.equal(t, ours[0]["params"][name]), name
