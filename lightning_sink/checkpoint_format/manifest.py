"""The manifest of a resharded checkpoint folder: every file's SHA-256 and size, and the conversion's provenance.

Written last into the staging folder, so a folder with a valid manifest is complete. Reading one checks every
name in it before it becomes a path (see resharded_folder.py for checking the files themselves).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sink.checkpoint_format.fs import check_file_prefix, check_relative_name, read_inside, write_new_file
from lightning_sink.counts import is_count
from lightning_sink.layout.bounded_json import loads_bounded

__all__ = [
    "MANIFEST_FILE_NAME",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "Manifest",
    "read_manifest",
    "write_manifest",
    "safe_relative_path",
]

MANIFEST_FILE_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "lightning-sink-reshard-manifest"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    files: dict[str, dict[str, Any]]  # relative posix path -> {"sha256": ..., "bytes": ...}
    provenance: dict[str, Any]  # source fingerprint, target layout digest, ckpt_prefix, world_size

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": MANIFEST_FORMAT,
                "version": MANIFEST_VERSION,
                "provenance": self.provenance,
                "files": dict(sorted(self.files.items())),
            },
            indent=1,
        )


def safe_relative_path(name: str, root: Path, what: str) -> Path:
    """``root / name`` for a relative name that stays inside ``root``; ValueError otherwise."""
    return root.joinpath(*check_relative_name(name, f"{what} (folder {str(root)!r})").parts)


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    path = folder / MANIFEST_FILE_NAME
    write_new_file(path, manifest.to_json().encode())
    return path


def read_manifest(folder: Path) -> Manifest:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"resharded checkpoint folder {str(folder)!r} does not exist or is not a folder")
    path = folder / MANIFEST_FILE_NAME
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{str(folder)!r} holds no {MANIFEST_FILE_NAME}: not a complete resharded checkpoint")
    data = loads_bounded(read_inside(folder, MANIFEST_FILE_NAME, "resharded checkpoint"), f"manifest {str(path)!r}")
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"manifest {str(path)!r}: format is not {MANIFEST_FORMAT!r}")
    if data.get("version") != MANIFEST_VERSION:
        raise ValueError(
            f"manifest {str(path)!r}: unknown version {data.get('version')!r} (this reads {MANIFEST_VERSION})"
        )
    files = data.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"manifest {str(path)!r}: 'files' must be an object")
    for name, entry in files.items():
        safe_relative_path(name, folder, f"manifest {str(path)!r}")
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) or not is_count(entry.get("bytes")):
            raise ValueError(f"manifest {str(path)!r}: entry {name!r} must be {{'sha256': str, 'bytes': int}}")
    provenance = data.get("provenance", {})
    if not isinstance(provenance, dict):
        raise ValueError(f"manifest {str(path)!r}: 'provenance' must be an object")
    check_file_prefix(provenance.get("ckpt_prefix", ""), f"manifest {str(path)!r}: provenance.ckpt_prefix")
    if "world_size" in provenance and not (is_count(provenance["world_size"]) and provenance["world_size"] > 0):
        raise ValueError(
            f"manifest {str(path)!r}: provenance.world_size {provenance['world_size']!r} is not a positive integer"
        )
    return Manifest(files=files, provenance=provenance)
