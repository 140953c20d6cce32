"""The GPU step's kernels: the committed PTX (smddp/engine/kernels_ptx.h) is what nvcc makes of kernels.cu now."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from smddp_rigs import kernels_ptx

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_ptx_is_what_nvcc_makes_of_the_source() -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc is not on CI's PATH: the kernels' PTX cannot be checked")
        pytest.skip("no nvcc here")
    committed = (ROOT / kernels_ptx.PATH).read_text()
    assert committed == kernels_ptx.header(kernels_ptx.ptx(nvcc, ROOT)), (
        "kernels_ptx.h is stale: run `make ptx`"
    )


def test_every_wire_dtype_has_its_fold_entry() -> None:
    text = (ROOT / kernels_ptx.PATH).read_text()
    for name in ("uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"):
        assert f".entry smddp_fold_{name}(" in text
