"""The older SageMaker API's DistributedDataParallel: smddp.torch's DDP (smddp group, fusion-size buckets)."""

from __future__ import annotations

from typing import Any

import torch

import smddp.torch


class DistributedDataParallel(smddp.torch.DistributedDataParallel):
    """SageMaker's `smdistributed.dataparallel.torch.parallel.DistributedDataParallel`.

    Same arguments as torch's DDP. SageMaker scripts pass `device_ids=[local_rank]`: a GPU module
    keeps them (smddp takes CUDA tensors, docs/gpu.md); for a module on the CPU `device_ids` and
    `output_device` are dropped, as torch's DDP refuses them there.
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        on_cpu = all(p.device.type == "cpu" for p in module.parameters())
        if on_cpu:
            if args:
                args = (None, None, *args[2:]) if len(args) >= 2 else (None,)
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
        super().__init__(module, *args, **kwargs)
