"""FSDP2, FSDP1, DeviceMesh/DTensor and functional (also compiled) collectives on smddp, bit for bit against gloo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import need_module, smddp_launch

torch = need_module("torch", "pip install -e '.[torch]'")

pytestmark = pytest.mark.torch
HERE = Path(__file__).parent


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


def _run(tmp: Path, backend: str) -> list[dict[str, Any]]:
    out = tmp / backend
    out.mkdir()
    proc = smddp_launch(
        2, 1, [str(HERE / "check_fsdp.py"), "--out", str(out), "--backend", backend], timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [_flat(torch.load(out / f"rank{r}.pt")) for r in range(2)]


def test_fsdp_and_functional_collectives_match_gloo(tmp_path: Path, clean_host: None) -> None:
    """Issue 15: fully_shard raised "ProcessGroup name not set" on smddp; now every result is gloo's, bit for bit."""
    ours, ref = _run(tmp_path, "smddp"), _run(tmp_path, "gloo")
    for r in range(2):
        assert ours[r].keys() == ref[r].keys()
        assert any(k.startswith("fsdp2/params/") for k in ours[r]) and any(
            k.startswith("fsdp1/params/") for k in ours[r]
        )
        for key, a in ours[r].items():
            b = ref[r][key]
            if isinstance(a, torch.Tensor):
                a, b = torch.as_tensor(a), torch.as_tensor(b)
                assert a.dtype == b.dtype and a.shape == b.shape, key
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (key, a, b)
            else:
                assert a == b, (key, a, b)
        assert ours[r]["functional/name"] == "0"  # the default group's name, as torch gives it
        # The collectives' values themselves (not only agreement with gloo).
        x = torch.arange(6, dtype=torch.float32)
        assert torch.equal(ours[r]["functional/all_reduce"], x * 3)
        assert torch.equal(ours[r]["functional/compiled"], x * 6 + 1)
        assert torch.equal(ours[r]["functional/all_gather"], torch.cat([x, 2 * x]))
        assert torch.equal(
            ours[r]["functional/dtensor_full"], torch.arange(24, dtype=torch.float32).reshape(8, 3)
        )
        for name, t in ours[r].items():  # parameters agree on both ranks
            if "/params/" in name:
                assert torch.equal(t, ours[0][name]), name


def test_two_dimensional_device_mesh(tmp_path: Path, clean_host: None) -> None:
    """A 2x2 DeviceMesh on smddp: its dimensions are smddp subgroups (run by the side group), and
    DTensor shards and gathers over them to the exact values."""
    proc = smddp_launch(4, 2, [str(HERE / "check_mesh.py"), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(4):
        d = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert d["full"] and d["rows"] and d["local"] == [4, 3], d
        assert d["backends"] == ["smddp", "smddp"] and d["sizes"] == [2, 2], d
        assert d["world_backend"] == "smddp"
