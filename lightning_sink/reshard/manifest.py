"""The manifest of a resharded checkpoint folder: every file's SHA-256 and size, and the conversion's provenance.

Written last into the staging folder, so a folder with a valid manifest is complete. ``verify_checkpoint``
checks integrity (digests) and completeness (one file per target rank, each matching the layout).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from lightning_sink.layout.io import load_layout
from lightning_sink.layout.schema import LAYOUT_FILE_NAME
from lightning_sink.reshard.writer import sha256_of_file

__all__ = ["MANIFEST_FILE_NAME", "MANIFEST_FORMAT", "MANIFEST_VERSION", "Manifest", "read_manifest", "write_manifest",
           "safe_relative_path", "verify_checkpoint", "VerifyReport"]

MANIFEST_FILE_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "lightning-sink-reshard-manifest"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    files: dict[str, dict[str, Any]]  # relative posix path -> {"sha256": ..., "bytes": ...}
    provenance: dict[str, Any]  # source fingerprint, target layout digest, ckpt_prefix, world_size

    def to_json(self) -> str:
        return json.dumps({"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "provenance": self.provenance,
                           "files": dict(sorted(self.files.items()))}, indent=1)


def safe_relative_path(name: str, root: Path, what: str) -> Path:
    """``root / name`` for a relative name that stays inside ``root``; ValueError otherwise."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or ".." in pure.parts or "\\" in name or "\x00" in name:
        raise ValueError(f"{what}: path {name!r} would escape the folder {str(root)!r}")
    return root.joinpath(*pure.parts)


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    path = folder / MANIFEST_FILE_NAME
    with open(path, "w") as handle:
        handle.write(manifest.to_json())
        handle.flush()
        os.fsync(handle.fileno())
    return path


def read_manifest(folder: Path) -> Manifest:
    path = Path(folder) / MANIFEST_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} holds no {MANIFEST_FILE_NAME}: not a complete resharded checkpoint")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"manifest {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"manifest {str(path)!r}: format is not {MANIFEST_FORMAT!r}")
    if data.get("version") != MANIFEST_VERSION:
        raise ValueError(f"manifest {str(path)!r}: unknown version {data.get('version')!r} (this reads {MANIFEST_VERSION})")
    files = data.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"manifest {str(path)!r}: 'files' must be an object")
    for name in files:
        safe_relative_path(name, Path(folder), f"manifest {str(path)!r}")
    return Manifest(files=files, provenance=data.get("provenance", {}))


@dataclass(frozen=True)
class VerifyReport:
    folder: Path
    world_size: int
    files_checked: int
    bytes_checked: int


def verify_checkpoint(folder: str | os.PathLike, *, deep: bool = True) -> VerifyReport:
    """Check a resharded checkpoint folder; raise ValueError/FileNotFoundError naming the first bad file.

    Integrity: every manifest file exists with its size and SHA-256. Completeness: the layout's every rank has
    its file. ``deep``: each rank file loads with ``weights_only=True`` and its shards match the layout.
    """
    from lightning_sink.reshard.loading import check_rank_payload, load_rank_payload

    folder = Path(folder)
    manifest = read_manifest(folder)
    total = 0
    for name, entry in sorted(manifest.files.items()):
        path = safe_relative_path(name, folder, f"manifest of {str(folder)!r}")
        if not path.is_file():
            raise FileNotFoundError(f"{str(path)!r} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise ValueError(f"{str(path)!r} is {size} bytes, the manifest says {entry.get('bytes')}: truncated or replaced")
        if sha256_of_file(path) != entry.get("sha256"):
            raise ValueError(f"{str(path)!r}: SHA-256 differs from the manifest: the file is corrupt")
        total += size
    layout = load_layout(folder / LAYOUT_FILE_NAME)
    prefix = manifest.provenance.get("ckpt_prefix", "")
    for rank in range(layout.world_size):
        name = f"rank_{rank}/{prefix}{rank}.pt"
        if name not in manifest.files:
            raise ValueError(f"{str(folder)!r} is incomplete: no file for target rank {rank} ({name}) in the manifest")
        if deep:
            check_rank_payload(load_rank_payload(folder / name), layout, rank, str(folder / name))
    return VerifyReport(folder, layout.world_size, len(manifest.files), total)
