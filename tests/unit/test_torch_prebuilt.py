"""The check a prebuilt C++ torch backend passes before a wheel ships it: every C++ symbol it takes from torch, torch's libraries export."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from smddp_rigs import torch_prebuilt

from tests.conftest import need_module

torch = need_module("torch", "pip install -e '.[torch]'")

pytestmark = pytest.mark.torch

# A module that calls into c10: one function torch exports (c10's demangled name of its
# `get_backtrace`, declared here as torch's own header does) and, where asked, one it does not.
CALLER = """
#include <cstddef>
#include <string>
namespace c10 {
std::string get_backtrace(std::size_t frames_to_skip, std::size_t maximum_number_of_frames, bool skip_python_frames);
%s
}
extern "C" std::size_t smddp_probe() { %s return c10::get_backtrace(0, 1, true).size(); }
"""


def _module(tmp_path: Path, name: str, missing: bool) -> Path:
    src = tmp_path / f"{name}.cc"
    extra = ("void smddp_not_in_torch(int);", "c10::smddp_not_in_torch(1);") if missing else ("", "")
    src.write_text(CALLER % extra)
    so = tmp_path / f"{name}.so"
    subprocess.run(
        ["g++", "-std=c++17", "-fPIC", "-shared", str(src), "-o", str(so)], check=True, timeout=120
    )
    return so


def test_a_symbol_torch_does_not_export_stops_the_module(tmp_path: Path) -> None:
    tree = torch_prebuilt.torch_tree(Path(torch.__file__).parent)
    assert tree.version == torch.__version__ and tree.cxx11_abi == bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    torch_prebuilt.check_symbols(_module(tmp_path, "good", missing=False), tree)
    with pytest.raises(SystemExit) as e:
        torch_prebuilt.check_symbols(_module(tmp_path, "bad", missing=True), tree)
    text = str(e.value)
    assert f"1 symbols torch {torch.__version__} does not export" in text, text
    assert text.strip().splitlines()[-1] == "c10::smddp_not_in_torch(int)", text
