"""How an update program sums the window across processes (DDP): ``RankSum``, and the one flat fp32 bucket the
ranks' sums travel in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["RankSum", "flatten_bucket", "unflatten_bucket"]


@dataclass(frozen=True)
class RankSum:
    """The window's sum across processes (DDP), in the update program: the ranks' fp32 sums as one flat bucket,
    added up over ``ranks`` ranks, then divided by ``ranks`` times the micro-steps (the mean over every rank's
    micro-batches, as DDP averages). Inf and NaN survive the sum, so every rank sees any rank's overflow and skips
    with it. Two routes:

    - ``group`` given: a functional all-reduce over that process group traced inside the update program;
    - ``all_reduce`` given: the update program compiled as two parts (the last micro-batch and the flat sum; the
      rest of the update) with this eager in-place sum of the flat bucket between them.
    """

    ranks: int
    group: Any = None
    all_reduce: Callable[[Tensor], None] | None = None

    def __post_init__(self) -> None:
        if (self.group is None) == (self.all_reduce is None):
            raise ValueError("RankSum takes exactly one of group= (traced) and all_reduce= (eager)")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 2:
            raise ValueError(f"RankSum(ranks={self.ranks!r}) is not valid: pass an int >= 2")


def flatten_bucket(tensors: list[Tensor]) -> Tensor:
    """One flat fp32 bucket of the window's sums (what one all-reduce adds up across the ranks)."""
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def unflatten_bucket(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    """The bucket's pieces, shaped as ``like``'s tensors."""
    pieces = flat.split([tensor.numel() for tensor in like])
    return [piece.view(tensor.shape) for piece, tensor in zip(pieces, like)]
