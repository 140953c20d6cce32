"""The examples' shared data: scikit-learn's bundled handwritten digits (no download), split the same way on every rank."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset


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
