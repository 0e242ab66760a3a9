"""The layout (strategy) file: which slice of which tensor every rank holds, as versioned JSON.

A layout is plain data: it can be read, validated and compared without torch.distributed. The JSON form is
documented in docs/layout.md (schema version 1).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from lightning_sink.layout.bounded_json import loads_bounded

__all__ = [
    "LAYOUT_FORMAT",
    "LAYOUT_VERSION",
    "LAYOUT_FILE_NAME",
    "TENSOR_ROLES",
    "Chunk",
    "TensorLayout",
    "MeshLayout",
    "PipelineLayout",
    "Layout",
]

LAYOUT_FORMAT = "lightning-sink-layout"
LAYOUT_VERSION = 1
LAYOUT_FILE_NAME = "layout.json"
TENSOR_ROLES = ("parameter", "optimizer_state", "buffer", "other")


@dataclass(frozen=True)
class Chunk:
    """The box ``[offsets, offsets + sizes)`` of the global tensor that ``rank`` holds."""

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.sizes:
            count *= size
        return count

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.offsets, self.sizes

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "offsets": list(self.offsets), "sizes": list(self.sizes)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Chunk:
        return cls(rank=data["rank"], offsets=tuple(data["offsets"]), sizes=tuple(data["sizes"]))


@dataclass(frozen=True)
class TensorLayout:
    """One tensor: its global shape and dtype, its placement on each mesh dim, and every rank's chunk.

    ``placements`` is ``None`` when the layout was derived from storage alone (DCP metadata) and the placements
    are not known; the chunks are then the stored chunks, each under the rank that stored it.
    """

    role: str
    global_shape: tuple[int, ...]
    dtype: str
    placements: tuple[str, ...] | None
    chunks: tuple[Chunk, ...]
    stage: int = 0

    def chunks_of_rank(self, rank: int) -> tuple[Chunk, ...]:
        return tuple(chunk for chunk in self.chunks if chunk.rank == rank)

    def same_tensor_as(self, other: TensorLayout) -> bool:
        """Whether ``other`` describes a tensor of the same global shape and dtype (however it is placed)."""
        return self.global_shape == other.global_shape and self.dtype == other.dtype

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "global_shape": list(self.global_shape),
            "dtype": self.dtype,
            "placements": None if self.placements is None else list(self.placements),
            "chunks": [chunk.to_dict() for chunk in self.chunks],
            "stage": self.stage,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorLayout:
        placements = data.get("placements")
        return cls(
            role=data["role"],
            global_shape=tuple(data["global_shape"]),
            dtype=data["dtype"],
            placements=None if placements is None else tuple(placements),
            chunks=tuple(Chunk.from_dict(chunk) for chunk in data["chunks"]),
            stage=data.get("stage", 0),
        )


@dataclass(frozen=True)
class MeshLayout:
    """The device mesh: its shape, dim names, and the global rank at every coordinate (row-major nesting)."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    ranks: tuple[Any, ...]  # nested tuples of ints, ``shape`` deep

    def flat_ranks(self) -> list[int]:
        flat: list[int] = []

        def walk(node: Any) -> None:
            if isinstance(node, (list, tuple)):
                for item in node:
                    walk(item)
            else:
                flat.append(node)

        walk(self.ranks)
        return flat

    def coordinates(self) -> dict[int, tuple[int, ...]]:
        """Global rank -> its coordinate in the mesh."""
        coordinates: dict[int, tuple[int, ...]] = {}
        for index, rank in enumerate(self.flat_ranks()):
            coordinate = []
            for size in reversed(self.shape):
                coordinate.append(index % size)
                index //= size
            coordinates[rank] = tuple(reversed(coordinate))
        return coordinates

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dim_names": list(self.dim_names), "ranks": _to_lists(self.ranks)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeshLayout:
        return cls(shape=tuple(data["shape"]), dim_names=tuple(data["dim_names"]), ranks=_to_tuples(data["ranks"]))

    @classmethod
    def one_dimensional(cls, world_size: int, dim_name: str = "world") -> MeshLayout:
        return cls(shape=(world_size,), dim_names=(dim_name,), ranks=tuple(range(world_size)))


@dataclass(frozen=True)
class PipelineLayout:
    """Which pipeline stage this layout describes; ``stage=None`` means all stages (a merged layout)."""

    stage: int | None = 0
    num_stages: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "num_stages": self.num_stages}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineLayout:
        return cls(stage=data["stage"], num_stages=data["num_stages"])


@dataclass(frozen=True)
class Layout:
    """A whole checkpoint's layout: world size, mesh, pipeline stage, tensors by DCP FQN, non-tensor state."""

    world_size: int
    mesh: MeshLayout
    tensors: Mapping[str, TensorLayout]
    pipeline: PipelineLayout = field(default_factory=PipelineLayout)
    non_tensor_state: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LAYOUT_FORMAT,
            "version": LAYOUT_VERSION,
            "world_size": self.world_size,
            "mesh": self.mesh.to_dict(),
            "pipeline": self.pipeline.to_dict(),
            "tensors": {fqn: tensor.to_dict() for fqn, tensor in sorted(self.tensors.items())},
            "non_tensor_state": dict(sorted(self.non_tensor_state.items())),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Build from the JSON object (format and version checked here; call ``validate_layout`` for the rest)."""
        if not isinstance(data, Mapping) or data.get("format") != LAYOUT_FORMAT:
            found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"not a layout file: format is {found!r}, expected {LAYOUT_FORMAT!r}")
        if data.get("version") != LAYOUT_VERSION:
            raise ValueError(
                f"unknown layout schema version {data.get('version')!r}; this lightning-sink reads version"
                f" {LAYOUT_VERSION}"
            )
        try:
            return cls(
                world_size=data["world_size"],
                mesh=MeshLayout.from_dict(_mapping(data["mesh"], "mesh")),
                pipeline=PipelineLayout.from_dict(
                    _mapping(data.get("pipeline", {"stage": 0, "num_stages": 1}), "pipeline")
                ),
                tensors={
                    fqn: TensorLayout.from_dict(_mapping(tensor, f"tensors[{fqn!r}]"))
                    for fqn, tensor in _mapping(data["tensors"], "tensors").items()
                },
                non_tensor_state=dict(_mapping(data.get("non_tensor_state", {}), "non_tensor_state")),
            )
        except (KeyError, TypeError, AttributeError) as error:  # a field missing, or of the wrong kind
            raise ValueError(f"malformed: missing or wrong field {error}") from None

    @classmethod
    def from_json(cls, text: str) -> Layout:
        # any JSON value: from_dict refuses what is not a mapping (one ValueError)
        return cls.from_dict(cast(Mapping[str, Any], loads_bounded(text, "layout JSON")))


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name!r} must be an object, not {type(value).__name__}")
    return value


def _to_lists(node: Any) -> Any:
    return [_to_lists(item) for item in node] if isinstance(node, (list, tuple)) else node


def _to_tuples(node: Any) -> Any:
    return tuple(_to_tuples(item) for item in node) if isinstance(node, (list, tuple)) else node
