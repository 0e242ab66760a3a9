"""Reducers: none (one process), one flat all-reduce (DDP), the overflow flag only (FSDP2 reduce-scatters in its
own backward)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.distributed as dist
from torch import Tensor

from lightning_sink.window.protocols import GradientStore

__all__ = ["NoReduction", "FlatAllReduce", "OverflowFlagAllReduce"]


class NoReduction:
    """One process: the window's sum is already the whole sum."""

    def reduce(self, store: GradientStore) -> None:
        pass

    def agree_on_overflow(self, found_inf: Tensor | None) -> Tensor | None:
        return found_inf


class FlatAllReduce:
    """DDP: one all-reduce of the flat fp32 window buffer, then rank 0's module buffers (BatchNorm statistics, ...)
    to every rank, as DDP's ``broadcast_buffers`` but once per window. The summed buffer carries any rank's
    overflow (inf/NaN are absorbing), so every rank reaches the same overflow decision by itself."""

    def __init__(self, module_buffers: Callable[[], Iterable[Tensor]]) -> None:
        self._module_buffers = module_buffers

    def reduce(self, store: GradientStore) -> None:
        if store.flat is not None:  # (a window without trainable parameters has nothing to sum)
            self.sum_flat(store.flat)
        self.broadcast_module_buffers()

    @staticmethod
    def sum_flat(flat: Tensor) -> None:
        """The window's one bucket: every rank's flat fp32 sum added up, in place (the compiled update program's
        eager route calls this between its two parts)."""
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)

    def broadcast_module_buffers(self) -> None:
        """Rank 0's module buffers to every rank, once per window."""
        for buffer in self._module_buffers():
            dist.broadcast(buffer, src=0)

    def agree_on_overflow(self, found_inf: Tensor | None) -> Tensor | None:
        return found_inf


class OverflowFlagAllReduce:
    """FSDP2: the backward that ends a window reduce-scatters it; each rank then checks only its shards, so the
    overflow flag is all-reduced once to make every rank skip together."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size

    def reduce(self, store: GradientStore) -> None:
        pass

    def agree_on_overflow(self, found_inf: Tensor | None) -> Tensor | None:
        if found_inf is not None and self._world_size > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return found_inf
