"""Build hook for the rigs' one compiled part: the simulated cluster's delay line (Linux AF_PACKET)."""

import sys

from setuptools import Extension, setup

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
setup(ext_modules=extensions)
