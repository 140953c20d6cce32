"""Worker script: a failing collective raises from Work.wait() and from DDP's backward, never yields zeros."""

from __future__ import annotations

import argparse
import json
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import smddp.torch  # noqa: F401  (registers backend "smddp")
from smddp import errors


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--mode", choices=["mismatch_wait", "ddp_mismatch", "ddp_rank_dies", "late_rank"], required=True
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend="smddp")
    r, w = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": r}

    def save() -> None:
        with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
            json.dump(out, f)

    if args.mode == "late_rank":
        # Rank 1 is 6 s late. Rank 0's Work has a 1 s timeout: its future (what DDP waits on in C++,
        # with no timeout of its own) must fail with the timeout, not wait for rank 1; the collective
        # itself stays in flight and completes once rank 1 comes, its result dropped on rank 0.
        import time
        from datetime import timedelta

        if r == 1:
            time.sleep(6.0)
            dist.all_reduce(torch.ones(4))
        else:
            opts = dist.AllreduceOptions()
            opts.timeout = timedelta(seconds=1)
            t = torch.ones(4)
            work = dist.group.WORLD.allreduce([t], opts)
            t0 = time.monotonic()
            try:
                work.get_future().wait()
                out["future"] = "NOT RAISED"
            except Exception as e:
                out["future"] = f"{type(e).__name__}: {e}"
            out["future_s"] = time.monotonic() - t0
            out["completed"] = work.is_completed()
            time.sleep(6.5)  # rank 1 submits: the late completion must be ignored quietly
            out["after"] = t.tolist()
        dist.barrier()
        save()
        return 0

    if args.mode == "mismatch_wait":
        t = torch.ones(4 + r)  # a different count on every rank: the daemons refuse the collective
        work = dist.all_reduce(t, async_op=True)
        try:
            work.wait()
            out["wait"] = "NOT RAISED"
        except errors.CollectiveError as e:
            out["wait"] = f"{type(e).__name__}: {e}"
            out["is_collective_error"] = True
        out["work_success"] = work.is_success()
        try:
            work.get_future().wait()
            out["future"] = "NOT RAISED"
        except Exception as e:
            out["future"] = f"{type(e).__name__}: {e}"
        try:
            dist.all_reduce(torch.ones(3))  # the job has failed: later collectives raise at once
            out["later"] = "NOT RAISED"
        except errors.CollectiveError as e:
            out["later"] = f"{type(e).__name__}: {e}"
        save()
        return 0

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    out["steps_done"] = 0
    for step in range(6):
        opt.zero_grad()
        x = torch.randn(16, 32)
        loss = ddp(x).square().mean()
        if step == 3 and r == w - 1:
            if args.mode == "ddp_rank_dies":
                out["died"] = True
                save()
                os._exit(0)  # no BYE: the daemon sees a worker vanish and fails the job
            # One extra collective on one rank: every later sequence number disagrees.
            dist.all_reduce(torch.ones(7), async_op=True)
        try:
            loss.backward()
        except Exception as e:
            out["backward"] = f"{type(e).__name__}: {e}"
            out["backward_tb"] = traceback.format_exc()[-2000:]
            out["grads_zero"] = all(p.grad is None or bool((p.grad == 0).all()) for p in model.parameters())
            break
        opt.step()
        out["steps_done"] = step + 1
    else:
        out["backward"] = "NOT RAISED"
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
