"""Worker script under torchrun with --secret-file: the job's secret is the one derived from the file, collectives run, `smddp status` sees the job."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import smddp
import smddp.torch
from smddp.transport.bootstrap import job_secret, read_secret_file


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("smddp")
    x = torch.full((8,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    job = smddp.client().job
    derived = job_secret(read_secret_file(os.environ["SMDDP_SECRET_FILE"]), job.job_id)
    status = ""
    if dist.get_rank() == 0:  # `smddp status` finds a torchrun job as it finds an smddp-launch one
        cmd = [sys.executable, "-m", "smddp.launcher.cli", "status", "--job", job.job_hex, "--json"]
        status = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    dist.barrier()
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(
            {"derived": job.secret == derived, "sum": x[0].item(), "job": job.job_hex, "status": status}, f
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
