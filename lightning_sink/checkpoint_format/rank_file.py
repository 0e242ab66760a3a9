"""The rank-file format: one target rank's part of a resharded checkpoint, ``rank_{r}/{prefix}{r}.pt``.

A rank file is a ``torch.save``'d dict::

    {"format": "lightning-sink-resharded-rank", "version": 1, "rank": r,
     "layout": "<target layout JSON>", "tensors": {fqn: local shard}, "non_tensor_state": {fqn: bytes},
     "extra_files": {"meta.pt": bytes}, "paths": {fqn: [nested keys]}, "provenance": {...}}

Its records carry no CRC-32; its integrity is the SHA-256 listed in the folder's ``MANIFEST.json`` (or, for a file
written alone, in a ``<file>.sha256`` sidecar: ``<hex digest> <bytes>``). Non-tensor state stays the raw
``torch.save`` bytes DCP (or Lightning's ``meta.pt``) held; ``unpickle_carried`` turns it back into objects, with
``weights_only=True`` by default.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_sink.checkpoint_format.fs import sha256_of_file
from lightning_sink.checkpoint_format.manifest import MANIFEST_FILE_NAME, read_manifest
from lightning_sink.error_text import reason_of
from lightning_sink.layout.io import parse_layout
from lightning_sink.layout.schema import Layout
from lightning_sink.layout.validation import torch_dtype
from lightning_sink.regular_file import open_regular, read_regular

__all__ = [
    "RANK_FILE_FORMAT",
    "RANK_FILE_VERSION",
    "RANK_DIR_PATTERN",
    "rank_dir_name",
    "rank_file_name",
    "sidecar_path",
    "expected_digest",
    "load_resharded_checkpoint",
    "load_rank_payload",
    "read_rank_file_header",
    "check_rank_payload",
    "check_loaded_rank_file",
    "unpickle_carried",
]

RANK_FILE_FORMAT = "lightning-sink-resharded-rank"
RANK_FILE_VERSION = 1
RANK_DIR_PATTERN = re.compile(r"^rank_(\d+)$")
_SIDECAR = re.compile(rb"([0-9a-f]{64}) (\d{1,20})\n?")
_SIDECAR_BYTES = 128


def rank_dir_name(rank: int) -> str:
    return f"rank_{rank}"


def rank_file_name(rank: int, prefix: str) -> str:
    """The rank file's path relative to its checkpoint folder, as the manifest lists it."""
    return f"{rank_dir_name(rank)}/{prefix}{rank}.pt"


def sidecar_path(path: Path) -> Path:
    """The ``.sha256`` sidecar of a rank file written on its own."""
    return path.with_name(path.name + ".sha256")


def expected_digest(path: Path) -> tuple[str, int] | None:
    """(sha256, bytes) for ``path`` from ``<dst>/MANIFEST.json`` two levels up, or a ``<file>.sha256`` sidecar."""
    folder = path.parent.parent
    if (folder / MANIFEST_FILE_NAME).is_file():
        manifest = read_manifest(folder)
        entry = manifest.files.get(f"{path.parent.name}/{path.name}")
        if entry is not None:
            return entry["sha256"], entry["bytes"]
    sidecar = sidecar_path(path)
    if not os.path.lexists(sidecar):
        return None
    data = read_regular(sidecar, _SIDECAR_BYTES, "digest sidecar")  # a link or FIFO refused, never followed
    match = _SIDECAR.fullmatch(data)
    if match is None:  # (its content is not quoted: it may be anything a link pointed at)
        raise ValueError(f"digest sidecar {str(sidecar)!r} is not '<64 hex digits> <bytes>'")
    return match.group(1).decode(), int(match.group(2))


def load_rank_payload(path: str | os.PathLike) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a rank file, checking its format and version."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"resharded checkpoint file {str(path)!r} does not exist")
    try:
        handle = os.fdopen(open_regular(path), "rb")  # no link followed, no FIFO waited on
    except ValueError as error:
        raise ValueError(f"resharded checkpoint file: {error}") from None
    try:
        with handle:
            payload = torch.load(handle, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(
            f"resharded checkpoint file {str(path)!r} is truncated or corrupt: {reason_of(error)}"
        ) from None
    _check_header(payload, path)
    return payload


def read_rank_file_header(path: Path) -> dict[str, Any]:
    """The rank file's non-tensor parts (layout parsed), reading no tensor data (meta-device load); a ``torch.save``
    file of another kind gives ``{"layout": None}``."""
    try:
        handle = os.fdopen(open_regular(path), "rb")  # no link followed, no FIFO waited on
    except ValueError as error:
        raise ValueError(f"rank file: {error}") from None
    try:
        with handle:
            payload = torch.load(handle, map_location="meta", weights_only=True)
    except Exception as error:
        raise ValueError(f"rank file {str(path)!r} is truncated or corrupt: {reason_of(error)}") from None
    if not isinstance(payload, dict) or payload.get("format") != RANK_FILE_FORMAT:
        return {"layout": None}
    _check_header(payload, path)
    return {**payload, "layout": _embedded_layout(payload, path), "tensors": None}


def _embedded_layout(payload: Mapping[str, Any], path: Path) -> Layout:
    """The layout a rank file embeds, validated like any layout file."""
    text = payload.get("layout")
    if not isinstance(text, str):
        raise ValueError(f"rank file {str(path)!r}: its embedded layout is not JSON text")
    return parse_layout(text, f"rank file {str(path)!r}: embedded layout")


def _check_header(payload: Any, path: Path) -> None:
    if not isinstance(payload, dict) or payload.get("format") != RANK_FILE_FORMAT:
        raise ValueError(f"{str(path)!r} is not a lightning-sink resharded checkpoint file")
    if payload.get("version") != RANK_FILE_VERSION:
        raise ValueError(
            f"{str(path)!r}: unknown resharded file version {payload.get('version')!r} (this reads {RANK_FILE_VERSION})"
        )
    rank = payload.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"rank file {str(path)!r}: 'rank' is not a rank number")
    for key, kind in _HEADER_FIELDS.items():
        value = payload.get(key)
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, kind) for k, v in value.items()):
            raise ValueError(f"rank file {str(path)!r}: {key!r} is not a map of names to {kind.__name__}")


# The header fields of a rank file and the kind of value each maps its names to ("tensors": torch.Tensor, checked
# where they are read).
_HEADER_FIELDS: dict[str, type] = {
    "tensors": torch.Tensor,
    "non_tensor_state": bytes,
    "extra_files": bytes,
    "paths": list,
    "provenance": object,
}


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


def check_loaded_rank_file(payload: Any, layout: Layout, rank: int, path: Path, layout_json: str | None = None) -> None:
    """Every check ``verify_checkpoint`` (against the folder's ``layout``) and ``load_resharded_checkpoint`` (against
    the embedded layout) make of a loaded rank file of target ``rank``, but its SHA-256: its writer runs them on the
    file it is writing, so that no conversion commits a file its own ``verify`` refuses. ``layout_json``: the text
    of ``layout`` when the caller has it (an embedded layout of that very text is ``layout``, not parsed again)."""
    _check_header(payload, path)
    if payload["rank"] != rank:
        raise ValueError(f"rank file {str(path)!r}: 'rank' is {payload['rank']}, written for rank {rank}")
    if layout_json is None or payload.get("layout") != layout_json:
        check_rank_payload(payload, _embedded_layout(payload, path), rank, str(path))
    check_rank_payload(payload, layout, rank, str(path))


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
    layout = _embedded_layout(payload, path)
    check_rank_payload(payload, layout, payload["rank"], str(path))
    return {**payload, "layout": layout}


def unpickle_carried(data: bytes, *, weights_only: bool = True) -> Any:
    """A carried non-tensor value (``torch.save`` bytes) back to an object."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
