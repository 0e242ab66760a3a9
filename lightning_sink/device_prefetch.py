"""Data sinking on CUDA: the prefetch thread puts batches on the GPU ahead of use.

Each batch is copied from pinned host memory with a non-blocking copy on a side CUDA stream, so the copy of batch
i+1 overlaps the compute of batch i. An event recorded after the copy is what the training stream waits on (on the
GPU, not the host), and ``record_stream`` tells the caching allocator that the training stream uses the memory the
side stream allocated, so it is not handed out again too early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

__all__ = ["CudaBatchCopier", "CopiedBatch"]


@dataclass
class CopiedBatch:
    batch: Any
    ready: torch.cuda.Event


class CudaBatchCopier:
    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaBatchCopier copies to a CUDA device; got device={device}.")
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def _to_device(self, tensor: Tensor) -> Tensor:
        host = tensor if tensor.is_pinned() else tensor.pin_memory()
        return host.to(self.device, non_blocking=True)

    def copy(self, batch: Any) -> CopiedBatch:
        """Runs in the prefetch thread."""
        with torch.cuda.stream(self.stream):
            moved = apply_to_collection(batch, Tensor, self._to_device)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return CopiedBatch(moved, ready)

    def receive(self, copied: CopiedBatch) -> Any:
        """Runs in the training thread: order the training stream after the copy, without waiting on the host."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copied.ready)
        apply_to_collection(copied.batch, Tensor, lambda tensor: tensor.record_stream(stream))
        return copied.batch
