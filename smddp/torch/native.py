"""The C++ torch backend (c10d.cpp): prebuilt for this torch, else built on first use once a node, and which one a group gets."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import smddp
from smddp import settings
from smddp.errors import BackendUnavailableError, CollectiveTimeoutError

log = logging.getLogger("smddp.torch")

SOURCE = Path(__file__).with_name("c10d.cpp")
HEADERS = Path(__file__).parent.parent / "engine"  # capi.h, the engine's C table: the one header it needs
CFLAGS = ["-O2", "-Wall", "-Wextra", "-Werror"]  # (warnings are errors in smddp's native code)
BUILD_TIMEOUT_S = 900.0  # a build, and a rank's wait for another's (a compile took 28 s on a 2-core VM)
# Modules a wheel ships, built ahead for the torch minor versions it names (smddp_rigs.torch_prebuilt,
# `make wheels`): none in a checkout.
PREBUILT = Path(__file__).with_name("prebuilt")


def source_hash(source: bytes | None = None, header: bytes | None = None) -> str:
    """The backend's source and the C table's header, hashed: a prebuilt module is this source's only
    where its name carries this (one shipped by another smddp is never loaded)."""
    h = hashlib.sha256()
    for part in (source if source is not None else SOURCE.read_bytes(),
                 header if header is not None else (HEADERS / "capi.h").read_bytes()):  # fmt: skip
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:12]


def torch_minor(version: str) -> str:
    """The minor version of a torch version ("2.13" of "2.13.0+cpu"): what a prebuilt module is picked
    by (torch keeps its C++ ABI within a minor)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return f"{major}.{minor}"


def prebuilt_name(
    torch_version: str, cxx11_abi: bool, python: tuple[int, int], machine: str, src: str
) -> str:
    """The module name (and file stem) of a backend built ahead from source hash `src` for a torch minor
    version, its C++ ABI, a CPython and a machine."""
    minor = torch_minor(torch_version).replace(".", "_")
    return f"smddp_c10d_{src}_torch{minor}_abi{int(cxx11_abi)}_cp{python[0]}{python[1]}_{machine}"


def prebuilt_path() -> Path:
    """Where the wheel's module for this torch, Python and machine would be (it may not be there)."""
    name = prebuilt_name(
        torch.__version__,
        bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        (sys.version_info[0], sys.version_info[1]),
        platform.machine(),
        source_hash(),
    )
    return PREBUILT / f"{name}.so"


def build_root() -> Path:
    """Where builds live (SMDDP_TORCH_BUILD_DIR, else the user's cache directory)."""
    given = settings.from_env(settings.WORKER)["torch_build_dir"]
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "smddp"


def build_name() -> str:
    """The module's name: one per source, header, torch (version and C++ ABI), Python and machine."""
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        (HEADERS / "capi.h").read_bytes(),
        torch.__version__.encode(),
        str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(),
        sys.version.encode(),
        platform.machine().encode(),
        " ".join(CFLAGS).encode(),
    ):
        h.update(hashlib.sha256(part).digest())
    return f"smddp_c10d_{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _node_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """One build a node at a time: an flock (let go by the kernel if its holder dies), waited for in
    bounded time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BackendUnavailableError(
                        f"smddp: waited {timeout_s:g}s for another process's build of the C++ torch backend "
                        f"({path} is locked)"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # (lets the lock go)


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cannot_build() -> str:
    """Why this machine cannot build the C++ backend ("" where it can): a compiler and ninja."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "smddp: no C++ compiler to build the C++ torch backend with (install g++, or set CXX)"
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return "smddp: building the C++ torch backend needs ninja (pip install ninja)"
    return ""


def _module_path(name: str) -> Path:
    """Where the build named `name` puts its module (in its own directory under the build root)."""
    return build_root() / name / f"{name}.so"


def _build(name: str, where: Path) -> ModuleType:
    """Compile c10d.cpp into `where` with torch.utils.cpp_extension (its compiler flags and ABI), and
    import it."""
    from torch.utils import cpp_extension

    work = where.with_name(where.name + ".building")
    shutil.rmtree(work, ignore_errors=True)  # a build cut short (its holder died: the lock is ours now)
    work.mkdir(parents=True)
    try:
        module = cpp_extension.load(
            name,
            [str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_include_paths=[str(HEADERS)],
            build_directory=str(work),
            verbose=False,
        )
    except Exception as e:
        raise BackendUnavailableError(
            f"smddp: building the C++ torch backend failed: {str(e)[-3000:]}"
        ) from e
    shutil.rmtree(where, ignore_errors=True)
    os.replace(work, where)  # complete, or absent: never half there (the loaded copy stays mapped)
    return module


class _Loader:
    """The module, once a process: loaded from its build, built first where there is none."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.module: ModuleType | None = None
        self.error: BackendUnavailableError | None = None
        self.warned = False
        self.prebuilt_lock = threading.Lock()  # (its own: get() holds self.lock while it asks)
        self.prebuilt_tried = False
        self.prebuilt_module: ModuleType | None = None

    def get(self) -> ModuleType:
        with self.lock:
            if self.module is not None:
                return self.module
            if self.error is not None:
                raise self.error
            try:
                self.module = self._load()
            except BackendUnavailableError as e:
                self.error = e
                raise
            return self.module

    def prebuilt(self) -> ModuleType | None:
        """The wheel's module for this torch, loaded (once: a module is imported once a process); None
        where there is none or it does not load (warned once)."""
        with self.prebuilt_lock:
            if self.prebuilt_tried:
                return self.prebuilt_module
            self.prebuilt_tried = True
            pre = prebuilt_path()
            if pre.exists():
                try:
                    self.prebuilt_module = _import(pre.stem, pre)
                except ImportError as e:
                    # (a torch patch release that changed its C++ ABI: a build is made for it instead)
                    log.warning("smddp: the prebuilt C++ torch backend %s does not load here (%s)", pre, e)
            return self.prebuilt_module

    def _load(self) -> ModuleType:
        pre = self.prebuilt()
        if pre is not None:
            return pre
        name = build_name()
        so = _module_path(name)
        where, root = so.parent, so.parent.parent
        if not so.exists():
            t0 = time.monotonic()
            with _node_lock(root / f"{name}.lock", BUILD_TIMEOUT_S):
                if not so.exists():  # (another rank of the node built it while this one waited)
                    cannot = cannot_build()
                    if cannot:
                        raise BackendUnavailableError(cannot)
                    # (a warning: a compile holds the job up for tens of seconds, and nothing else says why)
                    log.warning("smddp: building the C++ torch backend in %s, once a node", where)
                    module = _build(name, where)
                    log.warning("smddp: built the C++ torch backend in %.1fs", time.monotonic() - t0)
                    return module
        try:
            return _import(name, so)
        except ImportError as e:
            raise BackendUnavailableError(f"smddp: the C++ torch backend at {so} does not load: {e}") from e


_loader = _Loader()


def module() -> ModuleType:
    """The C++ backend's module (built here first where needed); BackendUnavailableError says why not."""
    return _loader.get()


def backend_kind() -> str:
    """Which backend a new smddp group gets in this process: "native" (the C++ c10d backend) or
    "python" (the Python ProcessGroup), as SMDDP_TORCH_BACKEND says (auto: native where it loads or
    builds, else python, with one warning that says why)."""
    asked = settings.from_env(settings.WORKER)["torch_backend"]
    if asked == "python":
        return "python"
    if asked == "native":
        module()  # raises, naming why
        return "native"
    try:
        module()
    except BackendUnavailableError as e:
        with _loader.lock:
            first = not _loader.warned
            _loader.warned = True
        if first:
            log.warning("smddp: torch groups use the Python backend: %s", e)
        return "python"
    return "native"


def wrap(
    group: Any, rank: int, size: int, timeout_s: float, direct: bool, doubles: dict[str, int] | None = None
) -> Any:
    """The C++ backend over the client's C table, taking `group` (a ProcessGroupSmddp of every rank)
    for every call it does not run itself. `direct`: host tensors may go straight to the table.
    `doubles`: a runtime's native doubles of torch's CUDA calls (function addresses), under which
    host tensors take the device route (smddp's stand-in: StandinRuntime.torch_native)."""
    c = smddp.client()
    return module().Backend(
        c.native_api(),
        group,
        rank,
        size,
        int(timeout_s * 1000),
        direct,
        CollectiveTimeoutError.PREFIX,
        c.piece_bytes,
        doubles or {},
    )


def report(build: bool) -> dict[str, Any]:
    """What `smddp torch-backend` says: this torch, where its C++ backend is (built first, once a node,
    when `build`: for an image or a shared file system, so that no job compiles), and which backend a
    new smddp group gets here and why. `error` is set where `build` could not."""
    asked = settings.from_env(settings.WORKER)["torch_backend"]
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": platform.python_version(),
        "asked": asked,
        "module": None,
        "error": "",
    }
    if build:
        try:
            module()
        except BackendUnavailableError as e:
            out["error"] = str(e)
    path = _module_path(build_name())
    pre = prebuilt_path()
    so = pre if _loader.prebuilt() is not None else path if path.exists() else None
    out["build_dir"], out["module"] = str(path.parent), str(so) if so is not None else None
    out["prebuilt"] = so == pre
    cannot = cannot_build()
    if asked == "python":
        out["group_gets"], out["why"] = "python", "SMDDP_TORCH_BACKEND=python"
    elif so == pre:
        out["group_gets"], out["why"] = "native", f"prebuilt for torch {torch_minor(torch.__version__)}"
    elif so is not None:
        out["group_gets"], out["why"] = "native", "its build is here"
    elif not cannot:
        out["group_gets"], out["why"] = "native", "a group's first use builds it (once a node)"
    elif asked == "native":
        out["group_gets"], out["why"] = (
            "none",
            f"SMDDP_TORCH_BACKEND=native, and {cannot.removeprefix('smddp: ')}",
        )
    else:
        out["group_gets"], out["why"] = "python", cannot.removeprefix("smddp: ")
    return out
