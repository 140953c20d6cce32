"""Worker script under torchrun with --secret-file: the job's secret is the one derived from the file, and collectives run."""

from __future__ import annotations

import argparse
import json
import os

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
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"derived": job.secret == derived, "sum": x[0].item(), "job": job.job_hex}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
