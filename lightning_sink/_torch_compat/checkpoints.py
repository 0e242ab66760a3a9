"""torch's distributed-checkpoint and DTensor internals: DCP's reader and load planner made safe, its nested-dict
helpers, DTensor's chunk rule and placement, and where ``torch.load`` found a storage's bytes."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "StridedShard",
    "compute_local_shape_and_global_offset",
    "MetadataCheckedReader",
    "WeightsOnlyLoadPlanner",
    "flatten_state_dict",
    "set_element",
    "storage_offset_in_file",
]

StridedShard = _StridedShard  # FSDP2 + TP's row placement of a parameter sharded twice on one dim
compute_local_shape_and_global_offset = _compute_local_shape_and_global_offset  # DTensor's own chunk rule


class MetadataCheckedReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by ``read_metadata_file`` (this package's restricted
    unpickler) instead of DCP's plain ``pickle.load``, which would run any code the file names."""

    def __init__(self, path: str | Path, read_metadata_file: Callable[[Path], Metadata]) -> None:
        super().__init__(path)
        self._read_metadata_file = read_metadata_file

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._read_metadata_file(Path(self.path))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        metadata.storage_meta = storage_meta
        storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does after its unpickling
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are loaded with ``weights_only=True``
    (``DefaultLoadPlanner.load_bytes`` passes ``weights_only=False``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, map_location="cpu", weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def storage_offset_in_file(storage: torch.UntypedStorage) -> int | None:
    """Where a storage's raw bytes start in the file ``torch.load`` read it from (``None``: not read from a file).
    torch records it on every storage it loads from a zip file (``_checkpoint_offset``) and has no public reader."""
    offset = getattr(storage, "_checkpoint_offset", None)
    return None if offset is None else int(offset)
