"""The layout of a state dict about to be handed to ``torch.distributed.checkpoint.save``, from DTensor metadata.

Callable on any one rank with no communication: the mesh's rank tensor and each DTensor's placements are enough
to compute every rank's chunk. Works with meta tensors and under a fake process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from lightning_sink._torch_compat import flatten_state_dict
from lightning_sink.layout.geometry import chunks_for_placements, placement_to_str, replicated_chunks
from lightning_sink.layout.schema import Layout, MeshLayout, PipelineLayout, TensorLayout
from lightning_sink.layout.validation import validate_layout

__all__ = ["layout_from_state_dict", "flatten_like_dcp", "role_of"]

_OPTIMIZER_PREFIXES = ("optim",)  # Lightning: "optimizer_0", "optimizer_states"; DCP's helpers: "optim"


def flatten_like_dcp(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten exactly as ``dcp.save`` does: top-level Stateful objects to their state dicts, then dotted FQNs."""
    expanded = {key: value.state_dict() if _is_stateful(value) else value for key, value in state_dict.items()}
    flat, _ = flatten_state_dict(expanded)
    return flat


def _is_stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def role_of(fqn: str, parameter_names: Iterable[str] = (), buffer_names: Iterable[str] = ()) -> str:
    """Classify a DCP FQN; with the module's parameter/buffer names, parameters and buffers are told apart."""
    segments = fqn.split(".")
    if segments[0].startswith(_OPTIMIZER_PREFIXES):
        return "optimizer_state"
    if any(fqn.endswith(name) for name in buffer_names):
        return "buffer"
    if any(fqn.endswith(name) for name in parameter_names):
        return "parameter"
    return "parameter" if segments[0] in ("state_dict", "model", "module") else "other"


def layout_from_state_dict(
    state_dict: Mapping[str, Any],
    *,
    world_size: int | None = None,
    pipeline_stage: int | None = None,
    num_stages: int = 1,
    module: torch.nn.Module | None = None,
) -> Layout:
    """The layout of ``state_dict`` (the exact, possibly nested, dict every rank hands to ``dcp.save``).

    Args:
        state_dict: the state dict; DTensor leaves are sharded per their mesh and placements, plain tensors are
            replicated on every rank, other leaves are listed under ``non_tensor_state``.
        world_size: the number of ranks; default: the process group's, else the mesh's size.
        pipeline_stage: this state dict's pipeline stage (default 0 of ``num_stages``).
        module: optional, to label parameters and buffers exactly.
    """
    flat = flatten_like_dcp(state_dict)
    mesh = _main_mesh(flat)
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else len(mesh.flat_ranks())
    stage = 0 if pipeline_stage is None else pipeline_stage
    parameter_names = [name for name, _ in module.named_parameters()] if module is not None else []
    buffer_names = [name for name, _ in module.named_buffers()] if module is not None else []
    tensors: dict[str, TensorLayout] = {}
    non_tensor_state: dict[str, str] = {}
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            non_tensor_state[fqn] = "carried"
            continue
        placements, chunks = _placements_and_chunks(fqn, value, mesh, world_size)
        tensors[fqn] = TensorLayout(
            role=role_of(fqn, parameter_names, buffer_names),
            global_shape=tuple(value.shape),
            dtype=str(value.dtype).removeprefix("torch."),
            placements=placements,
            chunks=chunks,
            stage=stage,
        )
    layout = Layout(
        world_size=world_size,
        mesh=mesh,
        pipeline=PipelineLayout(stage=stage, num_stages=num_stages),
        tensors=tensors,
        non_tensor_state=non_tensor_state,
    )
    return validate_layout(layout, "layout_from_state_dict")


def _main_mesh(flat: Mapping[str, Any]) -> MeshLayout:
    """The mesh with the most dims among the DTensors (FSDP2 + TP: the 2-D mesh; FSDP-only params live on a
    1-D sub-mesh of it); a 1-D mesh of the world when there is no DTensor."""
    meshes = [value.device_mesh for value in flat.values() if isinstance(value, DTensor)]
    if not meshes:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return MeshLayout.one_dimensional(world)
    mesh = max(meshes, key=lambda m: m.ndim)
    names = mesh.mesh_dim_names or tuple(f"dim{index}" for index in range(mesh.ndim))
    return MeshLayout(shape=tuple(mesh.mesh.shape), dim_names=tuple(names), ranks=_tuples(mesh.mesh.tolist()))


def _tuples(node: Any) -> Any:
    return tuple(_tuples(item) for item in node) if isinstance(node, list) else node


def _placements_and_chunks(fqn: str, value: torch.Tensor, mesh: MeshLayout, world_size: int):
    shape = tuple(value.shape)
    if not isinstance(value, DTensor):
        # held by every rank of the mesh this state dict lives on (the world, or a pipeline stage's ranks)
        return tuple("Replicate()" for _ in mesh.shape), replicated_chunks(shape, mesh.flat_ranks())
    placements = _placements_on_main_mesh(fqn, value, mesh)
    return tuple(placement_to_str(p) for p in placements), chunks_for_placements(shape, mesh, placements)


def _placements_on_main_mesh(fqn: str, value: DTensor, mesh: MeshLayout) -> list[Placement]:
    """Express the DTensor's placements on the main mesh: a sub-mesh's missing dims are replicated."""
    own = value.device_mesh
    own_names = own.mesh_dim_names or tuple(f"dim{index}" for index in range(own.ndim))
    if own.ndim == len(mesh.shape):
        if tuple(own.mesh.shape) != mesh.shape:
            raise ValueError(
                f"tensor {fqn!r}: its mesh {tuple(own.mesh.shape)} differs from the checkpoint mesh {mesh.shape}"
            )
        return list(value.placements)
    missing = [name for name in own_names if name not in mesh.dim_names]
    if missing:
        raise ValueError(
            f"tensor {fqn!r} lives on a mesh with dims {list(own_names)}, which are not dims of the checkpoint mesh"
            f" {list(mesh.dim_names)}; name the mesh dims (init_device_mesh(..., mesh_dim_names=...))"
        )
    placements: list[Placement] = [Replicate() for _ in mesh.shape]
    for name, placement in zip(own_names, value.placements):
        placements[mesh.dim_names.index(name)] = placement
    return placements
