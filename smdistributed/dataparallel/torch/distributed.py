"""The older SageMaker API (`import smdistributed.dataparallel.torch.distributed as dist`) over smddp."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as _dist

import smddp
import smddp.torch

ReduceOp = _dist.ReduceOp

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_available",
    "is_initialized",
]


def is_available() -> bool:
    """True: smddp's torch backend is importable (torch.distributed is built in)."""
    return _dist.is_available()


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """Join the job with backend "smddp" (arguments are accepted for compatibility and passed on)."""
    if args:
        kwargs.setdefault("backend", args[0])
    kwargs["backend"] = smddp.torch.BACKEND_NAME
    smddp.torch.init_process_group(**kwargs)


def is_initialized() -> bool:
    return _dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return _dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return _dist.get_world_size(group)


def get_local_rank() -> int:
    return smddp.local_rank()


def get_local_size() -> int:
    return smddp.local_size()


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
    return _dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def barrier(group: Any = None, async_op: bool = False) -> Any:
    return _dist.barrier(group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    _dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list[Any], src: int = 0, group: Any = None) -> None:
    _dist.broadcast_object_list(object_list, src=src, group=group)
