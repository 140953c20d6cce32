"""smdistributed.dataparallel.torch.parallel: the older API's DistributedDataParallel."""

from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
