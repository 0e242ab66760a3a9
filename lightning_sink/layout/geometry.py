"""Pure geometry: which box of a global tensor each mesh coordinate holds, from placements alone.

No process group and no communication: the same function gives every rank's chunk on any one process (also
under a fake process group or with meta tensors). The per-coordinate rule is torch's own
``_compute_local_shape_and_global_offset`` (the rule DTensor uses to tell DCP each rank's chunk), so the chunks
here are exactly the chunks DCP writes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from lightning_sink._torch_compat import StridedShard, compute_local_shape_and_global_offset
from lightning_sink.layout.schema import Chunk, MeshLayout

__all__ = ["placement_to_str", "parse_placement", "chunk_at", "chunks_for_placements", "replicated_chunks"]

_SHARD = re.compile(r"^Shard\((\d+)\)$")
_STRIDED = re.compile(r"^_StridedShard\((\d+),\s*sf=(\d+)\)$")


def placement_to_str(placement: Placement) -> str:
    """``Shard(0)``, ``Replicate()`` or ``_StridedShard(0,sf=2)``; ValueError for placements a checkpoint cannot hold."""
    if isinstance(placement, StridedShard):  # check first: it is a subclass of Shard in some torch versions
        return f"_StridedShard({placement.dim},sf={int(placement.split_factor)})"
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    raise ValueError(
        f"placement {placement!r} cannot be stored in a layout (valid: Shard(d), Replicate(), _StridedShard(d,sf=k));"
        " a Partial tensor must be reduced before it is checkpointed"
    )


def parse_placement(text: str) -> Placement:
    """The inverse of :func:`placement_to_str`."""
    if text == "Replicate()":
        return Replicate()
    if match := _SHARD.match(text):
        return Shard(int(match.group(1)))
    if match := _STRIDED.match(text):
        return StridedShard(int(match.group(1)), split_factor=int(match.group(2)))
    raise ValueError(f"unknown placement {text!r} (valid: 'Replicate()', 'Shard(d)', '_StridedShard(d,sf=k)')")


def chunk_at(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], coordinate: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the box the rank at ``coordinate`` holds."""
    sizes, offsets = compute_local_shape_and_global_offset(
        tuple(global_shape), tuple(mesh_shape), list(coordinate), list(placements)
    )
    # An empty shard reports the end of the dim as its offset; keep it in bounds and canonical.
    return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)


def chunks_for_placements(
    global_shape: Sequence[int], mesh: MeshLayout, placements: Sequence[Placement]
) -> tuple[Chunk, ...]:
    """Every rank's chunk (replicas included), in rank order."""
    coordinates = mesh.coordinates()
    return tuple(
        Chunk(rank, *chunk_at(global_shape, mesh.shape, placements, coordinates[rank])) for rank in sorted(coordinates)
    )


def replicated_chunks(global_shape: Sequence[int], ranks: Sequence[int]) -> tuple[Chunk, ...]:
    """A plain tensor: the whole of it on every rank."""
    offsets = tuple(0 for _ in global_shape)
    return tuple(Chunk(rank, offsets, tuple(global_shape)) for rank in ranks)
