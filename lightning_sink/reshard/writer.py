"""Writing a target rank's file: ``torch.save`` streamed through a SHA-256, fsynced, renamed into place."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["HashingWriter", "save_hashed", "fsync_dir", "sha256_of_file"]


class HashingWriter(io.RawIOBase):
    """A write-only stream that hashes what it passes on (the digest costs no second read of the file)."""

    def __init__(self, handle) -> None:
        super().__init__()
        self.handle, self.digest, self.size = handle, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.handle.write(data)

    def tell(self) -> int:
        return self.size


def save_hashed(obj: Any, path: Path) -> tuple[str, int]:
    """``torch.save(obj)`` to ``path`` (fsynced); returns (sha256 hex, bytes)."""
    with open(path, "wb") as handle:
        writer = HashingWriter(handle)
        torch.save(obj, writer)
        handle.flush()
        os.fsync(handle.fileno())
    return writer.digest.hexdigest(), writer.size


def sha256_of_file(path: Path, block: int = 1 << 22) -> str:
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
