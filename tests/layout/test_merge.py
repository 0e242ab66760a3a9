"""merge_pipeline_strategies: per-stage layout files into one; gaps, duplicates and overlaps rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sink.layout import (
    Chunk,
    Layout,
    MeshLayout,
    PipelineLayout,
    TensorLayout,
    load_layout,
    merge_pipeline_strategies,
    save_layout,
)

MESH = MeshLayout(shape=(2, 2), dim_names=("pp", "dp"), ranks=((0, 1), (2, 3)))


def stage_layout(stage: int, names: list[str], num_stages: int = 2) -> Layout:
    ranks = [r for r, c in MESH.coordinates().items() if c[0] == stage]
    tensors = {
        name: TensorLayout(
            role="parameter",
            global_shape=(4,),
            dtype="float32",
            placements=("Replicate()", "Shard(0)"),
            chunks=(Chunk(ranks[0], (0,), (2,)), Chunk(ranks[1], (2,), (2,))),
            stage=stage,
        )
        for name in names
    }
    return Layout(world_size=4, mesh=MESH, tensors=tensors, pipeline=PipelineLayout(stage, num_stages))


def test_merges_every_stage_into_one_layout(tmp_path: Path):
    save_layout(stage_layout(0, ["a", "b"]), tmp_path / "stages" / "stage0.json")
    save_layout(stage_layout(1, ["c"]), tmp_path / "stages" / "stage1.json")
    merged = merge_pipeline_strategies(tmp_path / "stages", tmp_path / "merged.json")
    assert load_layout(tmp_path / "merged.json") == merged
    assert set(merged.tensors) == {"a", "b", "c"}
    assert merged.tensors["c"].stage == 1 and merged.tensors["c"].chunks[0].rank == 2
    assert merged.pipeline == PipelineLayout(stage=None, num_stages=2)


def test_a_tensor_in_two_stages_is_an_overlap(tmp_path: Path):
    files = [
        save_layout(stage_layout(0, ["a"]), tmp_path / "s0.json"),
        save_layout(stage_layout(1, ["a"]), tmp_path / "s1.json"),
    ]
    with pytest.raises(ValueError, match="s1.json.*tensor 'a' overlaps.*s0.json"):
        merge_pipeline_strategies(files, tmp_path / "merged.json")
    assert not (tmp_path / "merged.json").exists()


def test_a_missing_stage_is_a_gap(tmp_path: Path):
    files = [
        save_layout(stage_layout(0, ["a"], num_stages=3), tmp_path / "s0.json"),
        save_layout(stage_layout(1, ["b"], num_stages=3), tmp_path / "s1.json"),
    ]
    with pytest.raises(ValueError, match=r"gap: stage\(s\) \[2\] of 0..2 missing"):
        merge_pipeline_strategies(files, tmp_path / "merged.json")
    assert not (tmp_path / "merged.json").exists()


def test_the_same_stage_twice_is_rejected(tmp_path: Path):
    files = [
        save_layout(stage_layout(0, ["a"]), tmp_path / "s0.json"),
        save_layout(stage_layout(0, ["b"]), tmp_path / "again.json"),
    ]
    with pytest.raises(ValueError, match="again.json.*stage 0 is also given by .*s0.json"):
        merge_pipeline_strategies(files, tmp_path / "merged.json")


def own_mesh_stage(stage: int, ranks: tuple[tuple[int, ...], ...], names: list[str]) -> Layout:
    """A stage whose tensors live on its own 2-D mesh (dp x tp) of its ranks, as pipelining sets stages up."""
    mesh = MeshLayout(shape=(2, 2), dim_names=("dp", "tp"), ranks=ranks)
    flat = [rank for row in ranks for rank in row]
    tensors = {
        name: TensorLayout(
            role="parameter",
            global_shape=(4, 2),
            dtype="float32",
            placements=("Replicate()", "Shard(0)"),
            chunks=tuple(Chunk(rank, ((index % 2) * 2, 0), (2, 2)) for index, rank in enumerate(flat)),
            stage=stage,
        )
        for name in names
    }
    return Layout(world_size=8, mesh=mesh, tensors=tensors, pipeline=PipelineLayout(stage, 2))


def test_stages_on_their_own_meshes_merge_into_a_mesh_with_a_pipeline_dim(tmp_path: Path):
    files = [
        save_layout(own_mesh_stage(0, ((0, 1), (2, 3)), ["a"]), tmp_path / "s0.json"),
        save_layout(own_mesh_stage(1, ((4, 5), (6, 7)), ["b"]), tmp_path / "s1.json"),
    ]
    merged = merge_pipeline_strategies(files, tmp_path / "merged.json")
    assert merged.mesh == MeshLayout(
        shape=(2, 2, 2), dim_names=("pipeline", "dp", "tp"), ranks=(((0, 1), (2, 3)), ((4, 5), (6, 7)))
    )
    assert merged.tensors["b"].placements == ("Replicate()", "Replicate()", "Shard(0)")
    assert sorted(chunk.rank for chunk in merged.tensors["b"].chunks) == [4, 5, 6, 7]  # only stage 1 holds b
    assert load_layout(tmp_path / "merged.json") == merged  # and it validates as a layout


def test_stage_meshes_sharing_ranks_are_rejected(tmp_path: Path):
    files = [
        save_layout(own_mesh_stage(0, ((0, 1), (2, 3)), ["a"]), tmp_path / "s0.json"),
        save_layout(own_mesh_stage(1, ((2, 3), (4, 5)), ["b"]), tmp_path / "s1.json"),
    ]
    with pytest.raises(ValueError, match=r"rank 2 is also in the mesh of .*s0.json"):
        merge_pipeline_strategies(files, tmp_path / "merged.json")
    assert not (tmp_path / "merged.json").exists()


def test_stage_meshes_of_different_shapes_are_rejected(tmp_path: Path):
    other = Layout(
        world_size=8,
        mesh=MeshLayout(shape=(4,), dim_names=("dp",), ranks=(4, 5, 6, 7)),
        tensors={
            "b": TensorLayout(
                "parameter",
                (4,),
                "float32",
                ("Shard(0)",),
                tuple(Chunk(r, (i,), (1,)) for i, r in enumerate((4, 5, 6, 7))),
                stage=1,
            )
        },
        pipeline=PipelineLayout(1, 2),
    )
    files = [
        save_layout(own_mesh_stage(0, ((0, 1), (2, 3)), ["a"]), tmp_path / "s0.json"),
        save_layout(other, tmp_path / "s1.json"),
    ]
    with pytest.raises(ValueError, match=r"s1.json.*mesh \{'dp': 4\} differs from .*s0.json.*\{'dp': 2, 'tp': 2\}"):
        merge_pipeline_strategies(files, tmp_path / "merged.json")
