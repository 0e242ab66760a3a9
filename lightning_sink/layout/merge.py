"""Merge per-pipeline-stage layout files into one (MindSpore's ``merge_pipeline_strategys``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path

from lightning_sink.layout.io import load_layout, save_layout
from lightning_sink.layout.schema import Layout, MeshLayout, PipelineLayout, TensorLayout

__all__ = ["merge_pipeline_strategies", "merge_layouts"]


def _stage_files(src_strategy_dirs: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """A folder of ``*.json`` stage files, or a list of files / folders holding ``layout.json``."""
    if isinstance(src_strategy_dirs, (str, os.PathLike)):
        folder = Path(src_strategy_dirs)
        if not folder.is_dir():
            raise ValueError(f"src_strategy_dirs={str(folder)!r} is not a folder of per-stage layout files")
        files = sorted(folder.glob("*.json"))
        if not files:
            raise ValueError(f"src_strategy_dirs={str(folder)!r} holds no *.json layout files")
        return files
    return [Path(path) for path in src_strategy_dirs]


def merge_layouts(stages: list[tuple[str, Layout]]) -> Layout:
    """One layout from per-stage layouts (named for errors); rejects gaps, duplicate stages and overlaps."""
    if not stages:
        raise ValueError("no stage layouts to merge")
    first_name, first = stages[0]
    num_stages = first.pipeline.num_stages
    by_stage: dict[int, str] = {}
    tensors: dict[str, TensorLayout] = {}
    owner: dict[str, str] = {}
    non_tensor_state: dict[str, str] = {}
    for name, layout in stages:
        stage = layout.pipeline.stage
        if layout.pipeline.num_stages != num_stages:
            raise ValueError(
                f"{name}: num_stages {layout.pipeline.num_stages} differs from {first_name}'s {num_stages}"
            )
        if layout.world_size != first.world_size:
            raise ValueError(f"{name}: world size {layout.world_size} differs from {first_name}'s {first.world_size}")
        if stage is None:
            raise ValueError(f"{name}: is already a merged layout (pipeline.stage is null)")
        if stage in by_stage:
            raise ValueError(f"{name}: stage {stage} is also given by {by_stage[stage]}")
        by_stage[stage] = name
        for fqn, tensor in layout.tensors.items():
            if fqn in tensors:
                raise ValueError(f"{name}: tensor {fqn!r} overlaps: it is also in stage file {owner[fqn]}")
            if tensor.stage != stage:
                raise ValueError(f"{name}: tensor {fqn!r} is marked stage {tensor.stage}, in the file of stage {stage}")
            tensors[fqn], owner[fqn] = tensor, name
        non_tensor_state.update(layout.non_tensor_state)
    missing = sorted(set(range(num_stages)) - set(by_stage))
    if missing:
        raise ValueError(f"stage layouts leave a gap: stage(s) {missing} of 0..{num_stages - 1} missing")
    meshes = {layout.pipeline.stage: (name, layout.mesh) for name, layout in stages}
    mesh, tensors = _merged_mesh([meshes[stage] for stage in range(num_stages)], tensors)
    return Layout(
        world_size=first.world_size,
        mesh=mesh,
        tensors=tensors,
        pipeline=PipelineLayout(stage=None, num_stages=num_stages),
        non_tensor_state=non_tensor_state,
    )


def _merged_mesh(
    meshes: list[tuple[str, MeshLayout]], tensors: dict[str, TensorLayout]
) -> tuple[MeshLayout, dict[str, TensorLayout]]:
    """The mesh of all stages: their shared mesh, or, when each stage has its own mesh of its ranks (one shape and
    dim names, disjoint ranks, as pipelining sets them up), those meshes stacked along a leading "pipeline" dim.
    Placements then gain that dim as ``Replicate()``: a tensor's chunks say which stage's ranks hold it."""
    first_name, first = meshes[0]
    if all(mesh == first for _, mesh in meshes):
        return first, tensors
    seen: dict[int, str] = {}
    for name, mesh in meshes:
        if mesh.shape != first.shape or mesh.dim_names != first.dim_names:
            raise ValueError(
                f"{name}: mesh {dict(zip(mesh.dim_names, mesh.shape))} differs from {first_name}'s"
                f" {dict(zip(first.dim_names, first.shape))}: stages need one mesh, or meshes of one"
                " shape over disjoint ranks"
            )
        for rank in mesh.flat_ranks():
            if rank in seen:
                raise ValueError(
                    f"{name}: rank {rank} is also in the mesh of {seen[rank]}: stage meshes must not share ranks"
                )
            seen[rank] = name
    if "pipeline" in first.dim_names:
        raise ValueError(f"{first_name}: a stage mesh may not have a dim named 'pipeline' (the merged mesh adds it)")
    stacked = MeshLayout(
        shape=(len(meshes), *first.shape),
        dim_names=("pipeline", *first.dim_names),
        ranks=tuple(mesh.ranks for _, mesh in meshes),
    )
    widened = {
        fqn: dataclasses.replace(
            tensor, placements=None if tensor.placements is None else ("Replicate()", *tensor.placements)
        )
        for fqn, tensor in tensors.items()
    }
    return stacked, widened


def merge_pipeline_strategies(
    src_strategy_dirs: str | os.PathLike | Iterable[str | os.PathLike], dst_strategy_file: str | os.PathLike
) -> Layout:
    """Merge the per-stage layout files (each holding only its stage's tensors) into ``dst_strategy_file``.

    ``src_strategy_dirs`` is a folder of ``*.json`` stage files, or a list of stage files / folders. Every stage
    0..S-1 must appear exactly once and no tensor may appear in two stages; nothing is written otherwise.
    """
    files = _stage_files(src_strategy_dirs)
    merged = merge_layouts([(f"layout file {str(path)!r}", load_layout(path)) for path in files])
    save_layout(merged, dst_strategy_file)
    return merged
