"""A layout derived from a DCP folder's ``.metadata`` when no layout file was written (e.g. a stock Lightning
``ModelParallelStrategy`` / ``FSDPStrategy`` sharded checkpoint).

The metadata tells which chunks exist and which storage file (``__{rank}_{n}.distcp``) holds each; DCP stores a
replicated chunk once, so each chunk is listed under the rank that stored it. ``.metadata`` is a pickle: it is read
with an unpickler that admits only DCP's metadata classes and a few torch value types, never arbitrary code.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import re
from pathlib import Path
from typing import TypeGuard

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from lightning_sink.counts import is_count
from lightning_sink.error_text import reason_of
from lightning_sink.layout.from_state_dict import role_of
from lightning_sink.layout.pickle_claims import pickle_claim_fault
from lightning_sink.layout.schema import Chunk, Layout, MeshLayout, PipelineLayout, TensorLayout
from lightning_sink.layout.validation import validate_layout
from lightning_sink.regular_file import open_regular

__all__ = [
    "DCP_METADATA_FILE",
    "read_dcp_metadata",
    "read_dcp_metadata_and_digest",
    "storage_rank",
    "layout_from_dcp_metadata",
]

DCP_METADATA_FILE = ".metadata"
_STORAGE_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "strided", "contiguous_format", "channels_last", "preserve_format"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a DCP metadata type")


def read_dcp_metadata(checkpoint_dir: str | os.PathLike) -> Metadata:
    """The DCP ``Metadata`` of ``checkpoint_dir``, loaded without running pickled code."""
    return read_dcp_metadata_and_digest(checkpoint_dir)[0]


def read_dcp_metadata_and_digest(checkpoint_dir: str | os.PathLike) -> tuple[Metadata, str]:
    """The metadata and the SHA-256 of the very bytes it was read from (read once: a file replaced meanwhile cannot
    give one save's metadata under another's digest)."""
    path = Path(checkpoint_dir) / DCP_METADATA_FILE
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"{str(Path(checkpoint_dir))!r} is not a DCP checkpoint folder: no {DCP_METADATA_FILE} file"
        )
    try:
        with os.fdopen(open_regular(path), "rb") as handle:
            data = handle.read()
    except ValueError as error:
        raise ValueError(f"DCP metadata file: {error}") from None
    claim = pickle_claim_fault(data)  # before the unpickler would size its memo or a buffer by it
    if claim is not None:
        raise ValueError(f"DCP metadata file {str(path)!r} is unreadable or not DCP metadata: {claim}")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # a truncated or foreign pickle raises anything from EOFError to KeyError
        raise ValueError(
            f"DCP metadata file {str(path)!r} is unreadable or not DCP metadata: {reason_of(error)}"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"DCP metadata file {str(path)!r} holds a {type(metadata).__name__}, not DCP Metadata")
    fault = _structure_fault(metadata)
    if fault is not None:
        raise ValueError(f"DCP metadata file {str(path)!r} is malformed: {fault}")
    return metadata, hashlib.sha256(data).hexdigest()


def _counts(value: object) -> TypeGuard[tuple[int, ...] | list[int]]:
    return isinstance(value, (tuple, list)) and all(is_count(item) for item in value)


def _structure_fault(metadata: Metadata) -> str | None:
    """What is wrong with the shape of unpickled metadata (the unpickler builds objects without their constructors,
    so any field may be missing or of another kind), or None. Everything the package reads is checked here, once."""
    items = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    planner = getattr(metadata, "planner_data", None)
    if not isinstance(items, dict):
        return "state_dict_metadata is not a map"
    if storage is not None and not isinstance(storage, dict):
        return "storage_data is not a map"
    if planner is not None and not (
        isinstance(planner, dict)
        and all(
            isinstance(fqn, str) and isinstance(path, (list, tuple)) and all(isinstance(k, (str, int)) for k in path)
            for fqn, path in planner.items()
        )
    ):
        return "planner_data is not a map of names to key paths"
    for fqn, item in items.items():
        fault = _item_fault(fqn, item)
        if fault is not None:
            return fault
    for index, info in (storage or {}).items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str):
            return "storage_data has a key that is not a metadata index"
        if not (
            isinstance(getattr(info, "relative_path", None), str)
            and is_count(getattr(info, "offset", None))
            and is_count(getattr(info, "length", None))
        ):
            return f"the storage entry of {index.fqn!r} has no valid file name, offset or length"
    return _index_fault(items, storage or {})


def _item_fault(fqn: object, item: object) -> str | None:
    """What is wrong with one entry of ``state_dict_metadata``, or None."""
    if not isinstance(fqn, str):
        return f"entry {fqn!r} is not named by a string"
    if isinstance(item, BytesStorageMetadata):
        return None
    if not isinstance(item, TensorStorageMetadata):
        return f"entry {fqn!r} has unknown storage type {type(item).__name__}"
    size, chunks = getattr(item, "size", None), getattr(item, "chunks", None)
    dtype = getattr(getattr(item, "properties", None), "dtype", None)
    if not _counts(size) or not isinstance(dtype, torch.dtype) or not isinstance(chunks, list):
        return f"tensor {fqn!r} has no valid size, dtype or chunk list"
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata) or not (
            _counts(getattr(chunk, "offsets", None))
            and _counts(getattr(chunk, "sizes", None))
            and len(chunk.offsets) == len(chunk.sizes) == len(size)
        ):
            return f"tensor {fqn!r} has a chunk without valid offsets and sizes"
    return None


def _index_fault(items: dict[str, object], storage: dict) -> str | None:
    """Every stored chunk and non-tensor value has the storage entry it is looked up by (its name, and a chunk's
    offsets): a changed byte in a name or an offset leaves one without, which would otherwise surface as a
    ``KeyError`` wherever it is read."""
    for fqn, item in items.items():
        if isinstance(item, TensorStorageMetadata):
            for chunk in item.chunks:
                if MetadataIndex(fqn, chunk.offsets) not in storage:
                    return f"tensor {fqn!r} chunk at offsets {list(chunk.offsets)} has no storage entry"
        elif MetadataIndex(fqn) not in storage:
            return f"non-tensor value {fqn!r} has no storage entry"
    return None


def storage_rank(relative_path: str) -> int:
    """The saving rank encoded in a DCP storage file name ``__{rank}_{n}.distcp``."""
    match = _STORAGE_FILE.match(relative_path)
    if match is None:
        raise ValueError(f"DCP storage file name {relative_path!r} does not look like '__<rank>_<n>.distcp'")
    return int(match.group(1))


def layout_from_dcp_metadata(
    checkpoint_dir: str | os.PathLike, *, world_size: int | None = None, metadata: Metadata | None = None
) -> Layout:
    """The layout of a DCP folder: every stored chunk under the rank whose file holds it, on a 1-D mesh.

    ``world_size`` defaults to one more than the highest rank among the folder's storage files.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if metadata is None:
        metadata = read_dcp_metadata(checkpoint_dir)
    storage = metadata.storage_data or {}
    ranks_on_disk = {storage_rank(p.name) for p in checkpoint_dir.glob("__*_*.distcp") if _STORAGE_FILE.match(p.name)}
    try:
        ranks_in_metadata = {storage_rank(info.relative_path) for info in storage.values()}
    except ValueError as error:
        raise ValueError(f"DCP checkpoint {str(checkpoint_dir)!r}: {error}") from None
    named = max(ranks_on_disk | ranks_in_metadata, default=0) + 1
    # Every rank of a DCP save writes its own file (an empty one when it holds nothing), so a save by N ranks leaves
    # N files: a rank number far beyond the files present is a name, not a save (and sizing anything by it would
    # let one empty file claim any amount of memory). A few missing files are left for check_files to name.
    if named > 2 * len(ranks_on_disk) + 1:
        raise ValueError(
            f"DCP checkpoint {str(checkpoint_dir)!r}: its storage files name rank {named - 1}, but only"
            f" {len(ranks_on_disk)} rank(s) have a file (a save by N ranks writes __<rank>_0.distcp for each)"
        )
    if world_size is None:
        world_size = named
    mesh = MeshLayout.one_dimensional(world_size)
    tensors: dict[str, TensorLayout] = {}
    non_tensor_state: dict[str, str] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            non_tensor_state[fqn] = "carried"
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise ValueError(f"{str(checkpoint_dir)!r}: entry {fqn!r} has unknown storage type {type(item).__name__}")
        chunks = tuple(
            _stored_chunk(checkpoint_dir, fqn, index, chunk, storage) for index, chunk in enumerate(item.chunks)
        )
        shape = tuple(item.size)
        tensors[fqn] = TensorLayout(
            role=role_of(fqn),
            global_shape=shape,
            dtype=str(item.properties.dtype).removeprefix("torch."),
            placements=_infer_placements(shape, chunks, world_size),
            chunks=chunks,
        )
    layout = Layout(
        world_size=world_size, mesh=mesh, pipeline=PipelineLayout(), tensors=tensors, non_tensor_state=non_tensor_state
    )
    return validate_layout(layout, f"DCP metadata of {str(checkpoint_dir)!r}")


def _stored_chunk(checkpoint_dir: Path, fqn: str, index: int, chunk, storage) -> Chunk:
    info = storage.get(MetadataIndex(fqn, chunk.offsets, index))
    if info is None:
        raise ValueError(
            f"{str(checkpoint_dir)!r}: tensor {fqn!r} chunk at offsets {list(chunk.offsets)} has no storage entry"
        )
    return Chunk(storage_rank(info.relative_path), tuple(chunk.offsets), tuple(chunk.sizes))


def _infer_placements(shape: tuple[int, ...], chunks: tuple[Chunk, ...], world_size: int) -> tuple[str, ...] | None:
    """``Replicate()`` for one whole chunk, ``Shard(d)`` for torch.chunk-style rows in rank order, else unknown."""
    if len(chunks) == 1 and chunks[0].offsets == tuple(0 for _ in shape) and chunks[0].sizes == shape:
        return ("Replicate()",)
    for dim, extent in enumerate(shape):
        step = math.ceil(extent / world_size) if world_size else 0
        expected = [
            (rank, min(rank * step, extent), max(0, min(step, extent - rank * step))) for rank in range(world_size)
        ]
        found = sorted((c.rank, c.offsets[dim], c.sizes[dim]) for c in chunks)
        others_whole = all(
            c.offsets[d] == 0 and c.sizes[d] == shape[d] for c in chunks for d in range(len(shape)) if d != dim
        )
        if others_whole and [e for e in expected if e[2] > 0] == [f for f in found if f[2] > 0]:
            return (f"Shard({dim})",)
    return None
