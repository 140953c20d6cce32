"""DeepSpeed ZeRO (stage 3 by default) on the smddp backend.

    smddp-launch -np 4 --local-nodes 2 -- python examples/torch/train_deepspeed.py

`deepspeed.init_distributed(dist_backend="smddp")` puts DeepSpeed's collectives (ZeRO's parameter
all-gathers and gradient reduce-scatters) on smddp; DeepSpeed reads RANK, LOCAL_RANK and its MPI
discovery variables from smddp-launch, which agree (docs/launching.md). The same script runs on
GPUs (DeepSpeed picks CUDA) and on CPUs (DeepSpeed's CPU accelerator).
"""

from __future__ import annotations

import argparse
import time

import deepspeed
import torch
import torch.distributed as dist
from _digits import accuracy, check_replicas, digits, report_epoch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import smddp.torch  # noqa: F401  (registers torch.distributed backend "smddp")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="per worker")
    ap.add_argument("--stage", type=int, default=3, choices=[1, 2, 3], help="ZeRO stage")
    args = ap.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="smddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, test_set = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.005}},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    device = engine.device
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train = DataLoader(train_set, batch_size=args.batch, sampler=sampler, drop_last=True)
    test = DataLoader(
        test_set, batch_size=256, sampler=DistributedSampler(test_set, world, rank, shuffle=False)
    )
    if rank == 0:
        print(f"ZeRO stage {args.stage} on {world} workers ({device}), global batch {args.batch * world}")
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for x, y in train:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64, device=device)
        report_epoch(epoch, total, accuracy(engine, test, device), t0)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        flat = torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])
    check_replicas(flat)


if __name__ == "__main__":
    main()
