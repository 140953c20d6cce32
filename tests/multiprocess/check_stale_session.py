"""Run in a fresh pid namespace (as the test starts it), with TMPDIR a directory of the test's own: that
directory full of the session directories killed mpiruns left, one for every pid this namespace will
give out, then the launches; prints what each did, as JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

bin_dir = sys.argv[1]
tmp = os.environ["TMPDIR"]  # where Open MPI puts its session directories, and smddp-launch its own
names = {socket.gethostname(), socket.gethostname().split(".")[0]}
# Pids here start at 1: each gets what a killed mpirun of that pid leaves, its PMIx rendezvous files.
for pid in range(1, 3000):
    os.mkdir(f"{tmp}/ompi.{pid}")
    for name in names:
        with open(f"{tmp}/ompi.{pid}/pmix.{name}.tool", "w") as f:
            f.write("tcp4://127.0.0.1:1\n")
planted = sorted(os.listdir(tmp))
root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
worker = (
    "import numpy as np, smddp; smddp.init(); x = np.full(8, smddp.rank() + 1.0, np.float32);"
    "smddp.allreduce(x, timeout=60); print('SUM', x[0], flush=True); smddp.shutdown()"
)


def run(cmd: list[str]) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=os.environ)
    return {"rc": p.returncode, "out": p.stdout + p.stderr}


shared = f"--prtemca prte_local_tmpdir_base {tmp}"
# The launcher told to use the shared TMPDIR after all (as before this change) meets the files.
record = {
    "plain": run([f"{bin_dir}/mpirun", *root, "-np", "1", "true"]),
    "launch_shared": run(
        [f"{bin_dir}/smddp-launch", "-np", "2", "--mpi-args", shared, "--", sys.executable, "-c", worker]
    ),
}
# A base a SIGKILLed launcher left (its pid gone) is swept; a live launcher's is not.
gone = subprocess.Popen(["true"])
gone.wait()
os.mkdir(os.path.join(tmp, f"smddp-prte-{gone.pid}-gone"))
live = f"smddp-prte-{os.getpid()}-live"
os.mkdir(os.path.join(tmp, live))
# (An mpirun that fails to start removes its session directory: the planted one of its pid.)
before = set(os.listdir(tmp))
record |= {
    "launch": run(
        [f"{bin_dir}/smddp-launch", "-np", "4", "--local-nodes", "2", "--", sys.executable, "-c", worker]
    ),
}
# The daemons' socket directories' parent (smddp-<uid>) stays, empty, as it does in /tmp.
sockets = f"smddp-{os.getuid()}"
record["live_kept"] = os.path.isdir(os.path.join(tmp, live))
os.rmdir(os.path.join(tmp, live))
record["left"] = sorted(set(os.listdir(tmp)) - {*planted, sockets})
record["removed"] = sorted(before - set(os.listdir(tmp)) - {live})
record["gone"] = f"smddp-prte-{gone.pid}-gone"
record["left"] += os.listdir(os.path.join(tmp, sockets)) if os.path.isdir(os.path.join(tmp, sockets)) else []
print(json.dumps(record))
