"""Worker script: stock DDP with device_ids on CUDA (or on CPU: the stand-in's device route, or the host) over smddp or gloo.

`--model small` is the CPU DDP tests' model with tiny buckets; `--model mlp` is issue 28's: an MLP
of `--depth` square layers of `--width` (2048 x 6: 25.2 M parameters), batch 64 per rank, with
25 MB buckets and 4 MiB-or-less ones. Each mode is `name[:bucket_mb]`; the parameters, gradients
and losses of every rank are saved for the test to compare across ranks and against gloo.
"""

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
from smddp.bench.ddp_worker import _mlp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "torch"))
from check_ddp import Net, batch  # the model and data of the CPU DDP tests


def mlp_batch(rank: int, step: int, width: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, width, generator=g), torch.randint(0, width, (n,), generator=g)


def train(args: argparse.Namespace, spec: str, device: torch.device, rank: int) -> dict[str, Any]:
    mode, _, cap = spec.partition(":")
    torch.manual_seed(1234 + rank)  # different initial weights on every rank: DDP broadcasts rank 0's
    # The mlp: `depth` square layers of `width` (smddp-bench ddp's MLP, `width` inputs and classes).
    big = args.model == "mlp"
    model = (_mlp(torch, args.width, args.depth - 2, args.width, args.width) if big else Net()).to(device)
    kw: dict[str, Any] = {"bucket_cap_mb": float(cap) if cap else 0.005}  # small: several buckets per step
    if mode == "bucket_view":
        kw["gradient_as_bucket_view"] = True
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, **kw)
    if mode == "hook":
        ddp.register_comm_hook(None, smddp.torch.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05 if args.model == "small" else 0.01, momentum=0.9)
    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        if args.model == "small":
            x, y = batch(rank, step, torch.float32)
        else:
            x, y = mlp_batch(rank, step, args.width, args.batch)
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
    ap.add_argument("--backend", choices=["smddp", "gloo"], default="smddp")
    ap.add_argument("--model", choices=["small", "mlp"], default="small")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--modes", default="default,bucket_view,hook", help="name[:bucket_mb],...")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if args.device == "cuda":
        os.environ["SMDDP_DEVICE_RUNTIME"] = "cupy"
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # compare with the CPU run at float32 precision
    smddp.init()  # joins the smddp job for gloo too: the hook mode averages with smddp
    dist.init_process_group(backend=args.backend)
    rank = dist.get_rank()
    if args.device == "cuda":
        device = torch.device("cuda", smddp.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    results = {spec: train(args, spec, device, rank) for spec in args.modes.split(",")}
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
