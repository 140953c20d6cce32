"""Worker script: trains small models with stock DDP in every mode; saves the final parameters per rank."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import smddp
import smddp.torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Net(nn.Module):
    """An MLP with BatchNorm (buffers DDP broadcasts) and a branch used only when `use_extra`."""

    def __init__(self, use_extra: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 64)
        self.extra = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)
        self.use_extra = use_extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.fc1(x)))
        h = torch.relu(self.fc2(h))
        if self.use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def batch(rank: int, step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g).to(dtype)
    y = torch.randint(0, 4, (8,), generator=g)
    return x, y


def train(mode: str, dtype: torch.dtype, steps: int, backend: str, rank: int) -> dict[str, Any]:
    torch.manual_seed(1234 + rank)  # different initial weights on every rank: DDP must broadcast rank 0's
    model = Net(use_extra=mode != "unused").to(dtype)
    kw: dict[str, Any] = {"bucket_cap_mb": 0.005}  # ~1300 float32: several buckets in flight per step
    if mode == "bucket_view":
        kw["gradient_as_bucket_view"] = True
    elif mode == "unused":
        kw["find_unused_parameters"] = True
    elif mode == "static":
        kw["static_graph"] = True
    elif mode == "compiled":
        # torch.compile splits the graph at DDP's buckets (Dynamo's DDPOptimizer), which refuses buckets
        # under its first one's 1 MiB: this model's 39 KiB of gradients go as one bucket.
        kw["bucket_cap_mb"] = 1
    ddp: nn.Module
    if mode == "smddp_ddp":
        # On a gloo default group this makes an smddp group with new_group(backend="smddp").
        ddp = smddp.torch.DistributedDataParallel(model)
    else:
        ddp = DDP(model, **kw)
    if mode == "compiled":
        ddp = torch.compile(ddp, backend="aot_eager")  # type: ignore[assignment]
    if mode == "hook":
        # On gloo: DDP's group stays gloo, the gradients are averaged by smddp.
        ddp.register_comm_hook(None, smddp.torch.allreduce_hook)  # type: ignore[operator]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        if mode == "no_sync":
            with ddp.no_sync():  # type: ignore[operator]
                x, y = batch(rank, 100 + step, dtype)
                nn.functional.cross_entropy(ddp(x).float(), y).backward()
        x, y = batch(rank, step, dtype)
        loss = nn.functional.cross_entropy(ddp(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    group = ddp.process_group  # type: ignore[union-attr]
    # (dist.get_backend: a C++ backend torch does not know by type is "custom" to group.name())
    return {"params": params, "buffers": buffers, "losses": losses, "group": dist.get_backend(group)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", choices=["smddp", "gloo"], required=True)
    ap.add_argument("--modes", default="default,bucket_view,unused,static,no_sync,compiled,hook,smddp_ddp")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--no-init",
        action="store_true",
        help="leave smddp.init() to the backend (under torchrun, init_process_group('smddp') starts smddp)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.no_init:
        smddp.init()  # joins the smddp job in both cases (the launcher's daemons wait for every worker)
    dist.init_process_group(backend=args.backend)
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for dt in args.dtypes.split(","):
        for mode in args.modes.split(","):
            results[f"{mode}/{dt}"] = train(mode, DTYPES[dt], args.steps, args.backend, rank)
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
