"""Worker script: which torch backend this rank got, and that an all-reduce on it is right."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import smddp.torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out: dict[str, object] = {}
    try:
        dist.init_process_group(backend="smddp")
    except Exception as e:  # (the route that refuses: the error a user meets)
        out["error"] = f"{type(e).__name__}: {e}"
        with open(os.path.join(args.out, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(out, f)
        return 0
    r, w = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(r + 1))
    dist.all_reduce(t)
    out["kind"] = smddp.torch.backend_kind()
    out["sum"] = bool((t == w * (w + 1) / 2).all())
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
