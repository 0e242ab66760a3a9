"""A compiled step program captured as a CUDA graph and replayed.

Every tensor the program reads or writes persistently (parameters, buffers, optimizer state, hyperparameters, the
window, the loss-scale state, a staged dataset and its sink indices) keeps its address across calls, so the graph
captures the program over those very tensors; a batch passed in is copied into a static buffer first. The outputs
are static too: each replay overwrites them, so they are valid until the same program's next call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CapturedProgram", "copy_into"]

_WARMUP_CALLS = 2  # on a side stream before capture, as torch's CUDA graph notes advise (lazy library set-up)


def copy_into(static: Any, value: Any) -> None:
    """Copy the batch ``value`` into the static buffers ``static`` of the same structure."""
    if isinstance(static, torch.Tensor):
        static.copy_(value, non_blocking=True)
    elif isinstance(static, dict):
        for key, inner in static.items():
            copy_into(inner, value[key])
    elif isinstance(static, (list, tuple)):
        for inner, item in zip(static, value):
            copy_into(inner, item)


class CapturedProgram:
    """``program(state, batch)`` captured once over ``state``; ``__call__(batch)`` replays it."""

    def __init__(
        self,
        program: Callable[[Any, Any], Any],
        state: Any,
        example_batch: Any,
        clone: Callable[[Any], Any],
        device: torch.device,
    ) -> None:
        self.static_batch = clone(example_batch)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.random.fork_rng(devices=[device]), torch.cuda.stream(side):
            scratch = clone(state)  # warm-up calls change a copy, not the run
            for _ in range(_WARMUP_CALLS):
                program(scratch, self.static_batch)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = program(state, self.static_batch)

    def __call__(self, batch: Any) -> Any:
        if batch is not None:
            copy_into(self.static_batch, batch)
        self.graph.replay()
        return self.outputs
