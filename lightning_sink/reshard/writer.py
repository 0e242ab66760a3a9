"""Writing a target rank's file band by band, without holding its shards in memory; fsync; SHA-256.

``torch.save`` needs every tensor in memory, and materialising a whole target shard costs a page fault per 4 KiB
of fresh memory (on this project's machine that alone was as slow as copying the bytes), plus torch's own CRC-32
of every record. Instead:

1. the payload is saved with ``torch.serialization.skip_data``: torch writes the complete zip (pickle, record
   headers, directory) and reserves each storage's bytes without reading them, so the tensors can be untouched
   ``torch.empty`` placeholders (address space only);
2. loading that skeleton on the meta device (``reader.locate_tensors``) gives each storage's offset in the file;
3. the caller fills each shard in bands of rows inside one reused buffer and ``pwrite``s them to their offsets;
4. a second thread hashes the file (SHA-256) behind the writes, in file order, from the page cache (hashlib and
   ``os.preadv`` release the GIL, so hashing overlaps reading and writing).

The records carry no zip CRC-32 (``skip_data`` writes 0, as ``torch.serialization.set_crc32_options(False)``
does); ``torch.load`` does not check them, and the manifest's or sidecar's SHA-256 covers the whole file.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = ["StreamedRankFile", "fsync_dir", "sha256_of_file"]

HASH_BLOCK_BYTES = 8 * 2**20


class _TrailingHasher(threading.Thread):
    """Hashes ``path`` from the start up to the highest offset the writer has declared complete."""

    def __init__(self, path: Path) -> None:
        super().__init__(name=f"sha256 {path.name}", daemon=True)
        self._fd = os.open(path, os.O_RDONLY)
        self._digest = hashlib.sha256()
        self._block = bytearray(HASH_BLOCK_BYTES)
        self._ready = self._hashed = 0
        self._final = self._stopped = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    def advance(self, upto: int, final: bool = False) -> None:
        with self._changed:
            self._ready, self._final = max(self._ready, upto), final
            self._changed.notify()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self.join()
        os.close(self._fd)

    def hexdigest(self) -> str:
        self.join()
        os.close(self._fd)
        if self._error is not None:
            raise self._error
        return self._digest.hexdigest()

    def run(self) -> None:
        try:
            while True:
                with self._changed:
                    while self._hashed >= self._ready and not self._final and not self._stopped:
                        self._changed.wait()
                    if self._stopped or (self._final and self._hashed >= self._ready):
                        return
                    ready = self._ready
                while self._hashed < ready:
                    view = memoryview(self._block)[: min(HASH_BLOCK_BYTES, ready - self._hashed)]
                    got = os.preadv(self._fd, [view], self._hashed)
                    if got <= 0:
                        raise OSError(f"{self.name}: the file ended at {self._hashed} bytes, {ready} were written")
                    self._digest.update(view[:got])
                    self._hashed += got
        except BaseException as error:  # reported by hexdigest(), in the writer's thread
            self._error = error


class StreamedRankFile:
    """A ``torch.save`` file whose tensor bytes are written afterwards, in bands, at their offsets.

    ``payload`` holds its tensors only under ``payload["tensors"]`` (placeholders; anything else must be plain
    data). Use: ``offsets()`` to order the work, ``buffer()`` + ``write_rows()`` per band, then ``finish()``;
    ``close()`` on failure (the caller removes the file).
    """

    def __init__(self, path: Path, payload: dict[str, Any]) -> None:
        from lightning_sink.reshard.reader import ReadStats, TensorLocation, locate_tensors

        _check_no_tensors_outside(payload)
        self.path = path
        with torch.serialization.skip_data():
            torch.save(payload, str(path))
        self.size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        try:
            located = locate_tensors(fd, path, 0, self.size, f"new rank file {str(path)!r}", ReadStats())
        finally:
            os.close(fd)
        self._locations: dict[str, TensorLocation] = located["tensors"]
        self._fd = os.open(path, os.O_WRONLY)
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._hasher = _TrailingHasher(path)
        self._hasher.start()
        self._written_upto = 0
        self._starts = sorted(location.data_offset for location in self._locations.values())
        self._hasher.advance(self._next_storage(0))  # the zip headers and pickle before the first storage are final

    def offset(self, fqn: str) -> int:
        return self._locations[fqn].data_offset

    def buffer(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of ``shape`` in the reused buffer (grown, never shrunk: a fresh page costs a fault)."""
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).view(shape)

    def write_rows(self, fqn: str, first_row: int, rows: torch.Tensor) -> None:
        """Write ``rows`` (contiguous) as rows ``first_row..`` of tensor ``fqn``; bands must come in file order."""
        location = self._locations[fqn]
        row_bytes = location.storage_nbytes // location.shape[0] if location.shape else location.storage_nbytes
        start = location.data_offset + first_row * row_bytes
        data = memoryview(rows.reshape(-1).view(torch.uint8).numpy())
        if start < self._written_upto or start + len(data) > location.data_offset + location.storage_nbytes:
            raise AssertionError(f"band of {fqn!r} at {start} is out of order or outside its storage")
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], start + done)
        self._written_upto = start + len(data)
        storage_done = self._written_upto == location.data_offset + location.storage_nbytes
        # after a storage's last band everything up to the next storage is final (torch.save wrote its header)
        self._hasher.advance(self._next_storage(self._written_upto) if storage_done else self._written_upto)

    def _next_storage(self, offset: int) -> int:
        """Where the first storage at or after ``offset`` starts (the file's end when there is none)."""
        index = bisect.bisect_left(self._starts, offset)
        return self._starts[index] if index < len(self._starts) else self.size

    def finish(self) -> tuple[str, int]:
        """fsync the file; returns (SHA-256 hex, bytes)."""
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        self._hasher.advance(self.size, final=True)
        return self._hasher.hexdigest(), self.size

    def close(self) -> None:
        """After a failure: stop the hasher and close the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._hasher.stop()


def _check_no_tensors_outside(payload: dict[str, Any]) -> None:
    """skip_data would save any other tensor empty: refuse rather than write a file that looks whole."""
    def visit(node: Any, where: str) -> None:
        if isinstance(node, torch.Tensor):
            raise TypeError(f"rank file payload: {where} is a tensor; tensors belong under 'tensors'")
        if isinstance(node, dict):
            for key, value in node.items():
                visit(value, f"{where}[{key!r}]")
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                visit(value, f"{where}[{index}]")

    for key, value in payload.items():
        if key != "tensors":
            visit(value, f"payload[{key!r}]")


def sha256_of_file(path: Path, block: int = 1 << 23) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while data := handle.read(block):
            digest.update(data)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
