"""What the torch examples share: the digits (scikit-learn's bundled set, no download), the device, the reports."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


def digits() -> tuple[TensorDataset, TensorDataset]:
    """(train, test): 1400 and 397 flattened 8x8 images scaled to [0, 1], with their labels."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1400], perm[1400:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def device_for(local_rank: int) -> torch.device:
    """This worker's GPU where there are GPUs (one per local rank), else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def accuracy(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> torch.Tensor:
    """(correct, seen) of this rank's part of the test set, to all-reduce."""
    correct = torch.zeros(2, dtype=torch.int64, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            correct += torch.tensor([int((model(x).argmax(1) == y).sum()), len(y)], device=device)
    return correct


def report_epoch(epoch: int, total: torch.Tensor, correct: torch.Tensor, t0: float) -> None:
    """Sum (loss sum, samples) and (correct, seen) over the ranks; rank 0 prints the epoch's line."""
    dist.all_reduce(total)
    dist.all_reduce(correct)
    if dist.get_rank() == 0:
        print(
            f"epoch {epoch}: loss {total[0] / total[1]:.4f}  "
            f"test accuracy {int(correct[0]) / int(correct[1]):.4f}  time {time.perf_counter() - t0:.2f} s"
        )


def check_replicas(flat: torch.Tensor, save_dir: str = "") -> None:
    """All-gather every rank's flattened parameters; rank 0 says whether they are the same bits.
    `save_dir`: each rank also writes its bytes to save_dir/rank<r>.bin, to be compared without the
    collectives under test (tests/replicas.py)."""
    if save_dir:
        Path(save_dir, f"rank{dist.get_rank()}.bin").write_bytes(
            flat.detach().cpu().contiguous().numpy().tobytes()
        )
    world = dist.get_world_size()
    rows = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(rows, flat)
    if dist.get_rank() == 0:
        agree = all(torch.equal(r, flat) for r in rows)
        print(f"replicas agree bit for bit: {agree} ({flat.numel()} parameters, {world} workers)")
