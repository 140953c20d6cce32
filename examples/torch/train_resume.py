"""Training that survives restarts: a checkpoint every K steps, and a restarted job resumes from the last.

    smddp-launch -np 4 --local-nodes 2 --max-restarts 3 -- \\
        python examples/torch/train_resume.py --steps 2000 --ckpt-every 100 --ckpt-dir /tmp/ckpt

When a rank or a node dies, smddp-launch tears the job down and starts it again (a fresh job,
SMDDP_RESTART_COUNT and torchrun's TORCHELASTIC_RESTART_COUNT one higher); this script then loads the
newest complete checkpoint (model, optimizer, step) and goes on from there. Every step's batch is a
function of the step alone, so a resumed run computes exactly what an uninterrupted one would: with
the same world size its final parameters are the same to the bit (smddp's sums are deterministic).
"""

from __future__ import annotations

import argparse
import os
import re

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import smddp.torch  # noqa: F401  (registers torch.distributed backend "smddp")

CKPT = re.compile(r"ckpt-(\d+)\.pt$")


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint (they are renamed into place whole)."""
    found = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := CKPT.match(name))]
    return os.path.join(directory, max(found)[1]) if found else None


def save_checkpoint(directory: str, step: int, net: nn.Module, opt: torch.optim.Optimizer) -> None:
    tmp = os.path.join(directory, f".ckpt-{step:06d}.tmp")
    torch.save({"step": step, "model": net.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, os.path.join(directory, f"ckpt-{step:06d}.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--batch", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--save", default="", help="write the final parameters here (rank 0)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend="smddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    start = 0
    path = latest_checkpoint(args.ckpt_dir)
    if path is not None:
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    if rank == 0:
        print(f"attempt {attempt}: {world} workers, starting at step {start} of {args.steps}", flush=True)
    net = DDP(model)
    for step in range(start, args.steps):
        # The batch of a step depends on the step alone: a resumed run sees what an uninterrupted one did.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(step))
        idx = order[rank * args.batch : (rank + 1) * args.batch]
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
        done = step + 1
        if done % args.ckpt_every == 0 and rank == 0:
            save_checkpoint(args.ckpt_dir, done, model, opt)
    if rank == 0:
        if args.save:
            torch.save(model.state_dict(), args.save)
        print(f"attempt {attempt}: trained to step {args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
