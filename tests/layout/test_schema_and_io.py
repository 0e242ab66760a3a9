"""Layout files: JSON round trip, atomic save, and validation errors that name the file and the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_sink.layout import (
    LAYOUT_VERSION,
    Chunk,
    Layout,
    MeshLayout,
    TensorLayout,
    load_layout,
    save_layout,
)


def two_rank_layout() -> Layout:
    weight = TensorLayout(
        role="parameter",
        global_shape=(5, 2),
        dtype="float32",
        placements=("Shard(0)",),
        chunks=(Chunk(0, (0, 0), (3, 2)), Chunk(1, (3, 0), (2, 2))),
    )
    step = TensorLayout(
        role="optimizer_state",
        global_shape=(),
        dtype="float32",
        placements=("Replicate()",),
        chunks=(Chunk(0, (), ()), Chunk(1, (), ())),
    )
    return Layout(
        world_size=2,
        mesh=MeshLayout.one_dimensional(2),
        tensors={"w": weight, "step": step},
        non_tensor_state={"meta.epoch": "carried"},
    )


def test_round_trip_through_a_file(tmp_path: Path):
    layout = two_rank_layout()
    path = save_layout(layout, tmp_path / "layout.json")
    assert load_layout(path) == layout
    assert load_layout(tmp_path) == layout  # a folder means <folder>/layout.json
    assert [p.name for p in tmp_path.iterdir()] == ["layout.json"]  # no temp file left behind
    data = json.loads(path.read_text())
    assert data["format"] == "lightning-sink-layout" and data["version"] == LAYOUT_VERSION
    assert data["tensors"]["w"]["chunks"][1] == {"rank": 1, "offsets": [3, 0], "sizes": [2, 2]}


def test_mesh_coordinates_follow_the_nested_rank_order():
    mesh = MeshLayout(shape=(2, 2), dim_names=("dp", "tp"), ranks=((0, 2), (1, 3)))
    assert mesh.coordinates() == {0: (0, 0), 2: (0, 1), 1: (1, 0), 3: (1, 1)}


def edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(version=99), "unknown layout schema version 99"),
        (lambda d: d.update(format="something"), "not a layout file"),
        (lambda d: d["tensors"]["w"].update(dtype="float33"), "tensor 'w': unknown dtype 'float33'"),
        (lambda d: d["tensors"]["w"]["chunks"][1].update(offsets=[2, 0]), "tensor 'w': chunks overlap"),
        (lambda d: d["tensors"]["w"]["chunks"][1].update(sizes=[1, 2]), "tensor 'w': chunks cover 8 of 10"),
        (lambda d: d["tensors"]["w"]["chunks"][1].update(sizes=[3, 2]), "tensor 'w': chunk of rank 1 .* out of bounds"),
        (
            lambda d: d["tensors"]["w"]["chunks"][1].update(rank=2),
            "tensor 'w': chunk rank 2 is outside the world size 2",
        ),
        (lambda d: d["tensors"]["w"].update(global_shape=[5]), "tensor 'w': chunk of rank 0 has offsets"),
        (lambda d: d["tensors"]["w"].update(placements=["Partial()"]), "tensor 'w': unknown placement 'Partial\\(\\)'"),
        (lambda d: d["tensors"]["w"].update(placements=["Shard(0)", "Shard(1)"]), "tensor 'w': 2 placements"),
        (lambda d: d["tensors"]["step"].update(role="weights"), "tensor 'step': role 'weights'"),
        (lambda d: d["mesh"].update(ranks=[0, 0]), "lists a rank twice"),
        (lambda d: d.pop("mesh"), "malformed: missing or wrong field 'mesh'"),
    ],
)
def test_invalid_layout_files_are_rejected_naming_file_and_tensor(tmp_path: Path, change, message: str):
    path = save_layout(two_rank_layout(), tmp_path / "layout.json")
    edit(path, change)
    with pytest.raises(ValueError, match=message) as error:
        load_layout(path)
    assert str(path) in str(error.value)


def test_not_json_and_missing_file(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        load_layout(bad)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_layout(tmp_path / "nope.json")


def test_replicas_may_repeat_a_chunk_but_not_partially_overlap():
    from lightning_sink.layout import validate_layout

    layout = two_rank_layout()
    replicated = TensorLayout(
        role="buffer",
        global_shape=(4,),
        dtype="int64",
        placements=("Replicate()",),
        chunks=(Chunk(0, (0,), (4,)), Chunk(1, (0,), (4,))),
    )
    validate_layout(Layout(layout.world_size, layout.mesh, {"r": replicated}))


def test_save_refuses_an_invalid_layout_and_keeps_the_old_file(tmp_path: Path):
    path = save_layout(two_rank_layout(), tmp_path / "layout.json")
    before = path.read_text()
    broken = TensorLayout(
        role="parameter", global_shape=(4,), dtype="float32", placements=None, chunks=(Chunk(0, (0,), (3,)),)
    )
    with pytest.raises(ValueError, match="tensor 'x': chunks cover 3 of 4"):
        save_layout(Layout(2, MeshLayout.one_dimensional(2), {"x": broken}), path)
    assert path.read_text() == before
