"""Build hook for the compiled part: the 16-bit reduction kernel (metadata lives in pyproject.toml)."""

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
setup(ext_modules=extensions)
