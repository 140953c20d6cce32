"""The TF1 session hook of SageMaker's API: broadcast the global variables when the session starts."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from smddp.tensorflow.errors import InvalidArgumentError
from smddp.tensorflow.ops import broadcast_global_variables


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """For tf.compat.v1.train.MonitoredTrainingSession: root's global variables on every rank at start.

    Needed when training starts from random weights or a checkpoint restored on one rank only.
    `device` is Horovod's argument and must be ''.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        if device:
            raise InvalidArgumentError(
                f"BroadcastGlobalVariablesHook: device is not supported (got {device!r})"
            )
        self.root_rank = root_rank
        self.bcast_op: Any = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
