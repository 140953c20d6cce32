"""Scenarios of the smddp backend with no launcher (mp.spawn, file://, tcp://, a store passed in), each rank's outcome to OUT/rank<r>.json."""

# Run by tests/torch/test_spawn.py: python check_spawn.py OUT SCENARIO WORLD. Each rank writes what it
# computed and what smddp placed it as, or the error its init raised; the test checks them against
# values computed independently (each rank's contribution is rank + 1).

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import smddp
import smddp.torch

TIMEOUT = timedelta(seconds=20)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sum_of_ranks(group: Any = None) -> float:
    t = torch.tensor([float(dist.get_rank() + 1)] * 3)
    dist.all_reduce(t, group=group)
    return float(t[0])


def _placed() -> dict[str, Any]:
    return {"smddp_rank": smddp.rank(), "local_rank": smddp.local_rank(), "local_size": smddp.local_size()}


def run(rank: int, out: str, scenario: str, world: int, where: dict[str, str]) -> None:
    got: dict[str, Any] = {"rank": rank}
    try:
        if scenario == "groups":
            # Several groups, then the default group destroyed and made again in the same process.
            dist.init_process_group(
                "smddp", init_method=where["file1"], rank=rank, world_size=world, timeout=TIMEOUT
            )
            got["first"] = _sum_of_ranks()
            got["placed"] = _placed()
            every = dist.new_group(list(range(world)), backend="smddp")
            got["every"] = _sum_of_ranks(every)
            some = dist.new_group([0, 1], backend="smddp")
            got["some"] = _sum_of_ranks(some) if rank < 2 else None
            dist.destroy_process_group()
            dist.init_process_group(
                "smddp", init_method=where["file2"], rank=rank, world_size=world, timeout=TIMEOUT
            )
            got["again"] = _sum_of_ranks()
            b = torch.tensor([float(rank)] * 5)
            dist.broadcast(b, src=world - 1)
            got["broadcast"] = float(b[0])
            got["backend"] = dist.get_backend()
        elif scenario in ("tcp", "hosts"):
            if scenario == "hosts":  # two simulated hosts on this one: ranks 0-1 and 2-3
                os.environ["SMDDP_HOST_ID"] = f"host{rank // (world // 2)}"
            dist.init_process_group(
                "smddp", init_method=where["tcp"], rank=rank, world_size=world, timeout=TIMEOUT
            )
            got["first"] = _sum_of_ranks()
            got["placed"] = _placed()
        elif scenario == "store":
            store = dist.FileStore(where["store"], world)
            dist.init_process_group("smddp", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
            got["first"] = _sum_of_ranks()
            got["placed"] = _placed()
        elif scenario == "world":  # rank 1 thinks the world is one larger
            store = dist.FileStore(where["store"], -1)
            size = world + 1 if rank == 1 else world
            dist.init_process_group("smddp", store=store, rank=rank, world_size=size, timeout=TIMEOUT)
        elif scenario == "local":  # a launcher's variables, wrong: every rank says it is local rank 0
            os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world)})
            dist.init_process_group(
                "smddp", init_method=where["file1"], rank=rank, world_size=world, timeout=TIMEOUT
            )
        elif scenario == "lonely":  # each rank's file:// is its own: nobody else reaches it
            store = dist.FileStore(f"{where['store']}.{rank}", -1)
            dist.init_process_group(
                "smddp", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=3)
            )
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        got["ok"] = True
    except Exception as e:
        got.update(ok=False, error=f"{type(e).__name__}: {e}", where=traceback.format_exc()[-3000:])
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    out, scenario, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    where = {
        "file1": f"file://{out}/init1",
        "file2": f"file://{out}/init2",
        "store": f"{out}/store",
        "tcp": f"tcp://127.0.0.1:{_port()}",
    }
    mp.spawn(run, args=(out, scenario, world, where), nprocs=world, join=True)


if __name__ == "__main__":
    main()
