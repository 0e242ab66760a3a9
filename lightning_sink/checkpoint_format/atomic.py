"""Checkpoint folders committed atomically: written in full under a staging name, then renamed into place.

A crash at any point before the rename leaves the previous checkpoint untouched and only a folder whose name says
it is unfinished (``.NAME.staging...``). A folder cannot be replaced by one rename, so an existing target is first
renamed to ``.NAME.previous`` and deleted after the commit; a crash between those two renames leaves the old
checkpoint whole under that name, and ``check_checkpoint_dir`` names it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lightning_sink.checkpoint_format.fs import fsync_dir

__all__ = ["staging_dir", "previous_dir", "commit_folder", "check_checkpoint_dir", "discard"]


def staging_dir(target: Path, tag: str = "") -> Path:
    """Where ``target`` is written before its commit: ``.NAME.staging{tag}`` beside it. Writers that run on several
    ranks use no tag (every rank must name the same folder); a one-process writer may make it unique."""
    return target.with_name(f".{target.name}.staging{tag}")


def previous_dir(target: Path) -> Path:
    """Where a replaced ``target`` waits while its successor is renamed into place."""
    return target.with_name(f".{target.name}.previous")


def discard(path: Path) -> None:
    """Remove the folder or file at ``path`` (a leftover of a crashed write), never following a link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def commit_folder(staging: Path, target: Path) -> None:
    """Rename the complete ``staging`` folder onto ``target``, durably; a previous ``target`` is retired first and
    removed after."""
    previous = previous_dir(target)
    if os.path.lexists(target):
        discard(previous)
        os.rename(target, previous)
    os.rename(staging, target)
    fsync_dir(target.parent)
    discard(previous)


def check_checkpoint_dir(path: Path) -> None:
    """A clear error for a target that a crash left between the two renames of a commit."""
    if not path.exists() and previous_dir(path).is_dir():
        raise FileNotFoundError(
            f"Checkpoint {str(path)!r} does not exist, but {str(previous_dir(path))!r} does: a save crashed while"
            f" replacing it. That folder is the previous, complete checkpoint; rename it to {path.name!r} to resume."
        )
