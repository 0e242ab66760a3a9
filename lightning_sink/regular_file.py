"""Opening a file that may come from untrusted hands: never through a symbolic link, and only a regular file.

A link planted in a checkpoint folder could make a read or a write land anywhere; a FIFO would block the reader
forever, a device would hand it endless bytes. Both are refused with one ValueError naming the file - and never
quoting its content. The layout reader and the checkpoint formats both use this module, which imports nothing of
the package.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["CLOEXEC", "open_regular", "read_regular"]

# every descriptor the package opens is closed in a process it starts (0 where the platform has no such flag)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_regular(
    path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o644, *, dir_fd: int | None = None
) -> int:
    """``os.open`` refusing a symbolic link as the last component and anything but a regular file (a FIFO, a
    device, a socket, a folder). A FIFO is opened without blocking, so that the check, not the open, answers."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError(
                f"{str(path)!r} is a symbolic link; links inside a checkpoint folder are not followed"
            ) from None
        if error.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO with no reader, opened to write; a folder
            raise ValueError(f"{str(path)!r} is not a regular file; refused") from None
        raise
    try:
        is_regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if is_regular and not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    if not is_regular:
        os.close(fd)
        raise ValueError(f"{str(path)!r} is not a regular file (a FIFO, device, socket or folder); refused")
    return fd


def read_regular(path: str | os.PathLike, limit: int, what: str, *, dir_fd: int | None = None) -> bytes:
    """The whole of ``path`` (``open_regular``; relative to the folder ``dir_fd`` where given), refused when it holds
    more than ``limit`` bytes."""
    try:
        fd = open_regular(path, dir_fd=dir_fd)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} {str(Path(path))!r} holds more than {limit} bytes; refused")
    return data
