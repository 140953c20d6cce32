"""Hugging Face `Trainer` on the smddp backend.

    smddp-launch -np 4 --local-nodes 2 -- python examples/torch/train_hf_trainer.py
    torchrun --nproc-per-node 4 examples/torch/train_hf_trainer.py  (the same, without mpirun)

The one smddp-specific step: start torch.distributed on smddp before building TrainingArguments.
Trainer (through accelerate) then uses that group and wraps the model in stock DDP on it. (On
GPUs, `TrainingArguments(ddp_backend="smddp")` alone also works; on CPUs accelerate accepts only
gloo or mpi as `ddp_backend`, so starting the group first is the way that runs everywhere.) The
script runs unchanged on GPUs (one per local rank) and CPUs (`use_cpu` is set below).

SageMaker's data-parallel mode (`SM_FRAMEWORK_PARAMS` with
"sagemaker_distributed_dataparallel_enabled": true, which SageMaker sets) takes another route
through Hugging Face's code, which assumes CUDA: see docs/torch.md.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from _digits import check_replicas, digits
from torch import nn
from transformers import Trainer, TrainingArguments

import smddp.torch  # noqa: F401  (registers torch.distributed backend "smddp")


class DigitNet(nn.Module):
    """A classifier in the shape Trainer expects: keyword inputs, a dict with the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.net(pixels)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class Rows(torch.utils.data.Dataset):
    def __init__(self, ds: torch.utils.data.TensorDataset) -> None:
        self.x, self.y = ds.tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixels": self.x[i], "labels": self.y[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=float, default=3)
    ap.add_argument("--batch", type=int, default=16, help="per worker")
    ap.add_argument("--backend", default="smddp", help="torch.distributed backend (gloo to compare)")
    ap.add_argument("--save", default="", help="write the final parameters here (rank 0)")
    ap.add_argument(
        "--save-params", default="", help="each rank writes its final parameters to DIR/rank<r>.bin"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(backend=args.backend)  # RANK, WORLD_SIZE, ... come from smddp-launch or torchrun
    train_set, test_set = digits()
    torch.manual_seed(0)
    model = DigitNet()
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out,
            use_cpu=not torch.cuda.is_available(),
            per_device_train_batch_size=args.batch,
            per_device_eval_batch_size=256,
            num_train_epochs=args.epochs,
            learning_rate=5e-3,
            lr_scheduler_type="constant",
            seed=0,
            save_strategy="no",
            eval_strategy="epoch",
            logging_strategy="epoch",
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=Rows(train_set), eval_dataset=Rows(test_set))
        trainer.train()
        metrics = trainer.evaluate()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if dist.get_rank() == 0:
        print(
            f"backend {dist.get_backend()}, {dist.get_world_size()} workers: eval loss {metrics['eval_loss']:.4f}"
        )
        if args.save:
            torch.save(flat, args.save)
    check_replicas(flat, args.save_params)
    # The Trainer (its DDP wrapper, and any work the backend still holds for it) sits in reference
    # cycles that only the collector frees: free it now, while the interpreter is whole, then end
    # the group's threads. Left to the interpreter's exit, gloo's work objects can abort the
    # process there ("terminate called without an active exception", seen once in CI and once in
    # a full local run of the tests).
    del trainer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
