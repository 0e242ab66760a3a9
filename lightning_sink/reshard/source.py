"""What a conversion needs from a source checkpoint, whatever its kind: the ``Source`` base class.

The kinds are a DCP folder (dcp_source.py), per-rank files ``rank_{x}/*.pt`` (rank_files_source.py) and a
one-device checkpoint file (one_device.py); ``open_source.py`` tells them apart. Each exposes a *storage layout*
(each chunk under a rank whose file holds it), a way to locate a stored chunk's bytes, the non-tensor state to
carry, and a fingerprint (to tell whether a destination holds this conversion).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lightning_sink.checkpoint_format.fs import inside
from lightning_sink.layout.schema import LAYOUT_FILE_NAME, Chunk, Layout
from lightning_sink.reshard.reader import ReadStats, TensorLocation

__all__ = ["Source", "own_layout_file", "check_same_tensors"]


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
            if path is None or not os.path.lexists(path):
                raise FileNotFoundError(
                    f"{self.description}: the file of source rank {rank} is missing"
                    + (f" ({str(path)!r})" if path is not None else "")
                    + "; if it was saved by a run on several nodes, its checkpoint directory was probably not shared"
                    " between them (each node wrote its ranks' files to its own disk): save to a filesystem every"
                    " node mounts"
                )
            if path.is_symlink() or not path.is_file():
                raise ValueError(
                    f"{self.description}: source rank {rank}'s file {str(path)!r} is a symbolic link or not a"
                    " regular file (a FIFO, device or socket); links and special files are refused"
                )


def own_layout_file(folder: Path) -> Path | None:
    """The folder's ``layout.json`` if it has one (a symbolic link there is refused, not followed)."""
    if not os.path.lexists(folder / LAYOUT_FILE_NAME):
        return None
    return inside(folder, LAYOUT_FILE_NAME, f"checkpoint folder {str(folder)!r}")


def check_same_tensors(declared: Layout, found: Layout, where: str, found_in: str) -> None:
    """A layout file (``declared``) must name the tensors the checkpoint holds (``found``), with their global shapes
    and dtypes; ``where`` starts each message, ``found_in`` says where the found ones were read."""
    if set(declared.tensors) != set(found.tensors):
        raise ValueError(
            f"{where}: tensors only in the layout: {sorted(set(declared.tensors) - set(found.tensors))[:10]},"
            f" only in the {found_in}: {sorted(set(found.tensors) - set(declared.tensors))[:10]}"
        )
    for fqn, tensor in found.tensors.items():
        expected = declared.tensors[fqn]
        if not expected.same_tensor_as(tensor):
            raise ValueError(
                f"{where}: tensor {fqn!r} is {list(tensor.global_shape)} {tensor.dtype} in the {found_in},"
                f" {list(expected.global_shape)} {expected.dtype} in the layout"
            )
