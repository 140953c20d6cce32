"""Worker script (GPU): stock DDP with device_ids=[local_rank] on CUDA, or the same model on CPU, over smddp."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import smddp
import smddp.torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "torch"))
from check_ddp import Net, batch  # the model and data of the CPU DDP tests


def train(mode: str, device: torch.device, rank: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(1234 + rank)  # different initial weights on every rank: DDP broadcasts rank 0's
    model = Net().to(device)
    kw: dict[str, Any] = {"bucket_cap_mb": 0.005}  # several buckets in flight per step
    if mode == "bucket_view":
        kw["gradient_as_bucket_view"] = True
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, **kw)
    if mode == "hook":
        ddp.register_comm_hook(None, smddp.torch.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(rank, step, torch.float32)
        loss = nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()},
        "grads": {
            k: v.grad.detach().cpu().clone() for k, v in model.named_parameters() if v.grad is not None
        },
        "losses": losses,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--modes", default="default,bucket_view,hook")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    os.environ["SMDDP_DEVICE_RUNTIME"] = "cupy"
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # compare with the CPU run at float32 precision
    smddp.init()
    dist.init_process_group(backend="smddp")
    rank = dist.get_rank()
    if args.device == "cuda":
        device = torch.device("cuda", smddp.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    results = {mode: train(mode, device, rank, args.steps) for mode in args.modes.split(",")}
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
