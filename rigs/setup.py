"""Build hook for the rigs' compiled parts: the simulated cluster's delay line (Linux AF_PACKET), and
the engine's test-only bindings (smddp_rigs._engine_testing), which smddp's wheel does not carry."""

import glob
import sys

from setuptools import Extension, setup

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
    extensions.append(
        Extension(
            "smddp_rigs._engine_testing",
            ["smddp_rigs/_engine_testing.cc", *ENGINE_SOURCES],
            include_dirs=[ENGINE],
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
            ],
        )
    )
setup(ext_modules=extensions)
