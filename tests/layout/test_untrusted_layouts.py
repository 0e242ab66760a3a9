"""Layout files from untrusted hands: bounded work and memory, and one ValueError naming the file for any damage."""

from __future__ import annotations

import itertools
import json
import random
import re
import sys
from pathlib import Path

import pytest

from lightning_sink.layout import (
    Chunk,
    Layout,
    MeshLayout,
    TensorLayout,
    load_layout,
    save_layout,
    validation,
)


def one_tensor_layout(chunks: list[Chunk], shape: tuple[int, ...], world_size: int) -> Layout:
    tensor = TensorLayout(role="parameter", global_shape=shape, dtype="float32", placements=None, chunks=tuple(chunks))
    return Layout(world_size=world_size, mesh=MeshLayout.one_dimensional(world_size), tensors={"w": tensor})


def write(tmp_path: Path, data: object, name: str = "layout.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.fixture
def valid(tmp_path: Path) -> dict:
    layout = one_tensor_layout([Chunk(0, (0, 0), (2, 4)), Chunk(1, (2, 0), (2, 4))], (4, 4), 2)
    return json.loads(save_layout(layout, tmp_path / "valid.json").read_text())


def test_a_world_size_the_mesh_does_not_account_for_is_refused(tmp_path: Path, valid: dict):
    """10**18 ranks on a 2-rank mesh would make every loop over the ranks run without end."""
    valid["world_size"] = 10**18
    with pytest.raises(ValueError, match=r"huge.json.*world_size 1000000000000000000 does not match the mesh of 2"):
        load_layout(write(tmp_path, valid, "huge.json"))


def test_a_per_stage_layout_may_count_every_stage(tmp_path: Path, valid: dict):
    valid["world_size"], valid["pipeline"] = 4, {"stage": 1, "num_stages": 2}
    valid["tensors"]["w"]["stage"] = 1
    assert load_layout(write(tmp_path, valid)).world_size == 4
    valid["world_size"] = 6
    with pytest.raises(ValueError, match=r"world_size 6 does not match the mesh of 2 ranks \(expected 2 or 4 for 2"):
        load_layout(write(tmp_path, valid))
    valid["world_size"], valid["pipeline"]["num_stages"] = 10**18, 5 * 10**17  # a stage count inflating the world
    with pytest.raises(ValueError, match=r"world_size 1000000000000000000 is beyond 16777216 ranks"):
        load_layout(write(tmp_path, valid))


@pytest.mark.parametrize("tensors", [["w"], "w", 7, {"w": ["not", "an", "object"]}])
def test_tensors_of_the_wrong_kind_are_one_error(tmp_path: Path, valid: dict, tensors):
    valid["tensors"] = tensors
    with pytest.raises(ValueError, match=r"bad.json.*malformed: missing or wrong field"):
        load_layout(write(tmp_path, valid, "bad.json"))


def test_deeply_nested_json_is_refused_before_parsing(tmp_path: Path):
    with pytest.raises(ValueError, match=r"deep.json.*nests 100000 levels deep"):
        load_layout(write(tmp_path, "[" * 100000 + "]" * 100000, "deep.json"))
    nested_mesh = {"format": "lightning-sink-layout", "version": 1, "mesh": {"ranks": [[[[[[[[0]]]]]]]]}}
    nested_mesh["mesh"]["ranks"] = json.loads("[" * 500 + "0" + "]" * 500)
    with pytest.raises(ValueError, match=r"mesh.json.*nests 502 levels deep"):
        load_layout(write(tmp_path, nested_mesh, "mesh.json"))


def test_brackets_inside_strings_do_not_count_as_depth(tmp_path: Path, valid: dict):
    valid["non_tensor_state"] = {"note[" * 100: "{" * 100 + '"'}
    assert "note[" * 100 in load_layout(write(tmp_path, valid)).non_tensor_state


def test_a_shape_no_tensor_can_have_is_refused(tmp_path: Path, valid: dict):
    valid["tensors"]["w"]["global_shape"] = [2**40, 2**40]
    valid["tensors"]["w"]["chunks"] = [{"rank": 0, "offsets": [0, 0], "sizes": [2**40, 2**40]}]
    with pytest.raises(
        ValueError,
        match=r"absurd.json.*tensor 'w'.*global_shape \[1099511627776, 1099511627776\] is"
        r" 4835703278458516698824704 bytes",
    ):
        load_layout(write(tmp_path, valid, "absurd.json"))


def covering_counts(boxes, shape) -> dict[tuple[int, ...], int]:
    """How many boxes hold each element, by visiting every element of the (small) shape."""
    return {
        point: sum(all(o <= p < o + s for o, s, p in zip(*box, point)) for box in boxes)
        for point in itertools.product(*(range(extent) for extent in shape))
    }


def brute_force_overlap(boxes) -> bool:
    return any(
        all(max(a, b) < min(a + sa, b + sb) for a, sa, b, sb in zip(x[0], x[1], y[0], y[1]))
        for x, y in itertools.combinations(boxes, 2)
    )


def random_tiling(generator: random.Random, shape: tuple[int, ...], pieces: int) -> list:
    """Cut the shape into boxes by splitting a random box along a random dim, ``pieces - 1`` times."""
    boxes = [(tuple(0 for _ in shape), shape)]
    for _ in range(pieces - 1):
        offsets, sizes = boxes.pop(generator.randrange(len(boxes)))
        dims = [d for d, size in enumerate(sizes) if size > 1]
        if not dims:
            boxes.append((offsets, sizes))
            continue
        d = generator.choice(dims)
        cut = generator.randint(1, sizes[d] - 1)
        boxes.append((offsets, sizes[:d] + (cut,) + sizes[d + 1 :]))
        boxes.append(
            (offsets[:d] + (offsets[d] + cut,) + offsets[d + 1 :], sizes[:d] + (sizes[d] - cut,) + sizes[d + 1 :])
        )
    return boxes


def damaged(generator: random.Random, boxes: list, shape: tuple[int, ...]) -> list:
    """The tiling with one box moved, grown, shrunk, dropped or duplicated elsewhere (staying in bounds)."""
    boxes = list(boxes)
    index = generator.randrange(len(boxes))
    offsets, sizes = boxes[index]
    d = generator.randrange(len(shape))
    change = generator.choice(["move", "grow", "shrink", "drop", "extra"])
    if change == "drop":
        boxes.pop(index)
    elif change == "extra":
        start = tuple(generator.randrange(extent) for extent in shape)
        boxes.append((start, tuple(generator.randint(1, extent - at) for at, extent in zip(start, shape))))
    else:
        offset, size = offsets[d], sizes[d]
        if change == "move":
            offset = generator.randint(0, shape[d] - size)
        elif change == "grow":
            size = generator.randint(size, shape[d] - offset)
        else:
            size = generator.randint(1, size)
        boxes[index] = (offsets[:d] + (offset,) + offsets[d + 1 :], sizes[:d] + (size,) + sizes[d + 1 :])
    return boxes


def check_like_brute_force(boxes: list, shape: tuple[int, ...]) -> None:
    chunks = [Chunk(rank, offsets, sizes) for rank, (offsets, sizes) in enumerate(boxes)]
    world_size = max(len(chunks), 1)
    distinct = sorted(set(boxes))
    counts = covering_counts(distinct, shape)
    tiles = all(count == 1 for count in counts.values())
    if tiles:
        validation.validate_layout(one_tensor_layout(chunks, shape, world_size))
        return
    expected = "chunks overlap" if brute_force_overlap(distinct) else "chunks cover .* they leave a gap at element"
    with pytest.raises(ValueError, match=expected) as error:
        validation.validate_layout(one_tensor_layout(chunks, shape, world_size))
    point = json.loads(str(error.value).split("element ")[1].split("]")[0] + "]")
    wrong = min(p for p, count in counts.items() if count != 1)
    assert tuple(point) == wrong, (boxes, str(error.value))  # the first element covered other than once
    if counts[wrong] > 1:
        assert str(error.value).count("offsets") == 2


@pytest.mark.parametrize("dims", [1, 2, 3, 4])
def test_tiling_check_agrees_with_counting_every_element(dims: int):
    """Exact tilings are accepted; the same tilings damaged are refused, naming the first element covered other than
    once and (for an overlap) two chunks holding it, compared with visiting every element."""
    generator = random.Random(dims)
    for _ in range(150):
        shape = tuple(generator.randint(1, 6 if dims < 4 else 4) for _ in range(dims))
        tiling = random_tiling(generator, shape, generator.randint(1, 12))
        check_like_brute_force(tiling, shape)
        check_like_brute_force(damaged(generator, tiling, shape), shape)
        replicas = [*tiling, *generator.sample(tiling, k=min(2, len(tiling)))]
        check_like_brute_force(replicas, shape)


def pinwheel(depth: int) -> list:
    """Five boxes tiling a 3 x 3 face that no straight cut separates, stretched along a third dim."""
    face = [((0, 0), (2, 1)), ((2, 0), (1, 2)), ((1, 2), (2, 1)), ((0, 1), (1, 2)), ((1, 1), (1, 1))]
    return [((0, *offsets), (depth, *sizes)) for offsets, sizes in face]


def staircase(dims: int) -> list:
    """A corner cell of a 2 x ... x 2 tensor plus one slab per dim: every chunk ends inside the tensor in many dims."""
    boxes = [((0,) * dims, (1,) * dims)]
    for d in range(dims):
        boxes.append(((0,) * d + (1,) + (0,) * (dims - d - 1), (1,) * d + (1,) + (2,) * (dims - d - 1)))
    return boxes


@pytest.mark.parametrize(
    ("boxes", "shape"),
    [
        (pinwheel(2), (2, 3, 3)),
        (staircase(4), (2, 2, 2, 2)),
        ([((0, 0, 0), (2, 4, 1)), ((0, 0, 1), (2, 2, 3)), ((0, 2, 1), (2, 2, 3))], (2, 4, 4)),
    ],
)
def test_tilings_no_straight_cut_separates_are_checked_exactly(boxes: list, shape: tuple[int, ...]):
    check_like_brute_force(boxes, shape)
    for index in range(len(boxes)):  # each chunk shifted by one along each dim where it fits
        offsets, sizes = boxes[index]
        for d in range(len(shape)):
            for step in (-1, 1):
                if offsets[d] + step >= 0 and offsets[d] + step + sizes[d] <= shape[d]:
                    moved = (offsets[:d] + (offsets[d] + step,) + offsets[d + 1 :], sizes)
                    check_like_brute_force([*boxes[:index], moved, *boxes[index + 1 :]], shape)


def chunks_sharing_dim0(n: int, dims: int) -> tuple[list[Chunk], tuple[int, ...]]:
    """``n`` slabs along dim 1 that all span every other dim: any two overlap in every dim but one."""
    shape = (4, n, *(3 for _ in range(dims - 2)))
    return [Chunk(i, (0, i, *(0 for _ in shape[2:])), (4, 1, *shape[2:])) for i in range(n)], shape


def grid_chunks(n: int, dims: int) -> tuple[list[Chunk], tuple[int, ...]]:
    """About ``n`` unit cells of a grid, cut in every dim."""
    side = round(n ** (1 / dims))
    shape = (side,) * dims
    cells = itertools.product(*(range(side) for _ in range(dims)))
    return [Chunk(i, cell, (1,) * dims) for i, cell in enumerate(cells)], shape


def lines_run(layout: Layout) -> int:
    """Python lines executed inside ``lightning_sink.layout`` while validating ``layout``: the work done."""
    package = str(Path(validation.__file__).parent)
    lines = 0

    def local(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return local

    def on_call(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(package) else None

    sys.settrace(on_call)
    try:
        validation.validate_layout(layout)
    finally:
        sys.settrace(None)
    return lines


@pytest.mark.parametrize(("make", "dims"), [(chunks_sharing_dim0, 3), (chunks_sharing_dim0, 4), (grid_chunks, 3)])
def test_tiling_work_grows_linearly_with_chunks(make, dims: int):
    """Ten times the chunks is about ten times the work (not a hundred), counted as lines of the check executed."""
    small = lines_run(layout_of(*make(2_000, dims)))
    large = lines_run(layout_of(*make(20_000, dims)))
    assert large <= 15 * small, (small, large)


def layout_of(chunks: list[Chunk], shape: tuple[int, ...]) -> Layout:
    return one_tensor_layout(chunks, shape, len(chunks))


@pytest.mark.parametrize(("make", "dims"), [(chunks_sharing_dim0, 3), (chunks_sharing_dim0, 4), (grid_chunks, 4)])
def test_one_overlap_among_many_chunks_is_found(make, dims: int):
    chunks, shape = make(6_000, dims)
    last = chunks[-1]
    offsets, sizes = list(last.offsets), list(last.sizes)
    offsets[1], sizes[1] = offsets[1] - 1, sizes[1] + 1  # the last chunk stretched back over its neighbour
    stretched = Chunk(last.rank, tuple(offsets), tuple(sizes))
    with pytest.raises(ValueError, match=rf"chunks overlap at element {re.escape(str(offsets))}: offsets"):
        validation.validate_layout(one_tensor_layout([*chunks[:-1], stretched], shape, len(chunks)))


def test_a_chunk_ending_inside_the_tensor_in_too_many_dims_is_refused():
    """Each such dim doubles the chunk's corners to count; sharding never cuts a tensor along nine dims at once."""
    limit = validation.MAX_INNER_DIMS
    check_like_brute_force(staircase(limit), (2,) * limit)  # an exact tiling, accepted
    chunks = [Chunk(rank, *box) for rank, box in enumerate(staircase(limit + 1))]
    with pytest.raises(ValueError, match=r"chunk at offsets \[0(, 0)*\] .* ends inside shape .* in more than 8 dims"):
        validation.validate_layout(layout_of(chunks, (2,) * (limit + 1)))
