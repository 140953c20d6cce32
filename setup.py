"""Build hook for the compiled part, the engine (C++17, required; metadata lives in pyproject.toml)."""

import shutil
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Warnings are errors in the engine: what the compiler doubts, the wire will find.
ENGINE_FLAGS = ["-std=c++17", "-O3", "-Wall", "-Wextra", "-Wshadow", "-Werror", "-fvisibility=hidden"]


class BuildExt(build_ext):
    """Says exactly what is missing when there is no C++ compiler, instead of a compiler's traceback."""

    def build_extensions(self) -> None:
        cxx = (sysconfig.get_config_var("CXX") or "g++").split()[0]
        if (
            self.compiler.compiler_type == "unix"
            and shutil.which(cxx) is None
            and shutil.which("g++") is None
        ):
            raise SystemExit(
                f"smddp: building from source needs a C++17 compiler for its engine (smddp._engine), and "
                f"neither {cxx!r} (Python's CXX) nor 'g++' is on PATH. Install one (Debian/Ubuntu: "
                "apt install g++; RHEL: dnf install gcc-c++) or set CXX, or install a built wheel "
                "(pip wheel . on a machine with a compiler), which needs none."
            )
        super().build_extensions()


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
            "smddp/engine/ring.cc",
            "smddp/engine/tcp_fabric.cc",
            "smddp/engine/ofi_fabric.cc",
            "smddp/engine/ofi_wire.cc",
            "smddp/engine/channel.cc",
            "smddp/engine/local_plane.cc",
            "smddp/engine/module.cc",
        ],
        language="c++",
        extra_compile_args=ENGINE_FLAGS,
    ),
]
setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})
