"""Worker script: rank 1 leaves with status 3 in the middle of the job; the others are waiting in a barrier."""

from __future__ import annotations

import os
import sys

import smddp

smddp.init()
smddp.barrier(timeout=60)  # every rank is connected and registered with its daemon
if smddp.rank() == 1:
    os._exit(3)
try:
    smddp.barrier(timeout=60)
except smddp.errors.PeerLostError as e:
    print(f"rank {smddp.rank()} saw: {e}", flush=True)
    sys.exit(1)
