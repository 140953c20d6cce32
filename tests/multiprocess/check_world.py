"""Worker script: the workers' own MPI world beside smddp, and ranks that never join."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=["mpi", "mpi_only", "skip"], required=True)
    ap.add_argument("--skip-rank", type=int, default=1)
    ap.add_argument("--skip-status", type=int, default=0)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    out: dict = {"env": {k: v for k, v in os.environ.items() if k.startswith(("OMPI_COMM_WORLD", "SMDATA"))}}
    path = os.path.join(args.out, f"rank{rank}.json")
    if args.mode in ("mpi", "mpi_only"):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        out["mpi"] = [comm.rank, comm.size, MPI.Get_processor_name()]
        # An MPI all-reduce of the ranks among the workers alone: daemons are not in this world.
        out["mpi_sum"] = comm.allreduce(rank, op=MPI.SUM)
        if args.mode == "mpi":
            import smddp

            smddp.init()
            x = np.arange(8, dtype=np.float64) + rank
            out["smddp"] = [smddp.rank(), smddp.size(), smddp.local_rank(), smddp.local_size()]
            out["smddp_sum"] = smddp.allreduce(x, op=smddp.SUM).tolist()
            mpi = np.empty_like(x)
            comm.Allreduce(np.arange(8, dtype=np.float64) + rank, mpi, op=MPI.SUM)
            out["mpi_vec"] = mpi.tolist()
            comm.Barrier()
            smddp.shutdown()
    else:  # skip: one rank ends without joining while the others wait for it in a collective
        if rank == args.skip_rank:
            with open(path, "w") as f:
                json.dump({"skipped": True}, f)
            return args.skip_status
        import smddp
        from smddp import errors

        smddp.init()
        t0 = time.monotonic()
        try:
            smddp.allreduce(np.ones(16, np.float32))
            out["error"] = None
        except errors.PeerLostError as e:
            out["error"] = str(e)
        out["seconds"] = time.monotonic() - t0
        with open(path, "w") as f:
            json.dump(out, f)
        # 0 either way: a non-zero exit would make mpirun stop the ranks still recording theirs.
        return 0
    with open(path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
