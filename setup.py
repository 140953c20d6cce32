"""Build hook for the compiled parts: the 16-bit reduction kernel and the simulated cluster's delay line (metadata lives in pyproject.toml)."""

import sys

from setuptools import Extension, setup

# optional=True: without a C compiler the install still succeeds and the daemon uses its numpy path
# (smddp.daemon.kernels says which one it runs; CI asserts the compiled one is there).
extensions = [
    Extension(
        "smddp.daemon._reduce16",
        ["smddp/daemon/_reduce16.c"],
        extra_compile_args=["-O3", "-fno-fast-math"],
        optional=True,
    )
]
# The delay line (ClusterConfig.delay_ms) speaks Linux's AF_PACKET; without it SimCluster still works,
# only a cluster with added delay refuses to start (and CI fails the tests that need it).
if sys.platform.startswith("linux"):
    extensions.append(
        Extension(
            "smddp.launcher._delayline",
            ["smddp/launcher/_delayline.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
            optional=True,
        )
    )
setup(ext_modules=extensions)
