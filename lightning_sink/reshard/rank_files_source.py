"""Per-rank files ``rank_{x}/<one>.pt`` as a conversion source: this package's rank files, or plain dicts of
local shards plus a layout."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

from lightning_sink.checkpoint_format.fs import inside, sha256_of_file
from lightning_sink.checkpoint_format.rank_file import (
    RANK_DIR_PATTERN,
    RANK_FILE_FORMAT,
    expected_digest,
    read_rank_file_header,
)
from lightning_sink.layout.io import load_layout
from lightning_sink.layout.schema import Chunk, Layout
from lightning_sink.layout.validation import torch_dtype
from lightning_sink.reshard.reader import FileCache, ReadStats, TensorLocation, locate_tensors
from lightning_sink.reshard.source import Source

__all__ = ["RankFilesSource", "rank_files_in"]


class RankFilesSource(Source):
    """``rank_{x}/<one>.pt`` files (this package's resharded output, or plain dicts of local shards + a layout)."""

    def __init__(self, files: dict[int, Path], layout_file: Path | None, description: str):
        self._located: dict[int, dict[Any, Any]] = {}
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
        if str(path) in self.verified_files or read_rank_file_header(path).get("format") != RANK_FILE_FORMAT:
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
            if isinstance(loaded, dict) and loaded.get("format") == RANK_FILE_FORMAT:
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
        """The carried values of the first rank's file (its whole SHA-256 checked first: they are copied as is)."""
        first = min(self.files)
        self._check_digest(self.files[first])
        fds = FileCache()
        try:
            return dict(self._entries(first, stats, fds).get("non_tensor_state", {}))
        finally:
            fds.close()

    def extra_files(self) -> dict[str, bytes]:
        path = self.files[min(self.files)]
        self._check_digest(path)
        return dict(read_rank_file_header(path).get("extra_files", {}))


def rank_files_in(folder: Path) -> dict[int, Path]:
    files: dict[int, Path] = {}
    for child in sorted(folder.iterdir()):
        match = RANK_DIR_PATTERN.match(child.name)
        if not match or not (child.is_dir() or child.is_symlink()):
            continue
        inside(folder, child.name, f"rank-file checkpoint {str(folder)!r}")  # a linked rank folder is refused
        candidates = sorted(
            inside(child, p.name, f"rank folder {str(child)!r}")
            for p in child.iterdir()
            if p.suffix in (".pt", ".ckpt", ".pth")
            and (p.is_symlink() or not p.is_dir())  # FIFOs too: refused when opened
        )
        if len(candidates) != 1:
            raise ValueError(
                f"{str(child)!r} must hold exactly one checkpoint file (*.pt/*.ckpt/*.pth), found {len(candidates)}"
            )
        files[int(match.group(1))] = candidates[0]
    return files
