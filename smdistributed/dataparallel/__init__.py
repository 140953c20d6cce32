"""smdistributed.dataparallel: the SageMaker distributed data parallel library's name for smddp."""

from smddp import __version__

__all__ = ["__version__"]
