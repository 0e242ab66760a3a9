"""Whether a set of boxes tiles a tensor exactly, in time linear in the boxes for any number of dims.

A box ``[o, o + s)`` is, along each dim, the difference of two steps: ``H(x - o) - H(x - o - s)``, where
``H(x - c)`` is 1 from ``c`` on. Multiplying out the dims writes the box's indicator as a signed sum of orthants
``H(x - c)``, one per corner ``c``. Orthants at distinct corners are linearly independent, so the boxes cover every
element exactly once (no overlap, no gap) exactly when their signed corner counts add up to the tensor's own: a
single +1 at the origin. Counting corners is a dictionary update per corner, whatever the rank, so an adversary
cannot make the check compare boxes pairwise. A step at the tensor's far end is zero inside the tensor and a step
at 0 is a constant, so a box has ``2**k`` corners where ``k`` is the number of dims in which it ends inside the
tensor; boxes ending inside in more than ``MAX_INNER_DIMS`` dims are refused, which bounds the work at
``2**MAX_INNER_DIMS`` per box.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_INNER_DIMS", "Box", "TilingFault", "tiling_fault"]

# Sharding cuts a tensor along at most one dim per mesh dim; meshes have a handful of dims.
MAX_INNER_DIMS = 8

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), each in bounds of the shape


@dataclass(frozen=True)
class TilingFault:
    """Why boxes do not tile a shape: ``point`` is covered ``coverage`` times (0: a gap; 2 or more: an overlap,
    and ``boxes`` are two of those covering it), or ``box`` ends inside the shape in too many dims to check."""

    point: tuple[int, ...] = ()
    coverage: int = 1
    boxes: tuple[Box, ...] = ()
    too_complex: Box | None = None


def tiling_fault(boxes: Sequence[Box], shape: Sequence[int]) -> TilingFault | None:
    """None when the distinct non-empty ``boxes`` cover each element of ``shape`` exactly once; else the first
    element (in lexicographic order) covered otherwise, or the first box that ends inside in too many dims."""
    if math.prod(shape) == 0:
        return None  # in-bounds boxes of an empty tensor are empty
    counts: Counter[tuple[int, ...]] = Counter({tuple(0 for _ in shape): -1})  # minus the tensor's own corner
    for box in boxes:
        steps = _steps(box, shape)
        if sum(len(dim) == 2 for dim in steps) > MAX_INNER_DIMS:
            return TilingFault(too_complex=box)
        for corner in itertools.product(*steps):
            counts[tuple(at for at, _ in corner)] += math.prod(sign for _, sign in corner)
    wrong = [point for point, count in counts.items() if count]
    if not wrong:
        return None
    # At the lexicographically first wrong corner, every other corner at or below it in every dim is right, so
    # its residual count is exactly how far the coverage there is from 1.
    point = min(wrong)
    coverage = 1 + counts[point]
    covering = tuple(box for box in boxes if _contains(box, point)) if coverage > 1 else ()
    return TilingFault(point=point, coverage=coverage, boxes=covering[:2])


def _steps(box: Box, shape: Sequence[int]) -> list[tuple[tuple[int, int], ...]]:
    """Per dim, the box's (coordinate, sign) steps that are not zero inside the tensor."""
    return [
        ((offset, 1),) if offset + size == extent else ((offset, 1), (offset + size, -1))
        for offset, size, extent in zip(box[0], box[1], shape)
    ]


def _contains(box: Box, point: tuple[int, ...]) -> bool:
    return all(offset <= at < offset + size for offset, size, at in zip(box[0], box[1], point))
