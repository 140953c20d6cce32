"""Worker script: FSDP2 (fully_shard), FSDP1, DeviceMesh/DTensor and functional collectives on one backend; saves every result."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn

import smddp.torch  # noqa: F401  (registers the "smddp" backend)


def model() -> nn.Module:
    torch.manual_seed(7)  # the same initial weights everywhere: FSDP does not broadcast them
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, 12, generator=torch.Generator().manual_seed(100 * step + rank))


def train(wrapped: nn.Module, rank: int, steps: int) -> list[float]:
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = wrapped(batch(rank, step)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fsdp2(rank: int, steps: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    m = model()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    losses = train(m, rank, steps)
    full = {k: v.full_tensor().detach().clone() for k, v in m.state_dict().items()}
    return {"losses": losses, "params": full}


def fsdp1(rank: int, steps: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    m = FSDP(model(), use_orig_params=True, device_id=torch.device("cpu"))  # CPU: named, not detected
    losses = train(m, rank, steps)
    cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(m, StateDictType.FULL_STATE_DICT, cfg):
        full = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return {"losses": losses, "params": full}


def functional(rank: int, world: int) -> dict[str, Any]:
    """Functional collectives by group name, DeviceMesh and DTensor redistribution, and a compiled collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    group = dist.group.WORLD
    assert group is not None
    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    out: dict[str, Any] = {
        "name": group.group_name,
        "all_reduce": fc.all_reduce(x, "sum", group).wait(),
        "all_gather": fc.all_gather_single(x, 0, group).wait(),
        "reduce_scatter": fc.reduce_scatter_single(
            torch.arange(2 * world, dtype=torch.float32) + rank, "sum", 0, group
        ).wait(),
    }
    mesh = init_device_mesh("cpu", (world,))
    big = torch.arange(4 * world * 3, dtype=torch.float32).reshape(4 * world, 3)
    dt = distribute_tensor(big, mesh, [Shard(0)])
    out["dtensor_local"] = dt.to_local().clone()
    out["dtensor_full"] = dt.redistribute(mesh, [Replicate()]).to_local().clone()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def compiled(t: torch.Tensor) -> torch.Tensor:
        return fc.all_reduce(t * 2, "sum", group) + 1

    out["compiled"] = compiled(x)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", choices=["smddp", "gloo"], required=True)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {
        "fsdp2": fsdp2(rank, args.steps),
        "fsdp1": fsdp1(rank, args.steps),
        "functional": functional(rank, world),
    }
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
