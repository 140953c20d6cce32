"""A device copy still running at shutdown: run by test_client_fast.py in a process of its own, since the old way ended in a segfault."""

# Rank 0 (a real client against the scripted daemon, on the stand-in runtime) calls a blocking device
# all-reduce on a stream whose kernel ahead of it is held: the call times out with its copy-in, in
# line on that stream, still waiting. Its shutdown must not unpin and unmap the slot that copy will
# write: it fails (no BYE) naming the copy, and once the kernel ends, the copy lands in memory still
# mapped. Unmapped under it, the copy would write into memory that is gone (SIGSEGV).

from __future__ import annotations

import sys

import numpy as np
from smddp_rigs.standin import StandinRuntime

from smddp.client import collectives
from smddp.errors import CollectiveTimeoutError, DeviceError
from smddp.proto import ReduceOp
from tests.unit.lonely import lonely_client
from tests.unit.test_client_release import ScriptedDaemon


def main() -> int:
    client, theirs = lonely_client()
    daemon = ScriptedDaemon(theirs)
    rt = StandinRuntime()
    client._start_device(rt)
    s = rt.new_stream(0)
    x = rt.asarray(np.ones(1 << 16, np.float32))
    gate = rt.hold(s)  # the caller's kernel, still running
    with rt.use(s):
        try:
            collectives.allreduce(client, x, ReduceOp.SUM, 0.2)
            print("returned")
        except CollectiveTimeoutError:
            print("timed out")
    try:
        client.shutdown(timeout=0.5)
        print("shut down")
    except DeviceError as e:
        print(f"shutdown: {e}")
    gate.set()
    rt.stream_synchronize(s)  # the copy-in runs now
    print("alive", flush=True)
    daemon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
