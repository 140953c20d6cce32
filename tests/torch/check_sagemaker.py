"""Worker script: the two SageMaker import styles, as SageMaker's own examples write them."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torch import nn


def train(model: nn.Module, rank: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().sum().item() for p in model.parameters()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--style", choices=["torch_smddp", "legacy"], required=True)
    args = ap.parse_args()
    out: dict[str, Any] = {"style": args.style}
    if args.style == "torch_smddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401

        dist.init_process_group(backend="smddp")
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.manual_seed(rank)
        model: nn.Module = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3)))
        out["backend"] = dist.get_backend()
    else:
        import smdistributed.dataparallel.torch.distributed as dist  # type: ignore[no-redef]
        from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP

        out["available"] = dist.is_available()
        out["initialized_before"] = dist.is_initialized()
        dist.init_process_group()
        out["initialized_after"] = dist.is_initialized()
        rank, world, local_rank = dist.get_rank(), dist.get_world_size(), dist.get_local_rank()
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        out["all_reduce"] = t.tolist()
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=world - 1)
        out["broadcast"] = b.tolist()
        outs = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(outs, torch.full((1,), float(rank)))
        out["all_gather"] = [o.item() for o in outs]
        dist.barrier()
        torch.manual_seed(rank)
        # SageMaker scripts pass device_ids=[local_rank]; on the CPU the alias drops it.
        model = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3)), device_ids=[local_rank])
    out.update(rank=rank, world=world, local_rank=local_rank, params=train(model, rank))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
