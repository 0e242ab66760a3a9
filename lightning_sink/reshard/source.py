"""Source checkpoints: a DCP folder (with or without ``layout.json``) or per-rank files ``rank_{x}/*.pt``.

Both expose a *storage layout* (each chunk under a rank whose file holds it), a way to locate a stored chunk's
bytes, the non-tensor state to carry, and a fingerprint (to tell whether a destination holds this conversion).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from lightning_sink._fs import inside, open_nofollow, read_inside
from lightning_sink.layout.dcp_metadata import (
    DCP_METADATA_FILE,
    layout_from_dcp_metadata,
    read_dcp_metadata,
    storage_rank,
)
from lightning_sink.layout.io import load_layout, resolve_layout_path
from lightning_sink.layout.schema import LAYOUT_FILE_NAME, Chunk, Layout
from lightning_sink.layout.validation import torch_dtype
from lightning_sink.reshard.reader import FileCache, ReadStats, TensorLocation, locate_tensors
from lightning_sink.reshard.writer import sha256_of_file

__all__ = [
    "LIGHTNING_META_FILE",
    "RESHARDED_FORMAT",
    "Source",
    "DcpSource",
    "RankFilesSource",
    "open_source",
    "source_from_files",
]

LIGHTNING_META_FILE = "meta.pt"  # Lightning's non-tensor checkpoint state beside a sharded DCP folder
RESHARDED_FORMAT = "lightning-sink-resharded-rank"
_RANK_DIR = re.compile(r"^rank_(\d+)$")


@dataclass
class Source:
    """What a conversion needs from a source checkpoint."""

    description: str
    layout: Layout  # storage layout
    files: dict[int, Path]  # rank -> the file holding its chunks (DCP: one per rank)
    fingerprint: str
    paths: dict[str, list[str]] = field(default_factory=dict)  # fqn -> DCP's nested path, to unflatten
    # Files whose whole SHA-256 ``check_files`` checked (their records need no CRC-32), and the bytes it read.
    verified_files: set[str] = field(default_factory=set)
    verify_bytes_read: int = 0

    def locate(self, chunk: Chunk, fqn: str, stats: ReadStats, fds) -> TensorLocation:
        raise NotImplementedError

    def non_tensor_state(self, stats: ReadStats) -> dict[str, bytes]:
        raise NotImplementedError

    def extra_files(self) -> dict[str, bytes]:
        return {}

    def check_files(self, ranks: list[int]) -> None:
        """Fail before any work when a needed rank file is missing."""
        for rank in ranks:
            path = self.files.get(rank)
            if path is None or not path.is_file():
                raise FileNotFoundError(
                    f"{self.description}: the file of source rank {rank} is missing"
                    + (f" ({str(path)!r})" if path is not None else "")
                )


class DcpSource(Source):
    def __init__(self, folder: Path, layout_file: Path | None, allowed: Mapping[int, Path] | None = None):
        self.folder = folder
        self.metadata = read_dcp_metadata(folder)
        declared_path = layout_file or _own_layout_file(folder)
        declared = load_layout(declared_path) if declared_path is not None else None
        storage = layout_from_dcp_metadata(folder)
        if declared is not None:
            layout_name = str(resolve_layout_path(declared_path))
            if declared.world_size < storage.world_size:
                raise ValueError(
                    f"layout file {layout_name!r} does not match DCP checkpoint {str(folder)!r}: the"
                    f" checkpoint was saved by {storage.world_size} ranks, the layout has world size"
                    f" {declared.world_size}"
                )
            storage = layout_from_dcp_metadata(folder, world_size=declared.world_size)
            _check_layout_matches_storage(declared, storage, layout_name, str(folder))
        # A rank may have written several files (__{rank}_0.distcp, __{rank}_1.distcp, ...): keep them all.
        self.rank_files: dict[int, set[Path]] = {}
        for info in (self.metadata.storage_data or {}).values():
            self.rank_files.setdefault(storage_rank(info.relative_path), set()).add(self._file(info.relative_path))
        files = {rank: min(paths) for rank, paths in self.rank_files.items()}
        if allowed is not None:  # transform_checkpoint_by_rank: only the ranks in the map may be read
            files = {rank: path for rank, path in files.items() if rank in allowed}
        paths = {fqn: list(path) for fqn, path in (self.metadata.planner_data or {}).items()}
        super().__init__(
            f"DCP checkpoint {str(folder)!r}", storage, files, sha256_of_file(folder / DCP_METADATA_FILE), paths
        )

    def _file(self, relative_path: str) -> Path:
        """A storage file named by the metadata, inside the folder and reached without a symbolic link."""
        return inside(self.folder, relative_path, f"DCP checkpoint {str(self.folder)!r}")

    def _info(self, fqn: str, chunk: Chunk):
        item = self.metadata.state_dict_metadata[fqn]
        for index, stored in enumerate(item.chunks):
            if tuple(stored.offsets) == chunk.offsets:
                return self.metadata.storage_data[MetadataIndex(fqn, stored.offsets, index)]
        raise ValueError(f"{self.description}: tensor {fqn!r} has no stored chunk at offsets {list(chunk.offsets)}")

    def check_files(self, ranks: list[int]) -> None:
        super().check_files(ranks)
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
        """DCP's non-tensor leaves, as the raw ``torch.save`` bytes DCP stored (never unpickled here)."""
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
            carried[fqn] = data
        return carried

    def extra_files(self) -> dict[str, bytes]:
        if not os.path.lexists(self.folder / LIGHTNING_META_FILE):
            return {}
        return {LIGHTNING_META_FILE: read_inside(self.folder, LIGHTNING_META_FILE, self.description)}


class RankFilesSource(Source):
    """``rank_{x}/<one>.pt`` files (this package's resharded output, or plain dicts of local shards + a layout)."""

    def __init__(self, files: dict[int, Path], layout_file: Path | None, description: str):
        self._located: dict[int, object] = {}
        if layout_file is not None:
            layout = load_layout(layout_file)
        else:
            layout = self._embedded_layout(files, description)
        fingerprint = hashlib.sha256(
            "".join(
                f"{rank}:{path.name}:{path.stat().st_size if path.is_file() else -1};"
                for rank, path in sorted(files.items())
            ).encode()
            + layout.to_json().encode()
        ).hexdigest()
        super().__init__(description, layout, files, fingerprint)

    @staticmethod
    def _embedded_layout(files: dict[int, Path], description: str) -> Layout:
        from lightning_sink.reshard.loading import read_rank_file_header

        for rank in sorted(files):
            if files[rank].is_file():
                header = read_rank_file_header(files[rank])
                if header.get("layout") is not None:
                    return header["layout"]
        raise ValueError(f"{description}: the rank files embed no layout; pass src_strategy_file")

    def check_files(self, ranks: list[int]) -> None:
        """Also, before any buffer is made or byte copied: the chunks the layout gives a rank fit in its file, and
        this package's rank files (which carry no CRC-32s) match the SHA-256 of their manifest or ``.sha256``
        sidecar."""
        super().check_files(ranks)
        for rank in ranks:
            self._check_claimed_bytes(rank)
            self._check_digest(self.files[rank])

    def _check_claimed_bytes(self, rank: int) -> None:
        nbytes = sum(
            chunk.numel * torch_dtype(tensor.dtype).itemsize
            for tensor in self.layout.tensors.values()
            for chunk in tensor.chunks_of_rank(rank)
        )
        size = os.path.getsize(self.files[rank])
        if nbytes > size:
            raise ValueError(
                f"rank file {str(self.files[rank])!r}: the source layout gives rank {rank} {nbytes}"
                f" bytes of tensors, the file holds only {size}"
            )

    def _check_digest(self, path: Path) -> None:
        from lightning_sink.reshard.loading import expected_digest, read_rank_file_header

        if str(path) in self.verified_files or read_rank_file_header(path).get("format") != RESHARDED_FORMAT:
            return  # a plain torch.save file: its records' CRC-32s are checked as they are read
        expected = expected_digest(path)
        if expected is None:
            raise ValueError(
                f"rank file {str(path)!r} carries no CRC-32s and has no MANIFEST.json entry or .sha256"
                " sidecar: its integrity cannot be checked"
            )
        size = os.path.getsize(path)
        self.verify_bytes_read += size
        if size != expected[1] or sha256_of_file(path) != expected[0]:
            raise ValueError(
                f"rank file {str(path)!r}: SHA-256 or size differs from its manifest (or sidecar): the"
                " file is corrupt or was replaced"
            )
        self.verified_files.add(str(path))

    def _entries(self, rank: int, stats: ReadStats, fds) -> dict:
        if rank not in self._located:
            path = self.files[rank]
            loaded = locate_tensors(fds.fd(path), path, 0, os.path.getsize(path), f"rank file {str(path)!r}", stats)
            if isinstance(loaded, dict) and loaded.get("format") == RESHARDED_FORMAT:
                self._located[rank] = loaded
            elif isinstance(loaded, dict):
                self._located[rank] = {"tensors": loaded, "non_tensor_state": {}}
            else:
                raise ValueError(f"rank file {str(path)!r} holds a {type(loaded).__name__}, not a dict of tensors")
        return self._located[rank]

    def locate(self, chunk: Chunk, fqn: str, stats: ReadStats, fds) -> TensorLocation:
        entries = self._entries(chunk.rank, stats, fds)
        location = entries["tensors"].get(fqn)
        path = self.files[chunk.rank]
        if not isinstance(location, TensorLocation):
            raise ValueError(
                f"rank file {str(path)!r} has no tensor {fqn!r}, which the source layout puts on rank {chunk.rank}"
            )
        if (
            location.shape != chunk.sizes
            or str(location.dtype).removeprefix("torch.") != self.layout.tensors[fqn].dtype
        ):
            raise ValueError(
                f"rank file {str(path)!r}: tensor {fqn!r} is {list(location.shape)} {location.dtype}, the source layout"
                f" says {list(chunk.sizes)} {self.layout.tensors[fqn].dtype}"
            )
        return dataclasses.replace(location, what=f"tensor {fqn!r} in rank file {str(path)!r}")

    def non_tensor_state(self, stats: ReadStats) -> dict[str, bytes]:
        fds = FileCache()
        try:
            first = min(self.files)
            return dict(self._entries(first, stats, fds).get("non_tensor_state", {}))
        finally:
            fds.close()

    def extra_files(self) -> dict[str, bytes]:
        from lightning_sink.reshard.loading import read_rank_file_header

        return dict(read_rank_file_header(self.files[min(self.files)]).get("extra_files", {}))


def _check_layout_matches_storage(declared: Layout, storage: Layout, layout_name: str, folder: str) -> None:
    """The layout file must describe this checkpoint: same tensors, shapes, dtypes, and every stored chunk is a
    chunk the layout gives its storing rank."""
    where = f"layout file {layout_name!r} does not match DCP checkpoint {folder!r}"
    if set(declared.tensors) != set(storage.tensors):
        only_layout = sorted(set(declared.tensors) - set(storage.tensors))
        only_checkpoint = sorted(set(storage.tensors) - set(declared.tensors))
        raise ValueError(
            f"{where}: tensors only in the layout: {only_layout[:10]}, only in the checkpoint: {only_checkpoint[:10]}"
        )
    for fqn, stored in storage.tensors.items():
        expected = declared.tensors[fqn]
        if expected.global_shape != stored.global_shape or expected.dtype != stored.dtype:
            raise ValueError(
                f"{where}: tensor {fqn!r} is {list(stored.global_shape)} {stored.dtype} in the checkpoint,"
                f" {list(expected.global_shape)} {expected.dtype} in the layout"
            )
        boxes_by_rank = {(c.rank, c.box) for c in expected.chunks}
        for chunk in stored.chunks:
            if chunk.numel and (chunk.rank, chunk.box) not in boxes_by_rank:
                raise ValueError(
                    f"{where}: tensor {fqn!r}: rank {chunk.rank} stored a chunk at offsets {list(chunk.offsets)} sizes"
                    f" {list(chunk.sizes)} that the layout does not give it"
                )


def _own_layout_file(folder: Path) -> Path | None:
    """The folder's ``layout.json`` if it has one (a symbolic link there is refused, not followed)."""
    if not os.path.lexists(folder / LAYOUT_FILE_NAME):
        return None
    return inside(folder, LAYOUT_FILE_NAME, f"checkpoint folder {str(folder)!r}")


def _rank_files_in(folder: Path) -> dict[int, Path]:
    files: dict[int, Path] = {}
    for child in sorted(folder.iterdir()):
        match = _RANK_DIR.match(child.name)
        if not match or not (child.is_dir() or child.is_symlink()):
            continue
        inside(folder, child.name, f"rank-file checkpoint {str(folder)!r}")  # a linked rank folder is refused
        candidates = sorted(
            inside(child, p.name, f"rank folder {str(child)!r}")
            for p in child.iterdir()
            if p.suffix in (".pt", ".ckpt", ".pth") and (p.is_file() or p.is_symlink())
        )
        if len(candidates) != 1:
            raise ValueError(
                f"{str(child)!r} must hold exactly one checkpoint file (*.pt/*.ckpt/*.pth), found {len(candidates)}"
            )
        files[int(match.group(1))] = candidates[0]
    return files


def open_source(
    src_checkpoints_dir: str | os.PathLike, src_strategy_file: str | os.PathLike | None, roles: Layout | None = None
) -> Source:
    """A DCP folder (``.metadata`` inside), a folder of ``rank_{x}/`` subfolders, or a one-device checkpoint file
    (``roles``: a layout whose roles tell a Lightning checkpoint's buffers from its parameters, see one_device.py)."""
    folder = Path(src_checkpoints_dir)
    layout_file = Path(src_strategy_file) if src_strategy_file is not None else None
    if folder.is_file():
        from lightning_sink.reshard.one_device import OneDeviceSource

        return OneDeviceSource(folder, layout_file, roles)
    if not folder.is_dir():
        raise FileNotFoundError(f"src_checkpoints_dir={str(folder)!r} is not a folder (nor a checkpoint file)")
    if (folder / DCP_METADATA_FILE).is_file():
        return DcpSource(folder, layout_file)
    files = _rank_files_in(folder)
    if not files:
        raise ValueError(
            f"src_checkpoints_dir={str(folder)!r} is neither a DCP checkpoint (no .metadata) nor a folder of rank_<x>/"
            " checkpoint folders"
        )
    if layout_file is None:
        layout_file = _own_layout_file(folder)
    source = RankFilesSource(files, layout_file, f"rank-file checkpoint {str(folder)!r}")
    expected = set(range(source.layout.world_size))
    if set(files) - expected:
        raise ValueError(
            f"{source.description}: rank folders {sorted(set(files) - expected)} are outside the layout's world size {source.layout.world_size}"
        )
    for rank in sorted(expected - set(files)):
        files[rank] = folder / f"rank_{rank}" / "<missing>"
    return source


def source_from_files(
    checkpoint_files_map: Mapping[int, str | os.PathLike], src_strategy_file, roles: Layout | None = None
) -> Source:
    """``transform_checkpoint_by_rank``'s map {source rank: file}: DCP ``.distcp`` files of one folder, rank files,
    or {0: a one-device Lightning checkpoint file}."""
    files = {int(rank): Path(path) for rank, path in checkpoint_files_map.items()}
    if not files:
        raise ValueError("checkpoint_files_map is empty: map each needed source rank to its file")
    if list(files) == [0] and files[0].is_file() and _is_lightning_file(files[0]):
        from lightning_sink.reshard.one_device import OneDeviceSource

        return OneDeviceSource(files[0], Path(src_strategy_file) if src_strategy_file is not None else None, roles)
    if all(path.suffix == ".distcp" for path in files.values()):
        folders = {path.parent for path in files.values()}
        if len(folders) != 1:
            raise ValueError(
                f"checkpoint_files_map: DCP files must come from one checkpoint folder, got {sorted(map(str, folders))}"
            )
        layout_file = Path(src_strategy_file) if src_strategy_file is not None else None
        return DcpSource(folders.pop(), layout_file, allowed=files)
    return RankFilesSource(
        files, Path(src_strategy_file) if src_strategy_file is not None else None, "checkpoint_files_map"
    )


def _is_lightning_file(path: Path) -> bool:
    """A Lightning checkpoint (read on the meta device: its structure only)."""
    from lightning_sink.reshard.one_device import is_lightning_checkpoint

    fds = FileCache()
    try:
        loaded = locate_tensors(
            fds.fd(path), path, 0, os.path.getsize(path), f"checkpoint file {str(path)!r}", ReadStats()
        )
    finally:
        fds.close()
    return is_lightning_checkpoint(loaded)
