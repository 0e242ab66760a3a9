"""A resharded checkpoint folder (``transform_checkpoints``' output): ``MANIFEST.json``, ``layout.json`` and one
rank file per target rank (``rank_{r}/{prefix}{r}.pt``), or rank files written one by one by
``transform_checkpoint_by_rank``, each with its ``.sha256`` sidecar.

Which file a rank reads (``rank_file_path``), and whether a folder is whole (``verify_checkpoint``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lightning_sink.checkpoint_format.fs import inside, sha256_inside
from lightning_sink.checkpoint_format.manifest import MANIFEST_FILE_NAME, read_manifest, safe_relative_path
from lightning_sink.checkpoint_format.rank_file import (
    check_rank_payload,
    load_rank_payload,
    rank_dir_name,
    rank_file_name,
)
from lightning_sink.layout.dcp_metadata import DCP_METADATA_FILE
from lightning_sink.layout.io import load_layout
from lightning_sink.layout.schema import LAYOUT_FILE_NAME

__all__ = ["VerifyReport", "is_resharded_checkpoint", "rank_file_path", "verify_checkpoint"]


def is_resharded_checkpoint(path: Path) -> bool:
    """A ``transform_checkpoints`` output folder (a manifest, no DCP ``.metadata``), or a folder of ``rank_{r}/``
    files written one by one by ``transform_checkpoint_by_rank`` (each with its ``.sha256`` sidecar)."""
    if not path.is_dir() or (path / DCP_METADATA_FILE).exists():
        return False
    return (path / MANIFEST_FILE_NAME).is_file() or any((path / rank_dir_name(0)).glob("*.pt.sha256"))


def rank_file_path(folder: Path, rank: int) -> Path:
    """``rank_{rank}/{prefix}{rank}.pt`` of a resharded folder: the prefix from its manifest, or (per-rank output
    without a manifest) the one ``.pt`` file with a ``.sha256`` sidecar in ``rank_{rank}/``."""
    what = f"resharded checkpoint {str(folder)!r}"
    if not (folder / MANIFEST_FILE_NAME).is_file():
        rank_dir = inside(folder, rank_dir_name(rank), what)
        files = sorted(inside(rank_dir, sidecar.with_suffix("").name, what) for sidecar in rank_dir.glob("*.pt.sha256"))
        if len(files) != 1:
            raise ValueError(
                f"resharded checkpoint {str(folder)!r} has no MANIFEST.json and {len(files)} rank files"
                f" with a .sha256 sidecar in {rank_dir_name(rank)}/ (expected exactly 1 for this rank)"
            )
        return files[0]
    manifest = read_manifest(folder)  # (its ckpt_prefix is checked to be a plain file-name prefix)
    world_size = manifest.provenance.get("world_size")
    if world_size is not None and rank >= world_size:
        raise ValueError(
            f"resharded checkpoint {str(folder)!r} was made for {world_size} ranks; this run has rank"
            f" {rank}: reshard for this run's mesh (its layout from `lightning-sink layout`)"
        )
    return inside(folder, rank_file_name(rank, manifest.provenance.get("ckpt_prefix", "")), what)


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
    folder = Path(folder)
    manifest = read_manifest(folder)
    total = 0
    for name, entry in sorted(manifest.files.items()):
        path = safe_relative_path(name, folder, f"manifest of {str(folder)!r}")
        if not os.path.lexists(path):
            raise FileNotFoundError(f"{str(path)!r} is listed in the manifest but missing")
        digest, size = sha256_inside(folder, name, f"manifest of {str(folder)!r}")  # (no symbolic link followed)
        if size != entry["bytes"]:
            raise ValueError(
                f"{str(path)!r} is {size} bytes, the manifest says {entry['bytes']}: truncated or replaced"
            )
        if digest != entry["sha256"]:
            raise ValueError(f"{str(path)!r}: SHA-256 differs from the manifest: the file is corrupt")
        total += size
    layout = load_layout(inside(folder, LAYOUT_FILE_NAME, f"resharded checkpoint {str(folder)!r}"))
    prefix = manifest.provenance.get("ckpt_prefix", "")
    for rank in range(layout.world_size):
        name = rank_file_name(rank, prefix)
        if name not in manifest.files:
            raise ValueError(f"{str(folder)!r} is incomplete: no file for target rank {rank} ({name}) in the manifest")
        if deep:
            check_rank_payload(
                load_rank_payload(inside(folder, name, f"manifest of {str(folder)!r}")),
                layout,
                rank,
                str(folder / name),
            )
    return VerifyReport(folder, layout.world_size, len(manifest.files), total)
