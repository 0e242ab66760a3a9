"""The tiling check is linear in the chunks with a small constant for any number of dims (issue 31, item 2): a
1.8 MB layout of 8-D chunks took 55 s to refuse (256 corner updates per chunk). Chunks that form a grid - all that
sharding makes - are decided cell by cell; other tilings have their corner updates bounded. Timing is asserted
only as a ratio between two inputs of the same size."""

from __future__ import annotations

import itertools
import time

from lightning_sink.layout.tiling import tiling_fault


def grid(dims: int, cuts: int) -> tuple[list, tuple[int, ...]]:
    """Unit-width cells of a ``cuts``-per-dim grid over ``dims`` dims: ``cuts ** dims`` boxes."""
    shape = (cuts,) * dims
    boxes = [(cell, (1,) * dims) for cell in itertools.product(range(cuts), repeat=dims)]
    return boxes, shape


def best_seconds(boxes, shape) -> float:
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        assert tiling_fault(boxes, shape) is None
        best = min(best, time.perf_counter() - started)
    return best


def test_an_eight_dim_grid_costs_about_what_the_same_count_of_one_dim_chunks_costs():
    eight, eight_shape = grid(8, 3)  # 6,561 chunks ending inside the tensor in up to 8 dims each
    one = [((i,), (1,)) for i in range(len(eight))]
    ratio = best_seconds(eight, eight_shape) / best_seconds(one, (len(one),))
    assert ratio < 8, f"8-D chunks cost {ratio:.0f}x 1-D ones: corners counted per chunk"


def test_a_grid_with_a_cell_missing_names_the_first_uncovered_element():
    boxes, shape = grid(3, 4)
    boxes.remove(((1, 2, 0), (1, 1, 1)))
    boxes.remove(((3, 0, 0), (1, 1, 1)))
    fault = tiling_fault(boxes, shape)
    assert fault is not None and fault.point == (1, 2, 0) and fault.coverage == 0


def test_chunks_off_the_grid_still_find_overlaps_and_gaps():
    shape = (4, 4)
    halves = [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    assert tiling_fault(halves, shape) is None
    overlap = tiling_fault([((0, 0), (3, 4)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], shape)
    assert overlap is not None and overlap.coverage == 2 and overlap.point == (2, 0)


def test_off_grid_chunks_beyond_the_corner_budget_are_refused_as_too_complex():
    boxes, shape = grid(8, 2)  # 256 cells, each with corners in all 8 dims
    boxes.append(((0,) * 8, (2,) + (1,) * 7))  # one chunk spanning two cells: the grid path does not apply
    fault = tiling_fault(boxes, shape)
    assert fault is not None and fault.too_complex is not None
