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
        name: TensorLayout(role="parameter", global_shape=(4,), dtype="float32", placements=("Replicate()", "Shard(0)"),
                           chunks=(Chunk(ranks[0], (0,), (2,)), Chunk(ranks[1], (2,), (2,))), stage=stage)
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
    files = [save_layout(stage_layout(0, ["a"]), tmp_path / "s0.json"),
             save_layout(stage_layout(1, ["a"]), tmp_path / "s1.json")]
    with pytest.raises(ValueError, match="s1.json.*tensor 'a' overlaps.*s0.json"):
        merge_pipeline_strategies(files, tmp_path / "merged.json")
    assert not (tmp_path / "merged.json").exists()


def test_a_missing_stage_is_a_gap(tmp_path: Path):
    files = [save_layout(stage_layout(0, ["a"], num_stages=3), tmp_path / "s0.json"),
             save_layout(stage_layout(1, ["b"], num_stages=3), tmp_path / "s1.json")]
    with pytest.raises(ValueError, match=r"gap: stage\(s\) \[2\] of 0..2 missing"):
        merge_pipeline_strategies(files, tmp_path / "merged.json")
    assert not (tmp_path / "merged.json").exists()


def test_the_same_stage_twice_is_rejected(tmp_path: Path):
    files = [save_layout(stage_layout(0, ["a"]), tmp_path / "s0.json"),
             save_layout(stage_layout(0, ["b"]), tmp_path / "again.json")]
    with pytest.raises(ValueError, match="again.json.*stage 0 is also given by .*s0.json"):
        merge_pipeline_strategies(files, tmp_path / "merged.json")
