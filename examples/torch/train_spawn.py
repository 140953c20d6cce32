"""Stock DDP on the smddp backend with no launcher at all: PyTorch's own tutorial pattern, mp.spawn.

    python examples/torch/train_spawn.py --world 2

The script starts its own processes (`torch.multiprocessing.spawn`), sets MASTER_ADDR and
MASTER_PORT itself and calls `init_process_group("smddp", rank=rank, world_size=world)` in each: the
ranks find each other through torch's store, the ranks on this host form one node, and the first of
them starts the node's smddp-daemon. `--backend gloo` runs the same training on gloo; `--save DIR`
writes each rank's parameters to DIR/rank<r>.pt (tests/torch/test_spawn.py compares the two).
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _digits import accuracy, digits, report_epoch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import smddp.torch  # noqa: F401  (registers torch.distributed backend "smddp")


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, rank=rank, world_size=world)  # env://: MASTER_ADDR, MASTER_PORT
    train_set, test_set = digits()
    torch.manual_seed(rank)  # different initial weights per rank: DDP broadcasts rank 0's
    net = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler)
    test = DataLoader(
        test_set, batch_size=256, sampler=DistributedSampler(test_set, world, rank, shuffle=False)
    )
    if rank == 0:
        n = sum(p.numel() for p in net.parameters())
        print(f"training {n} parameters on {world} spawned workers, backend {args.backend}", flush=True)
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
        report_epoch(epoch, total, accuracy(net, test, torch.device("cpu")), t0)
    if args.save:
        torch.save(
            {k: v.detach().clone() for k, v in net.module.state_dict().items()},
            Path(args.save) / f"rank{rank}.pt",
        )
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2, help="processes to spawn")
    ap.add_argument("--backend", default="smddp")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--save", default="", help="a directory for each rank's final parameters")
    args = ap.parse_args()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(train, args=(args.world, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
