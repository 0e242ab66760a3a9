"""Every private torch API the package uses, in one place (as ``_lightning_compat`` for Lightning).

Each name here is guarded by ``tests/test_torch_compat.py``: a torch upgrade that moves or changes one fails there,
naming it, instead of deep inside a conversion or a checkpoint load.
"""

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
    "MetadataCheckedReader",
    "WeightsOnlyLoadPlanner",
    "compute_local_shape_and_global_offset",
    "fake_store",
    "flatten_state_dict",
    "set_element",
]

StridedShard = _StridedShard  # FSDP2 + TP's row placement of a parameter sharded twice on one dim
compute_local_shape_and_global_offset = _compute_local_shape_and_global_offset  # DTensor's own chunk rule


def fake_store() -> Any:
    """torch's in-process store for the fake process group (no peers); imported only when used."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


class MetadataCheckedReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by ``read_metadata_file`` (this package's restricted
    unpickler) instead of DCP's plain ``pickle.load``, which would run any code the file names."""

    def __init__(self, path: str | Path, read_metadata_file: Callable[[Path], Metadata]) -> None:
        super().__init__(path)
        self._read_metadata_file = read_metadata_file

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._read_metadata_file(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does after its unpickling
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
