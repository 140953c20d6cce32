"""The C++ torch backend's routes to a user: built on first use once a node, else the Python one or an error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BIN, REPO, job_env, need_module

torch = need_module("torch", "pip install -e '.[torch]'")

pytestmark = pytest.mark.torch

HERE = Path(__file__).resolve().parent
BUILDING = "building the C++ torch backend"


def _launch(world: int, nodes: int, out: Path, **env: str) -> str:
    cmd = [str(BIN / "smddp-launch"), "-np", str(world), "--local-nodes", str(nodes), "--"]
    cmd += [sys.executable, str(HERE / "check_native.py"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=job_env(**env), cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def _torch_backend(*flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(BIN / "smddp"), "torch-backend", "--json", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=job_env(**env), cwd=REPO)


def _ranks(out: Path, world: int) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_built_on_first_use_once_for_every_rank(tmp_path: Path, clean_host: None) -> None:
    """An empty build directory: 4 ranks (2 local nodes sharing it) build the backend once, under the
    lock, and every rank then runs on it."""
    build = tmp_path / "build"
    text = _launch(4, 2, tmp_path, SMDDP_TORCH_BUILD_DIR=str(build), SMDDP_TORCH_BACKEND="native")
    assert text.count(BUILDING) == 1, text[-4000:]
    for d in _ranks(tmp_path, 4):
        assert d == {"kind": "native", "sum": True}, d
    (built,) = [p for p in build.iterdir() if p.is_dir()]
    assert not built.name.endswith(".building")
    # `smddp torch-backend` finds it, with no compiler on the machine, and says a group gets it.
    said = _torch_backend(SMDDP_TORCH_BUILD_DIR=str(build), CXX="/nonexistent/c++")
    assert said.returncode == 0, said.stderr
    r = json.loads(said.stdout)
    assert r["module"] == str(built / f"{built.name}.so") and r["build_dir"] == str(built), r
    assert (r["group_gets"], r["torch"], r["error"]) == ("native", torch.__version__, ""), r
    # A second job finds it, and needs no compiler: nothing is built again.
    again = tmp_path / "again"
    again.mkdir()
    text = _launch(
        2, 1, again, SMDDP_TORCH_BUILD_DIR=str(build), SMDDP_TORCH_BACKEND="native", CXX="/nonexistent/c++"
    )
    assert BUILDING not in text
    assert _ranks(again, 2) == [{"kind": "native", "sum": True}] * 2


def test_no_compiler_falls_back_to_python_with_one_warning(tmp_path: Path, clean_host: None) -> None:
    build = tmp_path / "build"
    text = _launch(
        2, 1, tmp_path, SMDDP_TORCH_BUILD_DIR=str(build), SMDDP_TORCH_BACKEND="auto", CXX="/nonexistent/c++"
    )
    assert _ranks(tmp_path, 2) == [{"kind": "python", "sum": True}] * 2
    warned = [line for line in text.splitlines() if "torch groups use the Python backend" in line]
    assert len(warned) == 2 and all("no C++ compiler" in line for line in warned), text[-4000:]


def test_native_asked_without_compiler_fails_naming_why(tmp_path: Path, clean_host: None) -> None:
    build = tmp_path / "build"
    _launch(
        2, 1, tmp_path, SMDDP_TORCH_BUILD_DIR=str(build), SMDDP_TORCH_BACKEND="native", CXX="/nonexistent/c++"
    )
    for d in _ranks(tmp_path, 2):
        assert d["error"].startswith("BackendUnavailableError: smddp: no C++ compiler"), d


@pytest.mark.parametrize("asked", ["auto", "native"])
def test_building_ahead_without_a_compiler_fails_naming_why(tmp_path: Path, asked: str) -> None:
    """`smddp torch-backend --build` where no compiler is: exit 1 with the reason, nothing left in the
    build directory, and what a group would get (the Python backend; with native asked, none)."""
    build = tmp_path / "build"
    said = _torch_backend(
        "--build", SMDDP_TORCH_BUILD_DIR=str(build), SMDDP_TORCH_BACKEND=asked, CXX="/nonexistent/c++"
    )
    assert said.returncode == 1
    assert said.stderr.strip().splitlines()[-1].startswith("smddp: no C++ compiler to build"), said.stderr
    r = json.loads(said.stdout)
    assert r["module"] is None and r["error"].startswith("smddp: no C++ compiler"), r
    assert r["group_gets"] == ("python" if asked == "auto" else "none"), r
    assert "no C++ compiler" in r["why"], r
    assert not build.exists() or [p for p in build.iterdir() if not p.name.endswith(".lock")] == []


def test_a_prebuilt_module_that_does_not_load_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A wheel's module for this torch minor that does not load (a patch release that broke torch's
    ABI): a warning names it and why, and the backend is had as where there is none (here: built,
    which with no compiler fails naming that)."""
    from smddp.errors import BackendUnavailableError
    from smddp.torch import native

    monkeypatch.setattr(native, "PREBUILT", tmp_path / "prebuilt")
    monkeypatch.setenv("SMDDP_TORCH_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    pre = native.prebuilt_path()
    minor = native.torch_minor(torch.__version__).replace(".", "_")
    assert (
        pre.parent == tmp_path / "prebuilt"
        and f"_torch{minor}_" in pre.name
        and native.source_hash() in pre.name
    )
    pre.parent.mkdir()
    pre.write_bytes(b"\x7fELF not a module")
    loader = native._Loader()
    monkeypatch.setattr(native, "_loader", loader)
    with caplog.at_level("WARNING", logger="smddp.torch"), pytest.raises(BackendUnavailableError) as e:
        loader.get()
    assert str(e.value).startswith("smddp: no C++ compiler to build the C++ torch backend"), e.value
    # `smddp torch-backend` in that state: nothing that loads, and a group gets the Python backend.
    report = native.report(build=False)
    assert (report["prebuilt"], report["module"], report["group_gets"]) == (False, None, "python"), report
    (warned,) = [r.getMessage() for r in caplog.records if "prebuilt" in r.getMessage()]
    assert warned.startswith(f"smddp: the prebuilt C++ torch backend {pre} does not load here ("), warned
