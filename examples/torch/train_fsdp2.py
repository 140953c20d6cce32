"""Sharded data-parallel training with PyTorch FSDP2 (`fully_shard`) on the smddp backend.

    smddp-launch -np 4 --local-nodes 2 -- python examples/torch/train_fsdp2.py

Parameters, gradients and optimizer state are sharded over the workers; every step all-gathers
each layer's parameters and reduce-scatters its gradients on smddp. The same script runs on GPUs
(one per local rank) and on CPUs. The smddp-specific lines: `import smddp.torch`, `backend="smddp"`.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from _digits import accuracy, check_replicas, device_for, digits, report_epoch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

import smddp.torch  # noqa: F401  (registers torch.distributed backend "smddp")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend="smddp")  # RANK, WORLD_SIZE, ... come from smddp-launch or torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_for(int(os.environ["LOCAL_RANK"]))
    train_set, test_set = digits()
    torch.manual_seed(0)  # FSDP shards the model as it is: start from the same weights everywhere
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    model.to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)  # each layer's parameters gathered only while it runs
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr / 10)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train = DataLoader(train_set, batch_size=args.batch, sampler=sampler)
    test = DataLoader(
        test_set, batch_size=256, sampler=DistributedSampler(test_set, world, rank, shuffle=False)
    )
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())  # DTensors: the global sizes; each rank holds 1/world
        print(
            f"training {n} parameters sharded over {world} workers ({device.type}), global batch {args.batch * world}"
        )
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for x, y in train:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # FSDP reduce-scatters the gradients on smddp
            opt.step()
            total += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64, device=device)
        report_epoch(epoch, total, accuracy(model, test, device), t0)
    # The full parameters, gathered from the shards, agree on every rank.
    check_replicas(torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
