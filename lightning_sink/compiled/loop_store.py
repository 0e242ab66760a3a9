"""The folder where loops over windows are kept for later fits (``saved_loop.py``): per key, the program (torch's
format, a pickle as Inductor's own cache entries are) and its entry (JSON: the program's size and SHA-256, the
sources traced with TorchDynamo's checksums, the identities of the guards left out), or a refusal (why that loop
could not be saved, so that later fits do not try again: remove the file to retry).

Nothing read here is trusted: an entry is read only up to ``MAX_ENTRY_BYTES`` and used only when well formed and for
the key asked; a program is read only up to the size its entry gives and returned only when its SHA-256 matches.
Every file is written whole under a temporary name and then renamed (a reader sees a whole file or none), the
program's bytes read back to digest them. The folder keeps at most ``MAX_SAVED_LOOPS`` keys, the newest; a folder
that cannot be read or written only means nothing is kept (the fit trains the same)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sink.regular_file import read_regular

__all__ = ["FORMAT", "MAX_ENTRY_BYTES", "MAX_PROGRAM_BYTES", "MAX_SAVED_LOOPS", "LoopStore", "StoredLoop"]

FORMAT = 2
MAX_ENTRY_BYTES = 8 << 20
MAX_PROGRAM_BYTES = 256 << 20
MAX_SAVED_LOOPS = 32
_SUFFIXES = (".json", ".program", ".refused")


@dataclass(frozen=True)
class StoredLoop:
    """A saved loop as read back: the program's bytes (their digest checked), the sources traced (module, first
    line, last line, checksum) and the identities of the guards left out (path, name)."""

    program: bytes
    sources: list[list[Any]]
    identities: list[list[Any]]


class LoopStore:
    """The saved loops in ``folder``, by key."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def load(self, key: str) -> StoredLoop | None:
        entry = _read_json(self.folder / f"{key}.json", key)
        if entry is None:
            return None
        size, digest = entry.get("bytes"), entry.get("sha256")
        sources, identities = entry.get("sources"), entry.get("identities")
        if type(size) is not int or not 0 < size <= MAX_PROGRAM_BYTES or not isinstance(digest, str):
            return None
        if not isinstance(sources, list) or not _rows(sources, (str, int, int, str)):
            return None
        if not isinstance(identities, list) or not _rows(identities, (str, str)):
            return None
        try:
            program = read_regular(self.folder / f"{key}.program", size, "a saved loop")
        except (OSError, ValueError):  # (unreadable, a link, a FIFO or device, or longer than its entry says)
            return None
        if len(program) != size or hashlib.sha256(program).hexdigest() != digest:
            return None
        return StoredLoop(program, sources, identities)

    def refusal(self, key: str) -> str | None:
        """Why an earlier fit could not save the loop of ``key`` (None: no such refusal kept)."""
        entry = _read_json(self.folder / f"{key}.refused", key)
        reason = entry.get("reason") if entry is not None else None
        return reason if isinstance(reason, str) else None

    def save(self, key: str, write_program: Callable[[Path], None], sources: list, identities: list) -> bool:
        """Write the program (``write_program`` to a path), then its entry; False where the folder cannot be
        written."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            program = self._written(".program", key, write_program)
            entry = {
                "format": FORMAT,
                "key": key,
                "bytes": len(program),
                "sha256": hashlib.sha256(program).hexdigest(),
                "sources": sources,
                "identities": identities,
            }
            self._written(".json", key, lambda path: path.write_text(json.dumps(entry)))
            (self.folder / f"{key}.refused").unlink(missing_ok=True)
            self._keep_newest()
        except OSError:
            return False
        return True

    def refuse(self, key: str, reason: str) -> None:
        """Keep why the loop of ``key`` could not be saved (quietly nothing where the folder cannot be written)."""
        entry = {"format": FORMAT, "key": key, "reason": reason}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._written(".refused", key, lambda path: path.write_text(json.dumps(entry)))
            self._keep_newest()
        except OSError:
            pass

    def _written(self, suffix: str, key: str, write: Callable[[Path], Any]) -> bytes:
        """``write`` to a temporary file, its bytes read back, then renamed to the key's file; the bytes."""
        handle, name = tempfile.mkstemp(dir=self.folder, prefix=".saving-", suffix=suffix)
        os.close(handle)
        temporary = Path(name)
        try:
            write(temporary)
            data = temporary.read_bytes()
            os.replace(temporary, self.folder / f"{key}{suffix}")
        finally:
            temporary.unlink(missing_ok=True)
        return data

    def _keep_newest(self) -> None:
        """At most ``MAX_SAVED_LOOPS`` keys in the folder: the files of the oldest removed."""
        newest: dict[str, float] = {}
        for path in self.folder.iterdir():
            if path.suffix in _SUFFIXES and not path.name.startswith("."):
                try:
                    newest[path.stem] = max(newest.get(path.stem, 0.0), path.stat().st_mtime)
                except FileNotFoundError:  # (removed meanwhile by another fit)
                    continue
        for stem in sorted(newest, key=newest.__getitem__)[:-MAX_SAVED_LOOPS]:
            for suffix in _SUFFIXES:
                (self.folder / f"{stem}{suffix}").unlink(missing_ok=True)


def _read_json(path: Path, key: str) -> dict[str, Any] | None:
    """The JSON object at ``path`` where it is well formed, of this format and for ``key``; None otherwise."""
    try:  # (a link, a FIFO or device, or an entry over MAX_ENTRY_BYTES: ValueError, no entry)
        entry = json.loads(read_regular(path, MAX_ENTRY_BYTES, "a saved loop's entry"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
        return None
    return entry


def _rows(value: Any, types: tuple[type, ...]) -> bool:
    return isinstance(value, list) and all(
        isinstance(row, list) and len(row) == len(types) and all(type(item) is kind for item, kind in zip(row, types))
        for row in value
    )
