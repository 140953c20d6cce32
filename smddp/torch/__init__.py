"""smddp for PyTorch: `import smddp.torch` registers torch.distributed backend "smddp"."""

from __future__ import annotations

from smddp.launcher.elastic import start_early_daemon
from smddp.torch.backend import (
    BACKEND_NAME,
    SUPPORTED_DTYPES,
    ProcessGroupSmddp,
    SmddpWork,
    TraceEvent,
    UnsupportedCollectiveError,
    create_process_group,
    register,
)
from smddp.torch.ddp import (
    DistributedDataParallel,
    allreduce_hook,
    fusion_mb,
    init_process_group,
    process_group,
)
from smddp.torch.native import backend_kind

register()
# Under torchrun, a node's first worker starts its daemon now: its start-up overlaps the script's.
start_early_daemon()

__all__ = [
    "BACKEND_NAME",
    "SUPPORTED_DTYPES",
    "DistributedDataParallel",
    "ProcessGroupSmddp",
    "SmddpWork",
    "TraceEvent",
    "UnsupportedCollectiveError",
    "allreduce_hook",
    "backend_kind",
    "create_process_group",
    "fusion_mb",
    "init_process_group",
    "process_group",
    "register",
]
