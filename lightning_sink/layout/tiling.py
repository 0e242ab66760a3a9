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

Sharded tensors are cut into a grid: every chunk is one cell between consecutive cut points of each dim. That case,
every layout this package or DCP writes, is decided first without corners: the distinct boxes tile the tensor
exactly when each is a cell and there are as many as cells. Only other tilings count corners, and their corner
updates are bounded by ``CORNER_BUDGET`` per box on average (a layout beyond it is refused as too complex), so no
input makes the check more than linear in the boxes with a small constant.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["MAX_INNER_DIMS", "Box", "TilingFault", "tiling_fault"]

# Sharding cuts a tensor along at most one dim per mesh dim; meshes have a handful of dims.
MAX_INNER_DIMS = 8
# Corner updates per box, on average, for tilings that are not a grid (sharding never makes one).
CORNER_BUDGET = 16

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
    grid = _grid_fault(boxes, shape)
    if grid is not None:
        return grid or None
    budget = CORNER_BUDGET * len(boxes) + 2 ** (MAX_INNER_DIMS + 1)  # room for a few chunks at the dims limit
    counts: Counter[tuple[int, ...]] = Counter({tuple(0 for _ in shape): -1})  # minus the tensor's own corner
    for box in boxes:
        steps = _steps(box, shape)
        inner = sum(len(dim) == 2 for dim in steps)
        budget -= 2**inner
        if inner > MAX_INNER_DIMS or budget < 0:
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


def _grid_fault(boxes: Sequence[Box], shape: Sequence[int]) -> TilingFault | Literal[False] | None:
    """When every box is one cell of the grid of its dims' cut points: False (a tiling) or the first cell left
    uncovered. None when some box spans several cells (the corner count decides)."""
    cuts = [
        sorted({0, extent, *(box[0][d] for box in boxes), *(box[0][d] + box[1][d] for box in boxes)})
        for d, extent in enumerate(shape)
    ]
    index = [{at: i for i, at in enumerate(dim)} for dim in cuts]
    cells = set()
    for offsets, sizes in boxes:
        cell = tuple(index[d][at] for d, at in enumerate(offsets))
        if any(index[d][at + size] != i + 1 for d, (at, size, i) in enumerate(zip(offsets, sizes, cell))):
            return None
        cells.add(cell)
    if len(cells) == math.prod(len(dim) - 1 for dim in cuts):
        return False
    # Fewer cells than the grid has: the first missing one in lexicographic order, found in at most len(cells) + 1
    # steps; its corner is the first element left uncovered.
    for cell in itertools.product(*(range(len(dim) - 1) for dim in cuts)):
        if cell not in cells:
            return TilingFault(point=tuple(cuts[d][i] for d, i in enumerate(cell)), coverage=0)
    return False


def _steps(box: Box, shape: Sequence[int]) -> list[tuple[tuple[int, int], ...]]:
    """Per dim, the box's (coordinate, sign) steps that are not zero inside the tensor."""
    return [
        ((offset, 1),) if offset + size == extent else ((offset, 1), (offset + size, -1))
        for offset, size, extent in zip(box[0], box[1], shape)
    ]


def _contains(box: Box, point: tuple[int, ...]) -> bool:
    return all(offset <= at < offset + size for offset, size, at in zip(box[0], box[1], point))
