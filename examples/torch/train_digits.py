"""Data-parallel training of a digit classifier with stock PyTorch DDP on the smddp backend.

    smddp-launch -np 4 --local-nodes 2 -- python examples/torch/train_digits.py
    torchrun --nproc-per-node 4 examples/torch/train_digits.py      (the same, without mpirun)

The data set is scikit-learn's bundled handwritten digits (1797 8x8 images, no download). The only
smddp-specific lines are `import smddp.torch` and `backend="smddp"`.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from _digits import accuracy, check_replicas, report_epoch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import smddp.torch  # noqa: F401  (registers torch.distributed backend "smddp")


def datasets() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # same split on every rank
    train, test = perm[:1400], perm[1400:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--save-params", default="", help="each rank writes its final parameters to DIR/rank<r>.bin"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend="smddp")  # RANK, WORLD_SIZE, ... come from smddp-launch or torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, test_set = datasets()
    torch.manual_seed(rank)  # different initial weights per rank: DDP broadcasts rank 0's
    net = DDP(model())
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train = DataLoader(train_set, batch_size=args.batch, sampler=sampler)
    test = DataLoader(
        test_set, batch_size=256, sampler=DistributedSampler(test_set, world, rank, shuffle=False)
    )
    n_params = sum(p.numel() for p in net.parameters())
    if rank == 0:
        print(f"training {n_params} parameters on {world} workers, global batch {args.batch * world}")
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        net.train()
        total = torch.zeros(2, dtype=torch.float64)  # loss sum, samples
        for x, y in train:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()  # DDP all-reduces gradient buckets on smddp while backward runs
            opt.step()
            total += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
        net.eval()  # BatchNorm: running statistics for the test
        report_epoch(epoch, total, accuracy(net, test, torch.device("cpu")), t0)
    check_replicas(torch.cat([p.detach().reshape(-1) for p in net.parameters()]), args.save_params)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
