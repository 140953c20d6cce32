"""Worker script: rank 1 leaves with status 3 in the middle of the job; the others are waiting in a barrier.

With --slow-cause, rank 1 first starts a grandchild that holds its output open for 3 s, so that its
launcher wrapper (which forwards the output) ends seconds after the survivors': mpirun then sees a
survivor's exit first.
"""

from __future__ import annotations

import os
import subprocess
import sys

import smddp

smddp.init()
smddp.barrier(timeout=60)  # every rank is connected and registered with its daemon
if smddp.rank() == 1:
    if "--slow-cause" in sys.argv:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    os._exit(3)
try:
    smddp.barrier(timeout=60)
except smddp.errors.PeerLostError as e:
    print(f"rank {smddp.rank()} saw: {e} [exit_status={e.exit_status}]", flush=True)
    sys.exit(1)  # a consequence: smddp-launch's wrapper ends this rank with the cause's status, 3
