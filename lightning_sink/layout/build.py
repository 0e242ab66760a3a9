"""Build a target layout: the same tensors as a known layout, placed on another mesh."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lightning_sink.layout.geometry import chunks_for_placements, parse_placement
from lightning_sink.layout.schema import Layout, MeshLayout, PipelineLayout, TensorLayout
from lightning_sink.layout.validation import validate_layout

__all__ = ["layout_on_mesh"]

PlacementRule = Mapping[str, Sequence[str]] | Callable[[str, TensorLayout], Sequence[str]]


def layout_on_mesh(like: Layout, mesh: MeshLayout, placements: PlacementRule, world_size: int | None = None) -> Layout:
    """``like``'s tensors (names, shapes, dtypes, roles, non-tensor state) with ``placements`` on ``mesh``.

    ``placements`` maps each FQN to one placement string per mesh dim, or is a function ``(fqn, tensor) ->``
    placements (e.g. shard every matrix's dim 0, replicate vectors).
    """
    tensors = {}
    for fqn, tensor in like.tensors.items():
        chosen = placements(fqn, tensor) if callable(placements) else placements[fqn]
        parsed = [parse_placement(p) for p in chosen]
        tensors[fqn] = TensorLayout(
            role=tensor.role,
            global_shape=tensor.global_shape,
            dtype=tensor.dtype,
            placements=tuple(chosen),
            chunks=chunks_for_placements(tensor.global_shape, mesh, parsed),
        )
    layout = Layout(
        world_size=world_size or len(mesh.flat_ranks()),
        mesh=mesh,
        tensors=tensors,
        pipeline=PipelineLayout(),
        non_tensor_state=dict(like.non_tensor_state),
    )
    return validate_layout(layout, "layout_on_mesh")
