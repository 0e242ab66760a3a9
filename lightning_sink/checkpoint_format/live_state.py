"""A loaded rank file (``rank_file.load_resharded_checkpoint``) turned back into live state: its shards as
DTensors on the target mesh, or copied into a live state dict as ``dcp.load`` would."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_sink._torch_compat import flatten_state_dict, set_element
from lightning_sink.checkpoint_format.rank_file import unpickle_carried
from lightning_sink.layout.geometry import parse_placement
from lightning_sink.layout.schema import Layout

__all__ = ["to_dtensors", "load_into_state_dict"]


def to_dtensors(checkpoint: Mapping[str, Any], device_mesh) -> dict[str, Any]:
    """The rank's local shards as DTensors on ``device_mesh``, placed as the layout says (no communication).

    The mesh must have the layout's shape and rank order; tensors without placements stay plain tensors.
    """
    layout: Layout = checkpoint["layout"]
    if (
        tuple(device_mesh.mesh.shape) != layout.mesh.shape
        or device_mesh.mesh.flatten().tolist() != layout.mesh.flat_ranks()
    ):
        raise ValueError(f"device_mesh {device_mesh.mesh.tolist()} is not the layout's mesh {list(layout.mesh.ranks)}")
    result = {}
    for fqn, local in checkpoint["tensors"].items():
        tensor = layout.tensors[fqn]
        if tensor.placements is None:
            result[fqn] = local
            continue
        placements = [parse_placement(p) for p in tensor.placements]
        result[fqn] = DTensor.from_local(
            local,
            device_mesh,
            placements,
            run_check=False,
            shape=torch.Size(tensor.global_shape),
            stride=_contiguous(tensor.global_shape),
        )
    return result


def _contiguous(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def load_into_state_dict(
    state_dict: dict[str, Any], checkpoint: Mapping[str, Any], *, strict: bool = True, weights_only: bool = True
) -> dict[str, Any]:
    """Fill a live state dict (as handed to ``dcp.load``) in place from a resharded rank file, like ``dcp.load``.

    DTensor leaves get their local shard copied in (their placements must give this rank the file's chunk);
    plain tensors get the full value; non-tensor leaves are replaced by the carried values.
    """
    flat, mapping = flatten_state_dict(state_dict)
    tensors, carried = checkpoint["tensors"], checkpoint.get("non_tensor_state", {})
    missing = [fqn for fqn in flat if fqn not in tensors and fqn not in carried]
    if strict and missing:
        raise ValueError(f"resharded checkpoint of rank {checkpoint.get('rank')} lacks {missing[:10]}")
    for fqn, value in flat.items():
        if fqn in tensors:
            local = value.to_local() if isinstance(value, DTensor) else value
            if not isinstance(local, torch.Tensor) or tuple(local.shape) != tuple(tensors[fqn].shape):
                raise ValueError(
                    f"tensor {fqn!r}: the live local shard is {getattr(local, 'shape', type(local))},"
                    f" the file holds {list(tensors[fqn].shape)}: the live layout differs from the file's"
                )
            with torch.no_grad():
                local.copy_(tensors[fqn])
        elif fqn in carried:
            set_element(state_dict, mapping[fqn], unpickle_carried(carried[fqn], weights_only=weights_only))
    return state_dict
