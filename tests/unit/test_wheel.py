"""What ships is what users run: manylinux wheels for CPython 3.10-3.13 (one cp312-abi3, one cp311, one cp310) that
hold no test rig, pass twine's checks, and install and run the demo with no compiler anywhere on PATH;
the sdist refuses to build without one, naming it. (CI builds and installs the abi3 and cp310 wheels;
the cp311 one, built the same way, is the long tier's.)"""

from __future__ import annotations

import concurrent.futures
import tarfile
from pathlib import Path

import pytest
from smddp_rigs import wheels

from tests.conftest import skip_or_fail
from tests.replicas import assert_replicas_identical

RIGS = ("simcluster", "delayline", "standin", "targets", "benchmarks_md", "smddp_rigs", "rigs/")


#: What CI builds and installs: the abi3 wheel (3.12 and 3.13 install it) and cp310's. cp311's is
#: built the same way from the same sdist (only its Python's headers differ): test_the_cp311_wheel, in
#: the long tier (each wheel's compile is about 35 s of CI's time).
CI_BUILT = ("3.12", "3.10")
CI_VERSIONS = ("3.10", "3.12", "3.13")


def _pythons(versions: tuple[str, ...]) -> dict[str, str]:
    py = wheels.pythons(versions)
    missing = [v for v in versions if v not in py]
    if missing:
        skip_or_fail(
            f"the wheel checks need CPython {', '.join(missing)} (pyenv install, or python3.X on PATH)"
        )
    return py


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], list[Path]]:
    py = _pythons(CI_VERSIONS)
    return py, wheels.build(tmp_path_factory.mktemp("dist"), py, CI_BUILT)


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
def test_manylinux_wheels_for_every_cpython(built: tuple[dict[str, str], list[Path]], tmp_path: Path) -> None:
    py, made = built
    names = sorted(p.name for p in made)
    for tag in ("-cp312-abi3-", "-cp310-cp310-"):
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

    # Each CPython installs its wheel where no compiler is found (two installs at a time: mostly
    # unpacking), then runs a real job from it (one job at a time).
    def install(v: str) -> tuple[Path, dict[str, str]]:
        return wheels.install_bare(wheels.wheel_for(made, v), py[v], tmp_path)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        venvs = dict(zip(CI_VERSIONS, pool.map(install, CI_VERSIONS), strict=True))
    for v, (venv, env) in venvs.items():
        _demo(v, venv, env, tmp_path)


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_the_cp311_wheel(tmp_path: Path) -> None:
    """The cp311 wheel, built from the sdist as the others are (make wheels builds all three): what
    it holds, and the demo from it on CPython 3.11 with no compiler."""
    py = _pythons(("3.11",))
    made = wheels.build(tmp_path / "dist", py, ("3.11",))
    (wheel,) = [w for w in made if w.suffix == ".whl"]
    assert "-cp311-cp311-manylinux_" in wheel.name and wheel.name.endswith("_x86_64.whl"), wheel.name
    _check_wheel(wheel)
    venv, env = wheels.install_bare(wheel, py["3.11"], tmp_path)
    _demo("3.11", venv, env, tmp_path)


def test_the_sdist_names_the_missing_compiler(
    built: tuple[dict[str, str], list[Path]], tmp_path: Path
) -> None:
    py, made = built
    sdist = next(p for p in made if p.name.endswith(".tar.gz"))
    text = wheels.check_sdist_without_compiler(sdist, py["3.10"], tmp_path)
    assert (
        "needs a C++17 compiler for its engine" in text and "'g++-nowhere' ($CXX) is not on PATH" in text
    ), text[-3000:]
