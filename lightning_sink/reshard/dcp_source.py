"""A DCP checkpoint folder as a conversion source, with or without its own ``layout.json``."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from lightning_sink.checkpoint_format.dcp_folder import LIGHTNING_META_FILE
from lightning_sink.checkpoint_format.fs import inside, open_nofollow, read_inside
from lightning_sink.checkpoint_format.save_digests import check_save_digests
from lightning_sink.layout.dcp_metadata import (
    DCP_METADATA_FILE,
    layout_from_dcp_metadata,
    read_dcp_metadata_and_digest,
    storage_rank,
)
from lightning_sink.layout.io import load_layout, resolve_layout_path
from lightning_sink.layout.schema import Chunk, Layout
from lightning_sink.reshard.carried_integrity import check_archive_bytes
from lightning_sink.reshard.reader import ReadStats, TensorLocation, locate_tensors
from lightning_sink.reshard.source import Source, check_same_tensors, own_layout_file

__all__ = ["DcpSource"]


class DcpSource(Source):
    def __init__(self, folder: Path, layout_file: Path | None, allowed: Mapping[int, Path] | None = None):
        self.folder = folder
        self.metadata, metadata_digest = read_dcp_metadata_and_digest(folder)
        declared_path = layout_file or own_layout_file(folder)
        declared = load_layout(declared_path) if declared_path is not None else None
        storage = layout_from_dcp_metadata(folder, metadata=self.metadata)
        if declared is not None:
            assert declared_path is not None  # the layout was read from it
            layout_name = str(resolve_layout_path(declared_path))
            if declared.world_size < storage.world_size:
                raise ValueError(
                    f"layout file {layout_name!r} does not match DCP checkpoint {str(folder)!r}: the"
                    f" checkpoint was saved by {storage.world_size} ranks, the layout has world size"
                    f" {declared.world_size}"
                )
            storage = layout_from_dcp_metadata(folder, world_size=declared.world_size, metadata=self.metadata)
            _check_layout_matches_storage(declared, storage, layout_name, str(folder))
        # A rank may have written several files (__{rank}_0.distcp, __{rank}_1.distcp, ...): keep them all.
        self.rank_files: dict[int, set[Path]] = {}
        for info in (self.metadata.storage_data or {}).values():
            self.rank_files.setdefault(storage_rank(info.relative_path), set()).add(self._file(info.relative_path))
        files = {rank: min(paths) for rank, paths in self.rank_files.items()}
        if allowed is not None:  # transform_checkpoint_by_rank: only the ranks in the map may be read
            files = {rank: path for rank, path in files.items() if rank in allowed}
        paths = {fqn: list(path) for fqn, path in (self.metadata.planner_data or {}).items()}
        super().__init__(f"DCP checkpoint {str(folder)!r}", storage, files, metadata_digest, paths)

    def _file(self, relative_path: str) -> Path:
        """A storage file named by the metadata, inside the folder and reached without a symbolic link."""
        return inside(self.folder, relative_path, f"DCP checkpoint {str(self.folder)!r}")

    def _info(self, fqn: str, chunk: Chunk):
        item = self.metadata.state_dict_metadata[fqn]
        if isinstance(item, BytesStorageMetadata):
            raise ValueError(f"DCP checkpoint {str(self.folder)!r}: {fqn!r} is stored as bytes, not as a tensor")
        for index, stored in enumerate(item.chunks):
            if tuple(stored.offsets) == chunk.offsets:
                return self.metadata.storage_data[MetadataIndex(fqn, stored.offsets, index)]
        raise ValueError(f"{self.description}: tensor {fqn!r} has no stored chunk at offsets {list(chunk.offsets)}")

    def check_files(self, ranks: list[int]) -> None:
        """Also: the needed files belong to one save (``SAVE_DIGESTS.json``, when this package saved the folder)
        and are long enough for the records the metadata puts in them."""
        super().check_files(ranks)
        self._check_one_save(ranks)
        for rank in ranks:
            for path in sorted(self.rank_files.get(rank, ())):
                if not path.is_file():
                    raise FileNotFoundError(
                        f"{self.description}: the file {str(path)!r} of source rank {rank} is missing"
                    )
        for fqn, item in self.metadata.state_dict_metadata.items():  # sizes: a truncated file fails here, early
            if isinstance(item, BytesStorageMetadata):
                continue
            for index, stored in enumerate(item.chunks):
                info = self.metadata.storage_data[MetadataIndex(fqn, stored.offsets, index)]
                rank, path = storage_rank(info.relative_path), self._file(info.relative_path)
                if rank in ranks and os.path.getsize(path) < info.offset + info.length:
                    raise ValueError(
                        f"{self.description}: file {str(path)!r} is truncated: tensor {fqn!r} needs bytes up to"
                        f" {info.offset + info.length}, the file has {os.path.getsize(path)}"
                    )
                nbytes = math.prod(stored.sizes) * item.properties.dtype.itemsize
                if rank in ranks and nbytes > info.length:  # refused before any buffer of that size is made
                    raise ValueError(
                        f"{self.description}: tensor {fqn!r} (chunk at {list(stored.offsets)}) claims"
                        f" {list(stored.sizes)} {item.properties.dtype}, {nbytes} bytes, but its record in"
                        f" {str(path)!r} holds {info.length}"
                    )

    def _check_one_save(self, ranks: list[int]) -> None:
        names = [DCP_METADATA_FILE] + [p.name for rank in ranks for p in sorted(self.rank_files.get(rank, ()))]
        if os.path.lexists(self.folder / LIGHTNING_META_FILE):
            names.append(LIGHTNING_META_FILE)
        read = check_save_digests(
            self.folder, [n for n in names if str(self.folder / n) not in self.verified_files], self.description
        )
        if read is not None:
            self.verify_bytes_read += read
            self.verified_files.update(str(self.folder / name) for name in names)

    def locate(self, chunk: Chunk, fqn: str, stats: ReadStats, fds) -> TensorLocation:
        info = self._info(fqn, chunk)
        if chunk.rank not in self.files:
            raise ValueError(f"{self.description}: source rank {chunk.rank} is not among the files given")
        path = self._file(info.relative_path)
        what = f"tensor {fqn!r} (chunk at {list(chunk.offsets)}) in file {str(path)!r}"
        location = locate_tensors(fds.fd(path), path, info.offset, info.length, what, stats)
        if not isinstance(location, TensorLocation):
            raise ValueError(f"{what}: the stored item is not a tensor")
        return location

    def non_tensor_state(self, stats: ReadStats) -> dict[str, bytes]:
        """DCP's non-tensor leaves, as the raw ``torch.save`` bytes DCP stored (never unpickled here; their records'
        CRC-32s checked)."""
        carried = {}
        for fqn, item in self.metadata.state_dict_metadata.items():
            if not isinstance(item, BytesStorageMetadata):
                continue
            info = self.metadata.storage_data[MetadataIndex(fqn)]
            path = self._file(info.relative_path)
            if not path.is_file():
                raise FileNotFoundError(f"{self.description}: file {str(path)!r} holding {fqn!r} is missing")
            fd = open_nofollow(path)
            try:
                data = os.pread(fd, info.length, info.offset)
            finally:
                os.close(fd)
            if len(data) != info.length:
                raise ValueError(f"{self.description}: file {str(path)!r} is truncated: {fqn!r} is cut short")
            stats.header_bytes_read += len(data)
            check_archive_bytes(data, f"{self.description}: non-tensor item {fqn!r} in file {str(path)!r}")
            carried[fqn] = data
        return carried

    def extra_files(self) -> dict[str, bytes]:
        if not os.path.lexists(self.folder / LIGHTNING_META_FILE):
            return {}
        data = read_inside(self.folder, LIGHTNING_META_FILE, self.description)
        check_archive_bytes(data, f"{self.description}: {str(self.folder / LIGHTNING_META_FILE)!r}")
        return {LIGHTNING_META_FILE: data}


def _check_layout_matches_storage(declared: Layout, storage: Layout, layout_name: str, folder: str) -> None:
    """The layout file must describe this checkpoint: same tensors, shapes, dtypes, and every stored chunk is a
    chunk the layout gives its storing rank."""
    where = f"layout file {layout_name!r} does not match DCP checkpoint {folder!r}"
    check_same_tensors(declared, storage, where, "checkpoint")
    for fqn, stored in storage.tensors.items():
        expected = declared.tensors[fqn]
        boxes_by_rank = {(c.rank, c.box) for c in expected.chunks}
        for chunk in stored.chunks:
            if chunk.numel and (chunk.rank, chunk.box) not in boxes_by_rank:
                raise ValueError(
                    f"{where}: tensor {fqn!r}: rank {chunk.rank} stored a chunk at offsets {list(chunk.offsets)} sizes"
                    f" {list(chunk.sizes)} that the layout does not give it"
                )
