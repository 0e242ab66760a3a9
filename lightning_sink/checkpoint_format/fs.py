"""Filesystem helpers for checkpoint folders that may come from untrusted hands.

- names read from files (manifest entries, prefixes) are checked before they become paths (``check_relative_name``,
  ``check_file_prefix``);
- files inside a checkpoint folder are reached without following symbolic links (``inside``, ``open_inside``,
  ``open_nofollow``): a link planted in a folder could otherwise make a read or a write land anywhere;
- leftovers of killed runs are matched by exact name, never by glob (``remove_leftovers``): a destination named
  ``ckpt*`` must not match another destination's leftovers;
- a write is refused before it starts when the bytes cannot fit (``check_room_for``);
- whole-file digests (``sha256_of_file``, ``sha256_inside``) and durable renames (``fsync_dir``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import resource
import shutil
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from lightning_sink.regular_file import CLOEXEC, open_regular

__all__ = [
    "DiskFullError",
    "check_file_prefix",
    "check_relative_name",
    "check_room_for",
    "fsync_dir",
    "inside",
    "open_inside",
    "open_nofollow",
    "read_inside",
    "remove_leftovers",
    "sha256_inside",
    "sha256_of_file",
    "write_new_file",
]

_HASH_BLOCK = 1 << 23


class DiskFullError(OSError):
    """The bytes to write do not fit the file system (or the process's file-size limit)."""


def check_relative_name(name: object, what: str) -> PurePosixPath:
    """A relative, '/'-separated name with no ``..``, no absolute root, no backslash or NUL; ValueError otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what}: {name!r} is not a file name")
    pure = PurePosixPath(name)
    if not pure.parts or name.endswith("/"):
        raise ValueError(f"{what}: {name!r} names no file")
    if pure.is_absolute() or ".." in pure.parts or "\\" in name or "\x00" in name:
        raise ValueError(f"{what}: path {name!r} would escape its folder")
    return pure


def check_file_prefix(prefix: object, what: str) -> str:
    """A plain file-name prefix (may be empty): no separators, NUL, and not ``.`` or ``..``."""
    if not isinstance(prefix, str) or any(c in prefix for c in "/\\\x00") or prefix in (".", ".."):
        raise ValueError(
            f"{what}={prefix!r} must be a plain file-name prefix (no path separators, not '.' or '..')"
            " so that rank files stay inside their folder"
        )
    return prefix


def inside(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` after checking the name, and that no component below ``folder`` is a symbolic link."""
    pure = check_relative_name(name, what)
    path = Path(folder)
    for part in pure.parts:
        path = path / part
        if path.is_symlink():
            raise ValueError(
                f"{what}: {str(path)!r} is a symbolic link; links inside a checkpoint folder are not followed"
            )
    return path


def open_nofollow(path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """``os.open`` that refuses a symbolic link as the last component and anything but a regular file (a FIFO, a
    device, a socket): ValueError naming the file (see regular_file.py)."""
    return open_regular(path, flags, mode)


def write_new_file(path: Path, data: bytes) -> None:
    """Create ``path`` exclusively (never through a planted link or onto an existing file), write ``data``, sync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def open_inside(folder: Path, name: str, what: str, flags: int = os.O_RDONLY) -> int:
    """A file descriptor for ``folder / name``, opened component by component relative to the folder's descriptor
    with ``O_NOFOLLOW``: no symbolic link below ``folder`` is followed, even one swapped in meanwhile."""
    parts = check_relative_name(name, what).parts
    directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | CLOEXEC)
    try:
        for part in parts[:-1]:
            following = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | CLOEXEC, dir_fd=directory)
            os.close(directory)
            directory = following
        return open_regular(parts[-1], flags, dir_fd=directory)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: {str(Path(folder, *parts))!r} does not exist") from None
    except ValueError:
        raise ValueError(
            f"{what}: {str(Path(folder, *parts))!r} is a symbolic link or not a regular file; links and special"
            " files inside a checkpoint folder are refused"
        ) from None
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ValueError(
                f"{what}: {str(Path(folder, *parts))!r} is a symbolic link or lies behind one (or"
                " behind a non-folder); links inside a checkpoint folder are not followed"
            ) from None
        raise
    finally:
        os.close(directory)


def read_inside(folder: Path, name: str, what: str) -> bytes:
    """The whole file ``folder / name``, reached without following symbolic links."""
    with os.fdopen(open_inside(folder, name, what), "rb") as handle:
        return handle.read()


def sha256_inside(folder: Path, name: str, what: str) -> tuple[str, int]:
    """(SHA-256 hex, size) of ``folder / name``, reached without following symbolic links."""
    digest, size = hashlib.sha256(), 0
    with os.fdopen(open_inside(folder, name, what), "rb") as handle:
        while data := handle.read(_HASH_BLOCK):
            digest.update(data)
            size += len(data)
    return digest.hexdigest(), size


def sha256_of_file(path: Path) -> str:
    """SHA-256 hex of a file this process wrote or was handed by path (a regular file, not reached by a link)."""
    digest = hashlib.sha256()
    with os.fdopen(open_nofollow(path), "rb") as handle:
        while data := handle.read(_HASH_BLOCK):
            digest.update(data)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    descriptor = os.open(path, os.O_RDONLY | CLOEXEC)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def remove_leftovers(parent: Path, name: str, kinds: Iterable[str]) -> None:
    """Remove ``parent/.{name}.{kind}-{8 hex digits}`` for each kind: exact names, so that no other folder's
    leftovers match (``name`` may hold glob characters). Symbolic links are never followed."""
    pattern = re.compile(rf"\.{re.escape(name)}\.(?:{'|'.join(map(re.escape, kinds))})-[0-9a-f]{{8}}")
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return
    for entry in entries:
        if not pattern.fullmatch(entry.name):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            Path(entry.path).unlink(missing_ok=True)


def check_room_for(folder: Path, total_bytes: int, largest_file_bytes: int, what: str) -> None:
    """Refuse (``DiskFullError``) before writing when ``total_bytes`` exceed the free space of ``folder``'s file
    system, or one file of ``largest_file_bytes`` exceeds this process's file-size limit (``RLIMIT_FSIZE``)."""
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    if total_bytes > free:
        raise DiskFullError(
            f"{what}: not enough free space in {str(folder)!r}: {total_bytes} bytes to write, {free} free"
        )
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and largest_file_bytes > limit:
        raise DiskFullError(
            f"{what}: a file of {largest_file_bytes} bytes exceeds this process's file-size limit of {limit} bytes"
        )
