"""The loop's carry as one flat tensor per dtype and device: the state a loop over windows carries (parameters,
buffers, optimizer state, counters) packed into a few flat tensors before the loop and at each iteration's end,
and unpacked at each iteration's start.

Inductor's loop makes a tensor handle for every carried tensor at each iteration, for the loop's condition and
again for its body, and allocates each carried tensor's next value apart: a carry of a few flat tensors keeps that
per-iteration bookkeeping to a few tensors, whatever the model and its optimizer hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FlatCarry"]


@dataclass(frozen=True)
class _Place:
    """Where one carried tensor lies: its flat tensor, offset and element count, and its own shape and strides."""

    flat: int
    offset: int
    numel: int
    shape: torch.Size
    stride: tuple[int, ...]
    contiguous: bool


class FlatCarry:
    """The layout of ``tensors`` in one flat tensor per dtype and device (kinds in the order first seen)."""

    def __init__(self, tensors: list[Tensor]) -> None:
        kinds: list[tuple[torch.dtype, torch.device]] = []
        sizes: list[int] = []
        self.places: list[_Place] = []
        for tensor in tensors:
            kind = (tensor.dtype, tensor.device)
            if kind not in kinds:
                kinds.append(kind)
                sizes.append(0)
            flat = kinds.index(kind)
            contiguous = tensor.is_contiguous()
            self.places.append(_Place(flat, sizes[flat], tensor.numel(), tensor.shape, tensor.stride(), contiguous))
            sizes[flat] += tensor.numel()
        self._members = [[i for i, place in enumerate(self.places) if place.flat == k] for k in range(len(kinds))]

    def pack(self, tensors: list[Tensor]) -> list[Tensor]:
        """New flat tensors holding the values of ``tensors`` (laid out as the ones this layout was made from)."""
        return [torch.cat([tensors[i].reshape(-1) for i in members]) for members in self._members]

    def views(self, flats: list[Tensor]) -> list[Tensor]:
        """Each tensor's values in ``flats``, as a view of its shape (contiguous)."""
        return [flats[p.flat][p.offset : p.offset + p.numel].view(p.shape) for p in self.places]

    def unpack(self, flats: list[Tensor]) -> list[Tensor]:
        """New tensors holding each tensor's values in ``flats``, with the original's shape and strides (what a
        loop's body writes in place: a loop may not write its carry)."""
        return [
            view.clone()
            if place.contiguous
            else torch.empty_strided(place.shape, place.stride, dtype=view.dtype, device=view.device).copy_(view)
            for place, view in zip(self.places, self.views(flats))
        ]
