"""The folder where loops over windows are kept for later fits (``saved_loop.py``): per key, the program (torch's
format, a pickle as Inductor's own cache entries are) and its entry (JSON: the program's size and SHA-256, the
sources traced with TorchDynamo's checksums, the identities of the guards left out), or a refusal (why that loop
could not be saved, so that later fits do not try again: remove the file to retry).

Nothing read here is trusted: an entry is read only up to ``MAX_ENTRY_BYTES`` and used only when well formed and for
the key asked; a program is read only up to the size its entry gives and returned only when its SHA-256 matches.
Every file is written whole under a temporary name and then renamed (a reader sees a whole file or none), the
program's bytes read back to digest them. The folder keeps at most ``MAX_SAVED_LOOPS`` keys, the newest; a folder
that cannot be read or written only means nothing is kept (the fit trains the same).

A program is a pickle: loading one that another user planted would run their code as this user, and its digest
beside it proves nothing about who wrote both. So the folder is used only where it is this user's alone
(``privacy``): a folder (not a link) owned by this process's user and writable by no one else, as OpenSSH asks of
its key folder. It is made so (mode 0o700), and a load reads its files through the folder it checked (one open
descriptor), so that a folder swapped in after the check is never read."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sink.regular_file import CLOEXEC, read_regular

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

    def privacy(self) -> str | None:
        """None where the folder is this user's alone, or not made yet (it will be: ``save``); else why not, in
        words naming the folder."""
        try:
            return _not_private(self.folder, os.lstat(self.folder))
        except FileNotFoundError:
            return None
        except OSError as error:
            return f"{self.folder} cannot be read ({error.strerror})"

    def load(self, key: str) -> StoredLoop | None:
        try:
            folder = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | CLOEXEC)
        except OSError:  # (missing, unreadable, a link or not a folder)
            return None
        try:
            if _not_private(self.folder, os.fstat(folder)) is not None:
                return None
            return self._load(key, folder)
        finally:
            os.close(folder)

    def _load(self, key: str, folder: int) -> StoredLoop | None:
        entry = _read_json(f"{key}.json", key, folder)
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
            program = read_regular(f"{key}.program", size, "a saved loop", dir_fd=folder)
        except (OSError, ValueError):  # (unreadable, a link, a FIFO or device, or longer than its entry says)
            return None
        if len(program) != size or hashlib.sha256(program).hexdigest() != digest:
            return None
        return StoredLoop(program, sources, identities)

    def refusal(self, key: str) -> str | None:
        """Why an earlier fit could not save the loop of ``key`` (None: no such refusal kept)."""
        entry = _read_json(self.folder / f"{key}.refused", key) if self.privacy() is None else None
        reason = entry.get("reason") if entry is not None else None
        return reason if isinstance(reason, str) else None

    def save(self, key: str, write_program: Callable[[Path], None], sources: list, identities: list) -> bool:
        """Write the program (``write_program`` to a path), then its entry; False where the folder cannot be
        written."""
        try:
            if not self._made_private():
                return False
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
            if not self._made_private():
                return
            self._written(".refused", key, lambda path: path.write_text(json.dumps(entry)))
            self._keep_newest()
        except OSError:
            pass

    def _made_private(self) -> bool:
        """The folder made where missing (this user's alone: mode 0o700); whether it is this user's alone."""
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # (then whoever made it must be this user: checked below)
            self.folder.mkdir(mode=0o700)
        return self.privacy() is None

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


def _not_private(folder: Path, info: os.stat_result) -> str | None:
    """None where ``info`` (of ``folder``, not followed through a link) is a folder this process's user owns and no
    one else may write to; else why not."""
    if not stat.S_ISDIR(info.st_mode):
        return f"{folder} is not a folder (a link or a file)"
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return None  # (a system without POSIX owners: the folder's ACLs are the system's)
    if info.st_uid != getuid():
        return f"{folder} belongs to user id {info.st_uid}, not to this process's user ({getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(info.st_mode)
        return f"{folder} may be written by other users (mode {mode:o}; chmod go-w to use it)"
    return None


def _read_json(path: Path | str, key: str, folder: int | None = None) -> dict[str, Any] | None:
    """The JSON object at ``path`` (relative to the open ``folder`` where given) where it is well formed, of this
    format and for ``key``; None otherwise."""
    try:  # (a link, a FIFO or device, or an entry over MAX_ENTRY_BYTES: ValueError, no entry)
        entry = json.loads(read_regular(path, MAX_ENTRY_BYTES, "a saved loop's entry", dir_fd=folder))
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
