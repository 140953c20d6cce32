"""DistributedDataParallel with smddp's defaults, and a DDP comm hook that all-reduces on smddp."""

from __future__ import annotations

import inspect
import os
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

import smddp
from smddp.torch.backend import BACKEND_NAME, SmddpWork, _device_of, _queue_work, register

_TorchDDP = torch.nn.parallel.DistributedDataParallel
_DDP_SIGNATURE = inspect.signature(_TorchDDP.__init__)
_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def init_process_group(**kwargs: Any) -> None:
    """`dist.init_process_group(backend="smddp")`, also outside smddp-launch's torchrun variables.

    With RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (smddp-launch sets them) this is exactly
    the one-line call. Without them, ranks come from smddp itself and torch gets a process-local
    store (smddp does not need torch's store; a later gloo group would, so prefer smddp-launch).
    No-op when torch.distributed is already initialized.
    """
    if dist.is_initialized():
        return
    register()
    kwargs.setdefault("backend", BACKEND_NAME)
    given = {"init_method", "store", "rank", "world_size"} & kwargs.keys()
    if not given and not all(v in os.environ for v in _TORCHRUN_VARS):
        smddp.init()
        kwargs.update(store=dist.HashStore(), rank=smddp.rank(), world_size=smddp.size())
    dist.init_process_group(**kwargs)


class _SmddpGroup:
    """The process's smddp group beside another default backend, made once (as torch keeps WORLD)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.group: dist.ProcessGroup | None = None

    def get(self) -> dist.ProcessGroup:
        with self.lock:
            if self.group is None:
                register()
                self.group = dist.new_group(backend=BACKEND_NAME)
            return self.group


_side_group = _SmddpGroup()


def process_group() -> dist.ProcessGroup:
    """The smddp process group: the default group when it is smddp, else one made with new_group.

    Collective on its first call when the default group is another backend (it calls new_group).
    """
    init_process_group()
    if dist.get_backend() == BACKEND_NAME:
        return dist.group.WORLD  # type: ignore[return-value]
    return _side_group.get()


def fusion_mb() -> float:
    """The fusion buffer size in MiB (smddp-launch --fusion-mb, SMDDP_FUSION_MB)."""
    return smddp.client().config.fusion_bytes / float(1 << 20)


class DistributedDataParallel(_TorchDDP):
    """torch's DistributedDataParallel on the smddp process group, buckets the size of the fusion buffer.

    Takes every argument torch's DDP takes; `process_group` defaults to the smddp group (so the
    default group may be another backend) and `bucket_cap_mb` to smddp's fusion buffer size.
    torch.distributed is initialized with backend "smddp" first if nobody did.
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        bound = _DDP_SIGNATURE.bind_partial(self, module, *args, **kwargs).arguments
        bound.pop("self")
        if bound.get("process_group") is None:
            bound["process_group"] = process_group()
        if bound.get("bucket_cap_mb") is None:
            bound["bucket_cap_mb"] = fusion_mb()
        extra = bound.pop("kwargs", {})  # DDP's own **kwargs, if a torch version has them
        super().__init__(**bound, **extra)


def allreduce_hook(state: Any, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP comm hook: average the bucket over every rank with smddp, whatever DDP's process group is.

    `model.register_comm_hook(None, smddp.torch.allreduce_hook)`. The job must run under
    smddp-launch; smddp is initialized on the first call if it was not (collective: every rank's
    DDP reaches its first bucket together).
    """
    del state
    smddp.init()
    buf = bucket.buffer()
    device = _device_of([buf], "allreduce_hook")
    work = SmddpWork("allreduce_hook", buf, timedelta(seconds=smddp.client().config.timeout_s), device=device)
    handle = smddp.allreduce_async(device.buf(buf), smddp.AVG, **device.kw())
    _queue_work(work, [handle], None, [buf])
    return work.get_future()


# DDP checks a hook's annotations by identity; with postponed evaluation they would be strings.
allreduce_hook.__annotations__.update(
    {"state": object, "bucket": dist.GradBucket, "return": Future[torch.Tensor]}
)
