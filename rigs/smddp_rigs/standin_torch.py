"""The stand-in runtime's torch device: CPU tensors taken as its device memory, the CUDA route without a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import smddp
from smddp.proto.dtypes import DType
from smddp.torch.backend import SmddpWork, _Device, _get_completer


class StandinTorchDevice(_Device):
    """CPU tensors as the stand-in runtime's device memory (SMDDP_DEVICE_RUNTIME=standin), for tests.

    The same route as CUDA: each tensor reaches smddp as a device buffer (an alias of its memory),
    results come back by asynchronous copies, and `finish` runs on a side stream after them. torch
    on CPU reads tensors without streams, so the completer then blocks until the side stream is
    through, where CUDA would only record an event.
    """

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.side_stream: int = _get_completer().side(rt, lambda: rt.new_stream(0))

    def buf(self, t: torch.Tensor) -> Any:
        if t.dtype == torch.bfloat16:
            return self.rt.alias(t.view(torch.int16).numpy().view(np.uint16), wire=DType.BFLOAT16)
        return self.rt.alias(t.numpy())

    def complete(
        self,
        work: SmddpWork,
        handles: list[smddp.Handle],
        finish: Callable[[], None] | None,
        touched: list[torch.Tensor],
    ) -> None:
        for h in handles:
            h.wait(work._timeout.total_seconds(), stream=self.side_stream)
        if finish is not None:
            self.rt.launch(self.side_stream, finish)
        ev = self.rt.new_event(0)
        self.rt.record(ev, self.side_stream, 0)
        self.rt.event_synchronize(ev)
        work._complete(None)
