"""Layout files from untrusted hands: bounded work and memory, and one ValueError naming the file for any damage."""

from __future__ import annotations

import itertools
import json
import random
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


def brute_force_overlap(boxes) -> bool:
    return any(
        all(max(a, b) < min(a + sa, b + sb) for a, sa, b, sb in zip(x[0], x[1], y[0], y[1]))
        for x, y in itertools.combinations(boxes, 2)
    )


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_overlap_sweep_agrees_with_comparing_every_pair(dims: int):
    generator = random.Random(dims)
    for _ in range(300):
        boxes = []
        for _ in range(generator.randint(2, 7)):
            offsets = tuple(generator.randint(0, 6) for _ in range(dims))
            boxes.append((offsets, tuple(generator.randint(1, 4) for _ in range(dims))))
        boxes = sorted(set(boxes))
        assert (validation._first_overlap(boxes) is not None) == brute_force_overlap(boxes), boxes


@pytest.mark.parametrize("pattern", ["rows", "columns", "grid", "rows_and_columns"])
def test_tiling_check_compares_each_chunk_with_few_others(pattern: str, monkeypatch):
    """6,000 chunks of one matrix: the check compares O(1) neighbours per chunk, not every pair (18M)."""
    n = 6000
    if pattern == "rows":
        chunks, shape = [Chunk(i, (i, 0), (1, 8)) for i in range(n)], (n, 8)
    elif pattern == "columns":
        chunks, shape = [Chunk(i, (0, i), (8, 1)) for i in range(n)], (8, n)
    elif pattern == "grid":
        chunks, shape = [Chunk(i, (i // 60, i % 60), (1, 1)) for i in range(n)], (100, 60)
    else:  # the left half cut into rows, the right half into columns
        half = n // 2
        chunks = [Chunk(i, (i, 0), (1, half)) for i in range(half)]
        chunks += [Chunk(half + i, (0, half + i), (half, 1)) for i in range(half)]
        shape = (half, n)
    calls = 0
    real = validation._overlaps

    def counting(a, b):
        nonlocal calls
        calls += 1
        return real(a, b)

    monkeypatch.setattr(validation, "_overlaps", counting)
    layout = one_tensor_layout(chunks, shape, n)
    assert validation.validate_layout(layout) is layout
    assert calls <= 2 * n
    overlapping = [*chunks[:-1], Chunk(n - 1, (0, 0), (2, 2))]  # the last chunk moved onto the first
    with pytest.raises(ValueError, match="chunks overlap"):
        validation.validate_layout(one_tensor_layout(overlapping, shape, n))
