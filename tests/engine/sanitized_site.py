"""The sitecustomize of a sanitized job (tests/engine/sanitized_jobs.sh): smddp from the sanitized copy, in every Python process."""

# Imported here, at interpreter start, before anything can put the checkout ahead of PYTHONPATH:
# `python -m` puts the working directory first, and pytest its rootdir (tests/ is a package), and in
# the checkout smddp/ holds the engine built without a sanitizer. That is how the in-process tests of
# the sanitized jobs ran the plain engine beside a sanitized stand-in driver, whose threads then
# "raced" across the engine's unseen ordering. Once imported, every later `import smddp...` finds it
# in sys.modules, and its submodules come from its own directory.
import os
import sys

import smddp

_here = os.path.dirname(os.path.abspath(__file__))
if not os.path.abspath(smddp.__file__).startswith(_here + os.sep):
    sys.exit(f"sanitized job: smddp imported from {smddp.__file__}, not from {_here}")
