"""Build hook for the rigs' compiled parts: the simulated cluster's delay line (Linux AF_PACKET), and
the engine's test-only bindings (smddp_rigs._engine_testing), which smddp's wheel does not carry."""

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The engine's sources these bindings need, from the smddp tree beside this one (never shipped here).
ENGINE = "../smddp/engine"
ENGINE_SOURCES = [
    f"{ENGINE}/{name}.cc"
    for name in (
        "frame",
        "layout",
        "reduce16",
        "reduce",
        "collective",
        "node_state",
        "arena",
        "fdpass",
        "ring",
        "channel",
    )
]


def _nanobind() -> tuple[str, str]:
    """nanobind's headers and its sources in one file (as smddp's setup.py compiles them, one by one)."""
    import nanobind

    return nanobind.include_dir(), os.path.join(nanobind.source_dir(), "nb_combined.cpp")


NB_INCLUDE, NB_SOURCE = _nanobind()
NB_ROOT = os.path.dirname(NB_INCLUDE)
# nanobind's own sources with its own flags, not the engine's warnings (as smddp's setup.py).
NB_FLAGS = ["-std=c++17", "-O2", "-fvisibility=hidden", "-fno-strict-aliasing", "-DNB_COMPACT_ASSERTIONS",
            "-isystem", NB_INCLUDE]  # fmt: skip


class BuildExt(build_ext):
    """nanobind's source compiled with NB_FLAGS; every other with its extension's flags."""

    def build_extensions(self) -> None:
        one = self.compiler._compile  # type: ignore[attr-defined]

        def compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts):  # type: ignore[no-untyped-def]
            one(obj, src, ext, cc_args, NB_FLAGS if src.startswith(NB_ROOT) else extra_postargs, pp_opts)

        self.compiler._compile = compile_one  # type: ignore[attr-defined]
        # setuptools names an object after its source under the build's directory: ../smddp/engine/x.cc
        # put x.o outside it, in one /tmp/smddp/engine that every `pip install -e rigs/` shared and,
        # being newer than the sources, reused whichever tree had built it. (An absolute source path
        # would stay inside, but setuptools refuses one.)
        names = self.compiler.object_filenames

        def inside(sources, strip_dir=False, output_dir=""):  # type: ignore[no-untyped-def]
            return names([s.replace("../", "parent/") for s in sources], strip_dir, output_dir)

        self.compiler.object_filenames = inside  # type: ignore[method-assign]
        super().build_extensions()


extensions = []
# Not optional: a rig that silently lacks its delay line would fail the delay tests later and vaguer.
if sys.platform.startswith("linux"):
    extensions.append(
        Extension(
            "smddp_rigs._delayline",
            ["smddp_rigs/_delayline.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror", "-Wno-missing-field-initializers"],
        )
    )
    # The stand-in CUDA driver (standin_cuda.cc): no Python module, a library of the driver API's
    # entry points that the stand-in runtime drives through ctypes and the engine loads as it would
    # load libcuda.so.1 (built as an extension so that it installs beside the rigs).
    extensions.append(
        Extension(
            "smddp_rigs._standin_cuda",
            ["smddp_rigs/standin_cuda.cc"],
            include_dirs=[ENGINE],  # fold_args.h: the kernels' argument layout
            depends=[f"{ENGINE}/fold_args.h"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-Wall", "-Wextra", "-Wshadow", "-Werror", "-pthread"],
            extra_link_args=["-pthread"],
        )
    )
    # A front end of the engine's C function table (capi.h) in C, with nothing of smddp linked: what
    # the native c10d backend does with it, for the tests.
    extensions.append(
        Extension(
            "smddp_rigs._capi_probe",
            ["smddp_rigs/_capi_probe.c"],
            include_dirs=[ENGINE],
            depends=[f"{ENGINE}/capi.h"],
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread"],
            extra_link_args=["-pthread"],
        )
    )
    extensions.append(
        Extension(
            "smddp_rigs._engine_testing",
            ["smddp_rigs/_engine_testing.cc", *ENGINE_SOURCES, NB_SOURCE],
            include_dirs=[ENGINE, os.path.join(NB_ROOT, "ext", "robin_map", "include")],
            depends=sorted(glob.glob(f"{ENGINE}/*.h")),
            language="c++",
            # The engine's own flags (smddp's setup.py): warnings are errors here too.
            extra_compile_args=[
                "-std=c++17",
                "-O3",
                "-Wall",
                "-Wextra",
                "-Wshadow",
                "-Werror",
                "-fvisibility=hidden",
                "-isystem",
                NB_INCLUDE,
                "-DNB_COMPACT_ASSERTIONS",
            ],
        )
    )
setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})
