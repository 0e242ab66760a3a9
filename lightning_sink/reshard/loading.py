"""Loading a resharded rank file (digest-checked, ``weights_only=True``) and turning it back into live state.

A rank file is a ``torch.save``'d dict::

    {"format": "lightning-sink-resharded-rank", "version": 1, "rank": r,
     "layout": "<target layout JSON>", "tensors": {fqn: local shard}, "non_tensor_state": {fqn: bytes},
     "extra_files": {"meta.pt": bytes}, "paths": {fqn: [nested keys]}, "provenance": {...}}

Non-tensor state stays the raw ``torch.save`` bytes DCP (or Lightning's ``meta.pt``) held; ``unpickle_carried``
turns it back into objects, with ``weights_only=True`` by default.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_sink.layout.schema import Layout
from lightning_sink.layout.validation import torch_dtype
from lightning_sink.reshard.manifest import MANIFEST_FILE_NAME, read_manifest
from lightning_sink.reshard.source import RESHARDED_FORMAT
from lightning_sink.reshard.writer import sha256_of_file

__all__ = [
    "RESHARDED_VERSION",
    "load_resharded_checkpoint",
    "load_rank_payload",
    "read_rank_file_header",
    "check_rank_payload",
    "to_dtensors",
    "load_into_state_dict",
    "unpickle_carried",
    "expected_digest",
]

RESHARDED_VERSION = 1


def expected_digest(path: Path) -> tuple[str, int] | None:
    """(sha256, bytes) for ``path`` from ``<dst>/MANIFEST.json`` two levels up, or a ``<file>.sha256`` sidecar."""
    folder = path.parent.parent
    if (folder / MANIFEST_FILE_NAME).is_file():
        manifest = read_manifest(folder)
        entry = manifest.files.get(f"{path.parent.name}/{path.name}")
        if entry is not None:
            return entry["sha256"], entry["bytes"]
    sidecar = path.with_name(path.name + ".sha256")
    if sidecar.is_file():
        digest, _, size = sidecar.read_text().strip().partition(" ")
        return digest, int(size)
    return None


def load_rank_payload(path: str | os.PathLike) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a rank file, checking its format and version."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"resharded checkpoint file {str(path)!r} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(f"resharded checkpoint file {str(path)!r} is truncated or corrupt: {error}") from None
    _check_header(payload, path)
    return payload


def read_rank_file_header(path: Path) -> dict[str, Any]:
    """The rank file's non-tensor parts (layout parsed), reading no tensor data (meta-device load)."""
    try:
        payload = torch.load(path, map_location="meta", weights_only=True)
    except Exception as error:
        raise ValueError(f"rank file {str(path)!r} is truncated or corrupt: {error}") from None
    if not isinstance(payload, dict) or payload.get("format") != RESHARDED_FORMAT:
        return {"layout": None}
    _check_header(payload, path)
    return {**payload, "layout": Layout.from_json(payload["layout"]), "tensors": None}


def _check_header(payload: Any, path: Path) -> None:
    if not isinstance(payload, dict) or payload.get("format") != RESHARDED_FORMAT:
        raise ValueError(f"{str(path)!r} is not a lightning-sink resharded checkpoint file")
    if payload.get("version") != RESHARDED_VERSION:
        raise ValueError(
            f"{str(path)!r}: unknown resharded file version {payload.get('version')!r} (this reads {RESHARDED_VERSION})"
        )


def check_rank_payload(payload: Mapping[str, Any], layout: Layout, rank: int, name: str) -> None:
    """Every tensor the layout gives ``rank`` is present with its chunk's shape and dtype, and nothing else."""
    expected = {fqn: t for fqn, t in layout.tensors.items() if t.chunks_of_rank(rank)}
    tensors = payload["tensors"]
    if set(tensors) != set(expected):
        raise ValueError(
            f"{name}: tensors differ from the layout of rank {rank}: missing"
            f" {sorted(set(expected) - set(tensors))[:5]}, extra {sorted(set(tensors) - set(expected))[:5]}"
        )
    for fqn, tensor in expected.items():
        (chunk,) = tensor.chunks_of_rank(rank)
        value = tensors[fqn]
        if tuple(value.shape) != chunk.sizes or value.dtype != torch_dtype(tensor.dtype):
            raise ValueError(
                f"{name}: tensor {fqn!r} is {list(value.shape)} {value.dtype}, the layout says"
                f" {list(chunk.sizes)} {tensor.dtype}"
            )


def load_resharded_checkpoint(path: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """Load one target rank's file; with ``verify`` its SHA-256 must match the manifest (or sidecar) first.

    Returns the payload dict with ``"layout"`` parsed into a :class:`Layout`.
    """
    path = Path(path)
    if verify:
        if not path.is_file():
            raise FileNotFoundError(f"resharded checkpoint file {str(path)!r} does not exist")
        expected = expected_digest(path)
        if expected is None:
            raise ValueError(
                f"{str(path)!r}: no manifest or .sha256 sidecar to verify against (pass verify=False to skip)"
            )
        if path.stat().st_size != expected[1] or sha256_of_file(path) != expected[0]:
            raise ValueError(
                f"{str(path)!r}: SHA-256 or size differs from the manifest: the file is corrupt or replaced"
            )
    payload = load_rank_payload(path)
    layout = Layout.from_json(payload["layout"])
    check_rank_payload(payload, layout, payload["rank"], str(path))
    return {**payload, "layout": layout}


def unpickle_carried(data: bytes, *, weights_only: bool = True) -> Any:
    """A carried non-tensor value (``torch.save`` bytes) back to an object."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)


def to_dtensors(checkpoint: Mapping[str, Any], device_mesh) -> dict[str, Any]:
    """The rank's local shards as DTensors on ``device_mesh``, placed as the layout says (no communication).

    The mesh must have the layout's shape and rank order; tensors without placements stay plain tensors.
    """
    from torch.distributed.tensor import DTensor

    from lightning_sink.layout.geometry import parse_placement

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
    from torch.distributed.tensor import DTensor

    from lightning_sink._torch_compat import flatten_state_dict, set_element

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
