"""Build hook for the compiled part, the engine (C++17, required; metadata lives in pyproject.toml)."""

import concurrent.futures
import glob
import os
import shutil
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Warnings are errors in the engine: what the compiler doubts, the wire will find.
# -g0: no debug information (Python's CFLAGS bring -g): the engine shipped is 1.8 MB instead of 22, and
# builds about a quarter faster; the sanitized builds (Makefile) keep theirs.
ENGINE_FLAGS = ["-std=c++17", "-O3", "-g0", "-Wall", "-Wextra", "-Wshadow", "-Werror", "-fvisibility=hidden"]
# The C++ runtime goes into the extension itself: the wheel then needs only glibc's old symbols
# (auditwheel tags it manylinux), not the libstdc++ of the machine that built it.
LINK_FLAGS = ["-static-libstdc++", "-static-libgcc"]
# The bindings are nanobind's (module.cc), which keeps to the stable ABI from CPython 3.12 on: one
# cp312-abi3 wheel serves 3.12 and every later CPython; 3.10 and 3.11 get a wheel each.
LIMITED_API = sys.version_info >= (3, 12) and not os.environ.get("SMDDP_NO_LIMITED_API")


def _nanobind() -> tuple[str, list[str]]:
    """nanobind's headers and its own sources (compiled into the extension, as its CMake build does):
    the build requirement pyproject.toml pins."""
    import nanobind

    src = nanobind.source_dir()
    names = ("nb_internals", "nb_func", "nb_type", "nb_enum", "nb_ndarray", "nb_static_property", "nb_ft",
             "common", "error", "trampoline", "implicit")  # fmt: skip
    return nanobind.include_dir(), [os.path.join(src, f"{n}.cpp") for n in names]


NB_INCLUDE, NB_SOURCES = _nanobind()
NB_ROOT = os.path.dirname(NB_INCLUDE)
# nanobind's sources are its own, not held to the engine's warnings: compiled with its flags (its
# CMake build's: no strict aliasing, compact assertions), and its headers seen as system headers.
NB_FLAGS = ["-std=c++17", "-O3", "-g0", "-fvisibility=hidden", "-fno-strict-aliasing", "-DNB_COMPACT_ASSERTIONS",
            "-isystem", NB_INCLUDE]  # fmt: skip


class BuildExt(build_ext):
    """Says exactly what is missing when there is no C++ compiler, instead of a compiler's traceback."""

    def build_extensions(self) -> None:
        # $CXX first, as setuptools itself takes it; then the compiler Python was built with.
        given = os.environ.get("CXX")
        cxx = (given or sysconfig.get_config_var("CXX") or "g++").split()[0]
        if (
            self.compiler.compiler_type == "unix"
            and shutil.which(cxx) is None
            and (given or shutil.which("g++") is None)
        ):
            where = f"{cxx!r} ($CXX)" if given else f"neither {cxx!r} (Python's CXX) nor 'g++'"
            raise SystemExit(
                f"smddp: building from source needs a C++17 compiler for its engine (smddp._engine), and "
                f"{where} is not on PATH. Install one (Debian/Ubuntu: "
                "apt install g++; RHEL: dnf install gcc-c++) or set CXX, or install a built wheel "
                "(pip wheel . on a machine with a compiler), which needs none."
            )
        _compile_in_parallel(self.compiler, self.parallel or os.cpu_count() or 1)
        super().build_extensions()


def _compile_in_parallel(compiler: object, jobs: int) -> None:
    """The engine's sources compiled `jobs` at a time: setuptools' own --parallel runs extensions side
    by side, and the engine is one extension of 18 sources, which it compiles one after another."""

    # The same steps as CCompiler.compile (distutils), the per-object calls on a thread pool.
    def compile(
        sources, output_dir=None, macros=None, include_dirs=None, debug=False,
        extra_preargs=None, extra_postargs=None, depends=None,
    ):  # fmt: skip
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(  # type: ignore[attr-defined]
            output_dir, macros, include_dirs, sources, depends, extra_postargs
        )
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)  # type: ignore[attr-defined]

        def one(obj: str) -> None:
            src, ext = build[obj]
            post = NB_FLAGS if src.startswith(NB_ROOT) else extra_postargs
            compiler._compile(obj, src, ext, cc_args, post, pp_opts)  # type: ignore[attr-defined]

        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            for _ in pool.map(one, build):  # the first failure raises here
                pass
        return objects

    compiler.compile = compile  # type: ignore[attr-defined]


extensions = [
    Extension(
        "smddp._engine",
        [
            "smddp/engine/frame.cc",
            "smddp/engine/layout.cc",
            "smddp/engine/reduce16.cc",
            "smddp/engine/reduce.cc",
            "smddp/engine/collective.cc",
            "smddp/engine/node_state.cc",
            "smddp/engine/arena.cc",
            "smddp/engine/fdpass.cc",
            "smddp/engine/ring.cc",
            "smddp/engine/tcp_fabric.cc",
            "smddp/engine/ofi_fabric.cc",
            "smddp/engine/ofi_wire.cc",
            "smddp/engine/channel.cc",
            "smddp/engine/executor.cc",
            "smddp/engine/exchange.cc",
            "smddp/engine/worker_port.cc",
            "smddp/engine/local_plane.cc",
            "smddp/engine/cuda_driver.cc",
            "smddp/engine/device_watch.cc",
            "smddp/engine/device_path.cc",
            "smddp/engine/device_step.cc",
            "smddp/engine/native_api.cc",
            "smddp/engine/module.cc",
            *NB_SOURCES,
        ],
        include_dirs=[os.path.join(NB_ROOT, "ext", "robin_map", "include")],
        # Headers too: a changed one (wire.h, generated) rebuilds the engine.
        depends=sorted(glob.glob("smddp/engine/*.h")),
        language="c++",
        extra_compile_args=[*ENGINE_FLAGS, "-isystem", NB_INCLUDE, "-DNB_COMPACT_ASSERTIONS"],
        extra_link_args=LINK_FLAGS,
        define_macros=[("Py_LIMITED_API", "0x030C0000")] if LIMITED_API else [],
        py_limited_api=LIMITED_API,
    ),
]
setup(
    ext_modules=extensions,
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp312"}} if LIMITED_API else {},
)
