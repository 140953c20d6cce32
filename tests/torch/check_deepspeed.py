"""Worker script: DeepSpeed ZeRO stage 3 on a tiny model over one backend (smddp or gloo); saves losses and parameters."""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch
import torch.distributed as dist

import smddp.torch  # noqa: F401  (registers the "smddp" backend)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", choices=["smddp", "gloo"], required=True)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # init_distributed builds DeepSpeed's own shared-memory all-reduce for CPU inference (the C++ op
    # deepspeed_shm_comm, compiled on first use: 30-45 s of this test on 2 cores, after probing a
    # compiler for every op). Only its inference_all_reduce calls it, never ZeRO's training, whose every
    # collective goes through the backend under test: marked incompatible, it is neither probed nor built.
    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    # DeepSpeed checks LOCAL_RANK against OMPI_COMM_WORLD_LOCAL_RANK: the workers' own MPI world.
    deepspeed.init_distributed(dist_backend=args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 24),
        torch.nn.ReLU(),
        torch.nn.Linear(24, 24),
        torch.nn.Tanh(),
        torch.nn.Linear(24, 3),
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for step in range(args.steps):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    torch.save(
        {
            "losses": losses,
            "params": params,
            "backend": dist.get_backend(),
            "zero": engine.zero_optimization_stage(),
        },
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
