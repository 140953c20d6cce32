"""Worker script: after a collective, which of the job's processes on this host have numpy mapped (its daemons, smddp-launch, itself)."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import smddp


def numpy_mapped(pid: int) -> list[str]:
    """The files of numpy's that process `pid` has mapped (its compiled modules, once imported)."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split()[-1] for line in f if "/numpy/" in line}
    return sorted(paths)


def launcher_pid() -> int:
    """smddp-launch: the first ancestor whose command line names it."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if any(a.endswith(b"smddp-launch") for a in argv[:2]):
            return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise SystemExit("no smddp-launch among this worker's ancestors")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    smddp.init()
    x = np.arange(1024, dtype=np.float32)
    smddp.allreduce(x)  # a collective through the daemons first: what they load serving one counts
    assert np.array_equal(x, np.arange(1024, dtype=np.float32) * smddp.size())
    pids = {f"daemon{d.node}": d.pid for d in smddp.client().job.daemons}
    pids["launcher"] = launcher_pid()
    pids["worker"] = os.getpid()
    out = {name: numpy_mapped(pid) for name, pid in pids.items()}
    smddp.barrier()
    with open(os.path.join(args.out, f"rank{smddp.rank()}.json"), "w") as f:
        json.dump(out, f)
    smddp.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
