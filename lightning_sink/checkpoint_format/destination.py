"""The destination of a conversion: which folders it may replace, one writer at a time, a staging folder removed
when the write fails, and write failures reported in words naming the file.

A conversion replaces its destination as a whole (see atomic.py), so choosing a destination is choosing what gets
deleted. It never replaces:

- the working folder, the home folder, the file-system root, or a folder that holds any of them;
- the source, a folder inside it, or a folder that holds it;
- a folder it did not create: an existing, non-empty destination is replaced only when its ``MANIFEST.json`` says
  it is a previous output of this package and it holds nothing the manifest does not list (``overwrite`` or not).

The same holds for the folder a checkpoint save replaces before a conversion (``ReshardCheckpoint``'s ``src_dir``):
it is replaced only when it holds nothing but the files such a save writes (``check_save_replaceable``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import resource
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from lightning_sink.checkpoint_format.atomic import commit_folder, staging_dir
from lightning_sink.checkpoint_format.fs import DiskFullError, open_nofollow, remove_leftovers
from lightning_sink.checkpoint_format.manifest import MANIFEST_FILE_NAME, read_manifest

__all__ = [
    "check_destination_path",
    "check_replaceable",
    "check_save_replaceable",
    "is_distributed_save_file",
    "exclusive",
    "staged_folder",
    "write_errors_in_words",
]


def check_destination_path(dst: str | os.PathLike, sources: Mapping[str, str | os.PathLike], what: str) -> Path:
    """``dst`` resolved, after refusing (one ValueError naming ``what``) a destination whose replacement would delete
    something that is not a checkpoint: a link, the working, home or root folder or one holding them, a source
    (``sources``: argument name -> path) or a folder inside or around one."""
    given = Path(dst)
    if given.is_symlink():  # the output replaces dst as a whole: never at a link's target
        raise ValueError(f"{what}={str(dst)!r} is a symbolic link; name the folder itself")
    resolved = given.resolve()
    protected = {"the working folder": Path.cwd().resolve(), "the home folder": Path.home().resolve()}
    if resolved == Path(resolved.anchor):
        raise ValueError(f"{what}={str(dst)!r} is the file-system root; name a folder of its own for the output")
    for name, folder in protected.items():
        if resolved == folder or resolved in folder.parents:
            relation = "is" if resolved == folder else "holds"
            raise ValueError(
                f"{what}={str(dst)!r} {relation} {name} ({str(folder)!r}): the output replaces the destination"
                " as a whole; name a folder of its own"
            )
    for name, source in sources.items():
        src = Path(source).resolve()
        if resolved == src or src in resolved.parents or resolved in src.parents:
            raise ValueError(
                f"{what}={str(dst)!r} must not be, contain or lie inside {name}={str(src)!r}: the output"
                " replaces the destination as a whole"
            )
    return resolved


def check_replaceable(dst: Path, what: str) -> bool:
    """Whether ``dst`` exists and holds a previous output of this package (True: it may be replaced); False when
    it does not exist or is empty. Anything else - a file, a folder of other files, a previous output with files
    added - is refused with one ValueError, whatever ``overwrite`` says: this package replaces only what it made."""
    if not os.path.lexists(dst):
        return False
    if dst.is_symlink() or not dst.is_dir():
        raise ValueError(f"{what}={str(dst)!r} exists and is not a folder")
    if not any(dst.iterdir()):
        return False
    refusal = (
        f"{what}={str(dst)!r} holds files that are not a previous output of lightning-sink"
        " (no valid MANIFEST.json listing them); it is never replaced: choose an empty or new folder"
    )
    try:
        listed = set(read_manifest(dst).files)
    except (FileNotFoundError, ValueError, OSError):
        raise ValueError(refusal) from None
    listed.add(MANIFEST_FILE_NAME)
    folders = {str(Path(name).parent) for name in listed}
    for root, dirs, files in os.walk(dst):  # (os.walk does not follow links to folders)
        relative = Path(root).relative_to(dst)
        for name in files + dirs:
            entry = (relative / name).as_posix()
            if entry not in listed and entry not in folders:
                raise ValueError(f"{refusal}; {entry!r} is not listed")
    return True


_DISTRIBUTED_SAVE_FILES = frozenset({".metadata", "meta.pt", "layout.json", "SAVE_DIGESTS.json"})
_DCP_SHARD = re.compile(r"__\d+_\d+\.distcp")


def is_distributed_save_file(name: str) -> bool:
    """A file a distributed checkpoint save writes into its folder: DCP's ``.metadata`` and shards, Lightning's
    ``meta.pt``, this package's ``layout.json`` and ``SAVE_DIGESTS.json``."""
    return name in _DISTRIBUTED_SAVE_FILES or _DCP_SHARD.fullmatch(name) is not None


def check_save_replaceable(folder: Path, what: str, may_hold: Callable[[str], bool], kind: str) -> None:
    """Refuse (one ValueError naming the entry) a folder a checkpoint save is about to replace or write into that
    holds anything but regular files ``may_hold`` accepts (the files a save of ``kind`` writes): an absent or empty
    folder, or a previous save, passes."""
    if not os.path.lexists(folder):
        return
    if folder.is_symlink() or not folder.is_dir():
        raise ValueError(f"{what}={str(folder)!r} exists and is not a folder")
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not (entry.is_file(follow_symlinks=False) and may_hold(entry.name)):
            raise ValueError(
                f"{what}={str(folder)!r} holds {entry.name!r}, which is not a file of {kind}: the save would replace"
                " what it did not write; choose an empty or new folder"
            )


@contextmanager
def exclusive(dst: Path, what: str) -> Iterator[None]:
    """Only one conversion at a time into ``dst``: another would clear this one's staging folder as a leftover.

    An ``flock`` on ``.<dst>.lock`` beside it; the kernel drops it when the process dies, so a killed conversion
    never blocks the next. The file is removed on the way out; a waiter that locked a file removed meanwhile
    sees another inode at the path and tries again.
    """
    path = dst.parent / f".{dst.name}.lock"
    while True:
        fd = open_nofollow(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)  # a planted link or FIFO is refused
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"{what}={str(dst)!r}: another conversion into it is running (it holds {str(path)!r}); wait"
                " for it to finish or choose another destination"
            ) from None
        try:
            current = os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


@contextmanager
def staged_folder(dst: Path) -> Iterator[Path]:
    """A fresh staging folder beside ``dst`` (leftovers of killed runs into ``dst`` cleared first); committed onto
    ``dst`` when the block completes, removed when it raises. Call inside ``exclusive(dst)``."""
    remove_leftovers(dst.parent, dst.name, ("staging",))
    staging = staging_dir(dst, f"-{uuid.uuid4().hex[:8]}")  # unique: one run's leftovers never match another's
    with write_errors_in_words(staging):
        staging.mkdir()
    try:
        yield staging
        with write_errors_in_words(dst):
            commit_folder(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextmanager
def write_errors_in_words(path: Path) -> Iterator[None]:
    """A write at ``path`` (a file, or a folder being filled) that fails - a full disk, the file-size limit,
    torch.save's own report of either, any other I/O error - becomes one OSError naming the file and, where it can
    be told, the reason in words (``DiskFullError`` for space and size limits)."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as error:
        if error.filename is not None and not _within(Path(error.filename), path):
            raise  # not this write (e.g. a source that vanished): that error names its own file
        reason = full_disk_reason(path, error)
        where = error.filename if error.filename is not None else path
        raise (DiskFullError if reason else OSError)(
            f"could not write {str(where)!r}: {reason or error.strerror or error}"
        ) from None


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def full_disk_reason(path: Path, error: OSError) -> str | None:
    """Why a write of ``path`` failed, when it is the space or the file-size limit; None otherwise."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    try:
        if path.is_dir():  # a folder being filled: its largest file is the one a size limit stops first
            written = max((e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False)), default=0)
        else:
            written = path.stat().st_size if path.is_file() else 0
    except OSError:
        written = 0
    if error.errno == errno.EFBIG or (limit != resource.RLIM_INFINITY and written >= limit):
        return f"the file reached this process's file-size limit ({limit} bytes)"
    folder = path if path.is_dir() else path.parent
    try:
        if os.statvfs(folder).f_bavail == 0:
            return "the disk is full"
    except OSError:
        pass
    return None
