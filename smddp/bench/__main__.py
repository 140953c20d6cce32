"""python -m smddp.bench: the same as smddp-bench."""

import sys

from smddp.bench.cli import main

sys.exit(main())
