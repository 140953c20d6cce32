"""What ships is what users run: manylinux wheels for CPython 3.10-3.13 (one cp312-abi3, one cp311, one cp310) that
hold no test rig, pass twine's checks, and install and run the demo with no compiler anywhere on PATH,
and the C++ torch backend prebuilt, which a group then runs on; the sdist refuses to build without one,
naming it. (CI builds and installs the abi3 and cp311 wheels; the cp310 one, built the same way, is
the long tier's.)"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from smddp_rigs import wheels

from tests.conftest import REPO, need_module, skip_or_fail
from tests.replicas import assert_replicas_identical

RIGS = ("simcluster", "delayline", "standin", "targets", "benchmarks_md", "smddp_rigs", "rigs/")

#: This interpreter's CPython: its wheel ships the C++ torch backend prebuilt for the torch installed
#: here (test_the_torch_backend_loads_prebuilt_with_no_compiler); make wheels builds TORCH_PREBUILT's.
HERE_PY = f"{sys.version_info[0]}.{sys.version_info[1]}"
#: What CI builds and installs: the abi3 wheel (3.12 and 3.13 install it) and cp311's. cp310's is
#: built the same way from the same sdist (only its Python's headers differ): test_the_cp310_wheel, in
#: the long tier (each wheel's compile is about 35 s of CI's time).
CI_BUILT = ("3.12", "3.11")
CI_VERSIONS = ("3.11", "3.12", "3.13")


def _pythons(versions: tuple[str, ...]) -> dict[str, str]:
    py = wheels.pythons(versions)
    missing = [v for v in versions if v not in py]
    if missing:
        skip_or_fail(
            f"the wheel checks need CPython {', '.join(missing)} (pyenv install, or python3.X on PATH)"
        )
    return py


def _torch() -> tuple[Path, str]:
    """The torch installed here: its package directory and its version."""
    torch = need_module("torch", "pip install -e '.[torch]'")
    return Path(torch.__file__).parent, torch.__version__


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], list[Path]]:
    py = _pythons(CI_VERSIONS)
    assert HERE_PY in CI_VERSIONS, f"CI installs no wheel of this CPython ({HERE_PY})"
    return py, wheels.build(tmp_path_factory.mktemp("dist"), py, CI_BUILT, {HERE_PY: [_torch()[0]]})


@pytest.fixture(scope="module")
def installed(
    built: tuple[dict[str, str], list[Path]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, dict[str, str]]]:
    """Each CPython's wheel in a venv of its own where no compiler is found (two installs at a time:
    mostly unpacking); this CPython's with the torch installed here beside it."""
    py, made = built
    where = tmp_path_factory.mktemp("installed")

    def install(v: str) -> tuple[Path, dict[str, str]]:
        also = (f"torch=={_torch()[1]}",) if v == HERE_PY else ()
        return wheels.install_bare(wheels.wheel_for(made, v), py[v], where, also=also)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CI_VERSIONS, pool.map(install, CI_VERSIONS), strict=True))


def _check_wheel(wheel: Path) -> None:
    """A built wheel holds smddp's packages alone (no test rig, tests or examples), its engine for its
    Python, and no libstdc++ of the builder's."""
    listed = wheels.wheel_files(wheel)
    code = [n for n in listed if ".dist-info/" not in n]
    assert code and all(n.startswith(("smddp/", "smdistributed/")) for n in code), code
    assert [n for n in listed if any(r in n for r in RIGS)] == []
    assert not any(n.startswith(("tests/", "examples/")) for n in listed)
    for shipped in ("smddp/settings.py", "smddp/client/device/runtime.py", "smddp/launcher/elastic.py"):
        assert shipped in listed
    prebuilt = [n for n in listed if n.startswith("smddp/torch/prebuilt/")]
    assert all(n.endswith(".so") for n in prebuilt) and prebuilt == sorted(set(prebuilt)), prebuilt
    engine = [n for n in listed if n.startswith("smddp/_engine.") and n.endswith(".so")]
    assert engine == (
        ["smddp/_engine.abi3.so"]
        if "abi3" in wheel.name
        else ["smddp/_engine.cpython-311-x86_64-linux-gnu.so"]
        if "-cp311-" in wheel.name
        else ["smddp/_engine.cpython-310-x86_64-linux-gnu.so"]
    )
    # No libstdc++ of the builder's: the C++ runtime is inside the extension.
    assert not any("libstdc++" in n for n in listed)


def _demo(v: str, venv: Path, env: dict[str, str], tmp_path: Path) -> None:
    params = tmp_path / f"params-{v}"
    params.mkdir()
    out = wheels.run_demo(venv, env, tmp_path, params)
    assert "replicas agree bit for bit: True" in out and "4 workers" in out, (v, out[-2000:])
    assert_replicas_identical(params, 4)


@pytest.mark.timeout(1800)
def test_manylinux_wheels_for_every_cpython(
    built: tuple[dict[str, str], list[Path]],
    installed: dict[str, tuple[Path, dict[str, str]]],
    tmp_path: Path,
) -> None:
    _, made = built
    names = sorted(p.name for p in made)
    for tag in ("-cp312-abi3-", "-cp311-cp311-"):
        assert len([n for n in names if f"{tag}manylinux_" in n and n.endswith("_x86_64.whl")]) == 1, (
            tag,
            names,
        )
    assert len([n for n in names if n.endswith(".whl")]) == 2 and any(n.endswith(".tar.gz") for n in names), (
        names
    )
    sdist = next(p for p in made if p.name.endswith(".tar.gz"))
    with tarfile.open(sdist) as t:
        shipped_src = t.getnames()
    assert any(n.endswith("smddp/engine/module.cc") for n in shipped_src)
    assert not any(n.endswith(".so") for n in shipped_src), "the sdist carries a built engine"
    for wheel in (w for w in made if w.suffix == ".whl"):
        _check_wheel(wheel)
    # Each CPython runs a real job from its wheel (one job at a time).
    for v, (venv, env) in installed.items():
        _demo(v, venv, env, tmp_path)


@pytest.mark.torch
@pytest.mark.timeout(900)
def test_the_torch_backend_loads_prebuilt_with_no_compiler(
    built: tuple[dict[str, str], list[Path]],
    installed: dict[str, tuple[Path, dict[str, str]]],
    tmp_path: Path,
) -> None:
    """The wheel of this CPython holds the C++ torch backend built for the torch installed here (and
    nothing for another CPython); installed beside that torch where no compiler is found, `smddp
    torch-backend` says a group gets the prebuilt one, and a 4-rank job on 2 nodes that asks for the
    C++ backend (an error where it cannot have it) runs its all-reduce on it."""
    _, made = built
    version = _torch()[1]
    minor = ".".join(version.split("+")[0].split(".")[:2]).replace(".", "_")
    cp = f"cp{HERE_PY.replace('.', '')}"
    ours = wheels.wheel_for(made, HERE_PY)
    for wheel in (w for w in made if w.suffix == ".whl" and w != ours):
        assert [n for n in wheels.wheel_files(wheel) if n.startswith("smddp/torch/prebuilt/")] == [], (
            wheel.name
        )
    prebuilt = [n for n in wheels.wheel_files(ours) if n.startswith("smddp/torch/prebuilt/")]
    assert len(prebuilt) == 1 and prebuilt[0].endswith(f"_torch{minor}_abi1_{cp}_x86_64.so"), prebuilt
    venv, env = installed[HERE_PY]
    said = subprocess.run(
        [str(venv / "bin" / "smddp"), "torch-backend", "--json"], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert said.returncode == 0, said.stdout + said.stderr
    r = json.loads(said.stdout)
    assert (r["torch"], r["prebuilt"], r["group_gets"]) == (version, True, "native"), r
    assert r["module"] == str(venv / "lib" / f"python{HERE_PY}" / "site-packages" / prebuilt[0]), r
    assert "no C++ compiler" in subprocess.run(
        [str(venv / "bin" / "python"), "-c", "from smddp.torch import native; print(native.cannot_build())"],
        capture_output=True, text=True, env=env, timeout=300,
    ).stdout  # fmt: skip
    out = tmp_path / "ranks"
    out.mkdir()
    launch = [str(venv / "bin" / "smddp-launch"), "-np", "4", "--local-nodes", "2", "--"]
    job = [*launch, str(venv / "bin" / "python")]
    job += [str(REPO / "tests" / "torch" / "check_native.py"), "--out", str(out)]
    native_env = {**env, "SMDDP_TORCH_BACKEND": "native"}
    ran = subprocess.run(job, capture_output=True, text=True, env=native_env, cwd=tmp_path, timeout=600)
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
    assert "building the C++ torch backend" not in ran.stdout + ran.stderr
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert ranks == [{"kind": "native", "sum": True}] * 4, ranks


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_the_cp310_wheel(tmp_path: Path) -> None:
    """The cp310 wheel, built from the sdist as the others are (make wheels builds all three): what
    it holds, and the demo from it on CPython 3.10 with no compiler."""
    py = _pythons(("3.10",))
    made = wheels.build(tmp_path / "dist", py, ("3.10",), {})
    (wheel,) = [w for w in made if w.suffix == ".whl"]
    assert "-cp310-cp310-manylinux_" in wheel.name and wheel.name.endswith("_x86_64.whl"), wheel.name
    _check_wheel(wheel)
    venv, env = wheels.install_bare(wheel, py["3.10"], tmp_path)
    _demo("3.10", venv, env, tmp_path)


def test_the_sdist_names_the_missing_compiler(
    built: tuple[dict[str, str], list[Path]], tmp_path: Path
) -> None:
    py, made = built
    sdist = next(p for p in made if p.name.endswith(".tar.gz"))
    text = wheels.check_sdist_without_compiler(sdist, py["3.11"], tmp_path)
    assert (
        "needs a C++17 compiler for its engine" in text and "'g++-nowhere' ($CXX) is not on PATH" in text
    ), text[-3000:]
