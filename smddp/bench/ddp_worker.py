"""The per-rank DDP training-step program of `smddp-bench ddp`: stock torch DDP on smddp or on gloo.

    python -m smddp.bench.ddp_worker --impl smddp|gloo|compute --out DIR [--width W --depth D ...]

smddp runs it under smddp-launch (torch.distributed's "smddp" backend, the launcher's RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT), gloo under a plain mpirun (ranks from Open MPI's
variables); `compute` as gloo, with DDP's all-reduces replaced by torch's no-op comm hook, which
keeps each bucket as it is (the step's floor: its replicas differ). The model is an MLP (`--width`,
`--depth`), every rank with the same weights and its own batch; one torch thread per rank. `--device
cuda` puts it on GPU `local rank % GPUs` (`device_ids=[that GPU]`, gloo on CUDA tensors too). A step
(zero_grad, forward, backward with DDP's bucketed all-reduces overlapping it, SGD step) starts after
a barrier; its time ends when this rank's optimizer step is done (on CUDA: when the device is
through with it). Every rank writes `DIR/rank<r>.json`: its step times and a digest of its
parameters after the last step, which must be the same bits on every rank (but compute's; DDP keeps replicas equal
only if every rank gets the same reduced gradients).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any


def _mlp(torch: Any, width: int, depth: int, inputs: int, classes: int) -> Any:
    nn = torch.nn
    layers: list[Any] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m smddp.bench.ddp_worker")
    # compute: gloo's launch and group, DDP's averaging replaced by torch's no-op hook: the step's floor.
    ap.add_argument("--impl", required=True, choices=["smddp", "gloo", "compute"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=11)
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(args.threads)
    if args.impl == "smddp":
        import smddp.torch  # registers the backend

        smddp.torch.init_process_group(backend="smddp")
    elif "OMPI_COMM_WORLD_RANK" in os.environ:  # gloo (and compute) under mpirun
        rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:  # gloo under torchrun: env://
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(torch.zeros(1))
    first_allreduce_at = time.time()  # the launcher's start-up ends here (smddp-bench ddp)
    device, name = torch.device("cpu"), "cpu"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                f"rank {rank}: --device cuda, but torch {torch.__version__} reaches no CUDA device"
            )
        local = int(os.environ.get("LOCAL_RANK") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or 0)
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    torch.manual_seed(0)  # the same initial weights everywhere
    model = _mlp(torch, args.width, args.depth, args.inputs, 10).to(device)
    ids = [device.index] if device.type == "cuda" else None
    net = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=args.bucket_mb)
    if args.impl == "compute":
        # torch's own no-op hook (made for this headroom analysis): each bucket as it is, no averaging.
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        net.register_comm_hook(None, noop_hook)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
    x = torch.randn(args.batch, args.inputs, generator=gen).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    steps: list[float] = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter() - t0
        if i >= args.warmup:
            steps.append(t)
    digest = hashlib.sha256()
    for p in net.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    result = {
        "impl": args.impl,
        "rank": rank,
        "world": world,
        "params": sum(p.numel() for p in net.parameters()),
        "buckets_mb": args.bucket_mb,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": name,
        "step_s": steps,
        "loss": float(loss),
        "params_sha256": digest.hexdigest(),
        "first_allreduce_at": first_allreduce_at,
        # (smddp's groups: the C++ backend or the Python one, smddp.torch.backend_kind)
        **({"torch_backend": smddp.torch.backend_kind()} if args.impl == "smddp" else {}),
    }
    os.makedirs(args.out, exist_ok=True)
    tmp = os.path.join(args.out, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(args.out, f"rank{rank}.json"))
    if args.impl != "smddp":
        # gloo's own teardown (its threads, in destroy_process_group or at interpreter exit) now and
        # then aborts the process ("terminate called without an active exception", SIGABRT: once in
        # 62 launches here, after every rank's record was on disk). The baselines' records are
        # written and no collective is left: they leave now. smddp's teardown is part of what runs.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
