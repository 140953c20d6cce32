"""Worker script: a 2-D DeviceMesh on smddp (its dimensions are subgroups, run by the side group) and DTensor over it."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import smddp.torch  # noqa: F401  (registers the "smddp" backend)


def main() -> int:
    dist.init_process_group("smddp")
    r = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    big = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    dt = distribute_tensor(big, mesh, [Shard(0), Shard(1)])
    full = dt.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    rows = dt.redistribute(mesh, [Shard(0), Replicate()]).to_local()
    groups = [mesh.get_group(d) for d in ("dp", "tp")]
    out = {
        "full": torch.equal(full, big),
        "local": list(dt.to_local().shape),
        "rows": torch.equal(rows, big[4 * (r // 2) : 4 * (r // 2) + 4]),
        "backends": [dist.get_backend(g) for g in groups],
        "sizes": [g.size() for g in groups],
        "world_backend": dist.get_backend(),
    }
    with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
