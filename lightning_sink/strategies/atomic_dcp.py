"""Distributed checkpoints committed atomically: a DCP folder plus ``meta.pt`` and ``layout.json``.

Every rank writes its shards into a staging folder beside the target (``.NAME.staging``); once DCP has written its
``.metadata`` (which it does only after every rank's files are written), rank 0 adds Lightning's ``meta.pt`` and the
layout file and renames the staging folder onto the target. A crash at any point before the rename leaves the
previous checkpoint untouched and only a folder whose name says it is unfinished. A directory cannot be replaced by
one rename, so an existing target is first renamed to ``.NAME.previous`` and deleted after the commit; a crash
between those two renames leaves the old checkpoint whole under that name, and loading the target names it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_sink import _lightning_compat as compat
from lightning_sink.layout import LAYOUT_FILE_NAME, Layout, layout_from_state_dict, save_layout
from lightning_sink.reshard.writer import fsync_dir

__all__ = ["staging_dir", "previous_dir", "save_dcp_atomically", "check_checkpoint_dir", "checkpoint_layout"]

# How the non-tensor part of a checkpoint travels, listed in every layout file under its file name.
META_STATE_NOTE = (
    "torch.save by rank 0: Lightning's epoch, global_step, loops, callbacks, LR schedulers, precision"
    " plugin (loss scale) and the lightning_sink window and data position"
)


def checkpoint_layout(state: dict[str, Any], world_size: int) -> Layout:
    """The layout file of a checkpoint whose DCP part is ``state`` (also what ``infer_layout`` predicts)."""
    layout = layout_from_state_dict(state, world_size=world_size)
    non_tensor_state = {**layout.non_tensor_state, compat.DCP_METADATA_FILE_NAME: META_STATE_NOTE}
    return dataclasses.replace(layout, non_tensor_state=non_tensor_state)


def staging_dir(target: Path) -> Path:
    return target.with_name(f".{target.name}.staging")


def previous_dir(target: Path) -> Path:
    return target.with_name(f".{target.name}.previous")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _commit(staging: Path, target: Path) -> None:
    previous = previous_dir(target)
    if target.exists():
        _remove(previous)
        os.rename(target, previous)
    os.rename(staging, target)
    fsync_dir(target.parent)
    _remove(previous)


def save_dcp_atomically(
    state: dict[str, Any],
    metadata: dict[str, Any],
    target: Path,
    *,
    global_rank: int,
    world_size: int,
    barrier: Callable[[], None],
) -> None:
    """Called on every rank: ``state`` (DTensor shards) goes through DCP, ``metadata`` into ``meta.pt`` on rank 0.

    The layout is computed from the very state dict handed to DCP, so its keys are DCP's own flattened names.
    """
    staging = staging_dir(target)
    if global_rank == 0:
        _remove(staging)  # the leftovers of a save that crashed
        staging.mkdir(parents=True)
    barrier()
    layout = checkpoint_layout(state, world_size) if global_rank == 0 else None
    dcp.save(state, checkpoint_id=staging)
    if global_rank == 0:
        torch.save(metadata, staging / compat.DCP_METADATA_FILE_NAME)
        save_layout(layout, staging / LAYOUT_FILE_NAME)
        _commit(staging, target)
    barrier()


def check_checkpoint_dir(path: Path) -> None:
    """A clear error for a target that a crash left between the two renames of a commit."""
    if not path.exists() and previous_dir(path).is_dir():
        raise FileNotFoundError(
            f"Checkpoint {str(path)!r} does not exist, but {str(previous_dir(path))!r} does: a save crashed while"
            f" replacing it. That folder is the previous, complete checkpoint; rename it to {path.name!r} to resume."
        )
