"""smddp's C++ torch backend built ahead for one torch minor version and one CPython, from that torch's wheel (never imported), for a wheel to ship."""

# smddp_rigs.wheels calls this for each wheel it makes (TORCH_PREBUILT there says which torch minors).
# torch is not imported, only read: its headers, its version.py and the four libraries an extension
# links. So the wheel of a CUDA build serves as well as a CPU one, and a machine without the CUDA
# libraries that torch's CUDA wheels need to import builds for them all. What torch's own
# cpp_extension would add, this adds: the same flags as a build on first use (native.CFLAGS), C++20,
# torch's C++ ABI (read from its libraries' symbols), the include directories and libraries.

from __future__ import annotations

import json
import os
import re
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path

from smddp.torch import native

#: The libraries an extension links (torch.utils.cpp_extension's list for a C++ one).
TORCH_LIBS = ("c10", "torch_cpu", "torch", "torch_python")
#: Where a wheel's prebuilt module finds torch's libraries when torch has not loaded them yet:
#: site-packages/smddp/torch/prebuilt/ -> site-packages/torch/lib.
RPATH = "$ORIGIN/../../../torch/lib"


@dataclass(frozen=True)
class TorchTree:
    """What of a torch an extension is built from: its package directory (`torch/`), its version and
    its C++ ABI."""

    root: Path
    version: str
    cxx11_abi: bool


def _run(argv: list[str], timeout: float = 900) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise SystemExit(f"{' '.join(argv[:4])} ... failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out.stdout


def _dynamic_symbols(lib: Path, which: str) -> set[str]:
    """The dynamic symbols of `lib`, `which` "defined" or "undefined", each with its version suffix
    (`@GLIBCXX_3.4`) where it has one."""
    text = _run(["nm", "-D", f"--{which}-only", "--format=posix", str(lib)])
    return {line.split()[0] for line in text.splitlines() if line.strip()}


def torch_tree(root: Path) -> TorchTree:
    """The torch at `root` (a `torch/` package directory, installed or unpacked from its wheel)."""
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", (root / "version.py").read_text(), re.M)
    if found is None:
        raise SystemExit(f"no __version__ in {root / 'version.py'}")
    # The ABI its C++ was built with: libc10 exports std::string-taking functions, mangled with
    # `B5cxx11` (the abi tag of std::__cxx11::basic_string) under the C++11 ABI only.
    abi = any("B5cxx11" in s for s in _dynamic_symbols(root / "lib" / "libc10.so", "defined"))
    return TorchTree(root, found.group(1), abi)


class NoTorchWheel(Exception):
    """The index has no wheel of that torch for that CPython (a torch minor supports a range of them)."""


def fetch_torch(spec: str, python: str, work: Path) -> TorchTree:
    """torch `spec` (pip's, e.g. "torch==2.15.*") for the CPython of interpreter `python`, from the
    index this machine's pip uses, unpacked into `work`: no dependency is downloaded, nothing is
    installed. NoTorchWheel where the index has none for that CPython."""
    # A directory of its own for each spec and interpreter: the one wheel in it is the one asked for.
    dl = work / "download" / re.sub(r"[^A-Za-z0-9.]+", "_", f"{spec} {python}")
    dl.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(dl), spec]
    got_it = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if got_it.returncode:
        if "No matching distribution found" in got_it.stderr:
            raise NoTorchWheel(f"no wheel of {spec} for {python}")
        raise SystemExit(f"pip download {spec} failed ({got_it.returncode}):\n{got_it.stderr[-4000:]}")
    (wheel,) = dl.glob("torch-*.whl")
    into = work / wheel.stem
    if not (into / "torch" / "version.py").exists():
        libs = {f"torch/lib/lib{n}.so" for n in TORCH_LIBS}
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if member.startswith("torch/include/") or member in libs or member == "torch/version.py":
                    z.extract(member, into)
    return torch_tree(into / "torch")


def python_info(python: str) -> dict[str, object]:
    """Of interpreter `python`: its C headers, its (major, minor) and its machine."""
    code = (
        "import json, platform, sys, sysconfig; print(json.dumps({'include': sysconfig.get_paths()['include'], "
        "'version': list(sys.version_info[:2]), 'machine': platform.machine()}))"
    )
    info: dict[str, object] = json.loads(_run([python, "-c", code]))
    return info


def check_symbols(module: Path, tree: TorchTree) -> None:
    """Every C++ symbol `module` takes from outside (bar the C++ runtime's, which are versioned) is one
    that this torch's libraries export: a module built against other headers than these libraries,
    or an ABI that differs, fails here and not in a user's job."""
    # Only torch's: its libraries' symbols carry no version, the C++ runtime's and glibc's do
    # (GLIBCXX_, CXXABI_, GLIBC_), and what the module needs of those is the compiler's to give.
    wanted = {s for s in _dynamic_symbols(module, "undefined") if s.startswith("_Z") and "@" not in s}
    have: set[str] = set()
    for n in TORCH_LIBS:
        have |= {s.split("@")[0] for s in _dynamic_symbols(tree.root / "lib" / f"lib{n}.so", "defined")}
    missing = sorted(wanted - have)
    if missing:
        shown = _run(["c++filt", *missing[:8]]).strip()
        raise SystemExit(
            f"{module.name}: {len(missing)} symbols torch {tree.version} does not export:\n{shown}"
        )


def build(tree: TorchTree, python: str, src: Path, out: Path) -> Path:
    """The backend of source tree `src` (a checkout, or an unpacked wheel: smddp/torch/c10d.cpp and
    smddp/engine/capi.h) built for `tree` and the CPython of `python`, into `out` under the name a
    process of that torch minor and that CPython looks for (native.prebuilt_path)."""
    source, headers = src / "smddp" / "torch" / "c10d.cpp", src / "smddp" / "engine"
    info = python_info(python)
    version = info["version"]
    assert isinstance(version, list)
    name = native.prebuilt_name(
        tree.version,
        tree.cxx11_abi,
        (int(version[0]), int(version[1])),
        str(info["machine"]),
        native.source_hash(source.read_bytes(), (headers / "capi.h").read_bytes()),
    )
    out.mkdir(parents=True, exist_ok=True)
    made = out / f"{name}.so"
    part = out / f"{name}.so.part"
    include = tree.root / "include"
    cxx = os.environ.get("CXX", "c++")
    argv = [
        cxx,
        f"-DTORCH_EXTENSION_NAME={name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(tree.cxx11_abi)}",
        f"-I{headers}",
        "-isystem",
        str(include),
        "-isystem",
        str(include / "torch" / "csrc" / "api" / "include"),
        "-isystem",
        str(info["include"]),
        "-fPIC",
        "-std=c++20",
        *native.CFLAGS,
        "-shared",
        str(source),
        f"-L{tree.root / 'lib'}",
        *[f"-l{n}" for n in TORCH_LIBS],
        f"-Wl,-rpath,{RPATH}",
        "-o",
        str(part),
    ]
    _run(argv)
    check_symbols(part, tree)
    os.replace(part, made)
    return made
