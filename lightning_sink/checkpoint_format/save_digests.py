"""What binds the files of one save together: ``SAVE_DIGESTS.json``, the SHA-256 and size of every file of a DCP
folder this package saved, written last (by rank 0, once DCP has written its ``.metadata``, which it does after
every rank's files), before the folder is committed.

Without it, a folder mixing two saves - one save's ``.metadata`` with another's ``__0_0.distcp`` at the same
offsets - converts without complaint: each record's CRC-32 is consistent with its own bytes. A conversion of a
folder that has the file checks every file it reads against it first. Stock DCP folders (saved by Lightning or DCP
itself) record nothing of the kind, so for them a mix of two saves with identical structure cannot be told apart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_sink.checkpoint_format.fs import check_relative_name, sha256_inside, write_new_file
from lightning_sink.layout.bounded_json import loads_bounded
from lightning_sink.regular_file import read_regular

__all__ = ["SAVE_DIGESTS_FILE", "check_save_digests", "write_save_digests"]

SAVE_DIGESTS_FILE = "SAVE_DIGESTS.json"
_FORMAT = "lightning-sink-save-digests"
_VERSION = 1
_MAX_BYTES = 16 * 2**20


def write_save_digests(folder: Path) -> None:
    """Record every regular file directly in ``folder`` (the save's own, freshly written)."""
    files = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name != SAVE_DIGESTS_FILE and entry.is_file(follow_symlinks=False):
            digest, size = sha256_inside(folder, entry.name, f"checkpoint {str(folder)!r}")
            files[entry.name] = {"sha256": digest, "bytes": size}
    document = {"format": _FORMAT, "version": _VERSION, "files": files}
    write_new_file(folder / SAVE_DIGESTS_FILE, json.dumps(document, indent=1).encode())


def check_save_digests(folder: Path, names: list[str], what: str) -> int | None:
    """None when ``folder`` records no digests (a stock DCP folder). Otherwise check that each of ``names`` is
    listed with the SHA-256 and size of its bytes (ValueError naming the file when not: it does not belong to this
    save) and return the bytes read."""
    path = folder / SAVE_DIGESTS_FILE
    if not os.path.lexists(path):
        return None
    document = loads_bounded(read_regular(path, _MAX_BYTES, f"{what}: save digests"), f"save digests {str(path)!r}")
    files = document.get("files") if isinstance(document, dict) else None
    if not isinstance(document, dict) or document.get("format") != _FORMAT or not isinstance(files, dict):
        raise ValueError(f"save digests {str(path)!r}: not a {_FORMAT!r} file")
    read = 0
    for name in names:
        check_relative_name(name, f"{what}: file")
        entry = files.get(name)
        if not isinstance(entry, dict):
            raise ValueError(f"{what}: file {str(folder / name)!r} is not one this save wrote ({SAVE_DIGESTS_FILE})")
        digest, size = sha256_inside(folder, name, what)
        read += size
        if digest != entry.get("sha256") or size != entry.get("bytes"):
            raise ValueError(
                f"{what}: file {str(folder / name)!r} does not belong to this save: its SHA-256 or size differs"
                f" from {SAVE_DIGESTS_FILE} (a file of another save, or changed since)"
            )
    return read
