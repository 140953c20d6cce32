"""Joining the job and who is who: smddp's own calls under the names SageMaker's TensorFlow API uses."""

from __future__ import annotations

import smddp


def init() -> None:
    """Join the job (smddp.init()): collective over every rank; a second call does nothing."""
    smddp.init()


def shutdown() -> None:
    """Wait for pending collectives and leave the job."""
    smddp.shutdown()


def is_initialized() -> bool:
    return smddp.is_initialized()


def size() -> int:
    """The number of workers in the job."""
    return smddp.size()


def local_size() -> int:
    """The number of workers on this node."""
    return smddp.local_size()


def rank() -> int:
    """This worker's rank, in [0, size())."""
    return smddp.rank()


def local_rank() -> int:
    """This worker's rank on its node, in [0, local_size()): the GPU to pin."""
    return smddp.local_rank()
