"""Lightning-style sharded checkpoints: a DCP folder plus Lightning's ``meta.pt`` and a ``layout.json``.

Every rank writes its shards into the staging folder (see atomic.py); once DCP has written its ``.metadata``
(which it does only after every rank's files are written), rank 0 adds ``meta.pt`` and the layout file and
commits the folder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_sink.checkpoint_format.atomic import commit_folder, discard, staging_dir
from lightning_sink.layout import LAYOUT_FILE_NAME, Layout, layout_from_state_dict, save_layout

__all__ = ["LIGHTNING_META_FILE", "META_STATE_NOTE", "checkpoint_layout", "save_dcp_atomically"]

# Lightning's non-tensor checkpoint state beside a sharded DCP folder (Lightning's own name for it; a test checks
# that they agree).
LIGHTNING_META_FILE = "meta.pt"

# How the non-tensor part of a checkpoint travels, listed in every layout file under its file name.
META_STATE_NOTE = (
    "torch.save by rank 0: Lightning's epoch, global_step, loops, callbacks, LR schedulers, precision"
    " plugin (loss scale) and the lightning_sink window and data position"
)


def checkpoint_layout(state: dict[str, Any], world_size: int) -> Layout:
    """The layout file of a checkpoint whose DCP part is ``state`` (also what ``infer_layout`` predicts)."""
    layout = layout_from_state_dict(state, world_size=world_size)
    non_tensor_state = {**layout.non_tensor_state, LIGHTNING_META_FILE: META_STATE_NOTE}
    return dataclasses.replace(layout, non_tensor_state=non_tensor_state)


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
        discard(staging)  # the leftovers of a save that crashed
        staging.mkdir(parents=True)
    barrier()
    layout = checkpoint_layout(state, world_size) if global_rank == 0 else None
    dcp.save(state, checkpoint_id=staging)
    if global_rank == 0:
        torch.save(metadata, staging / LIGHTNING_META_FILE)
        save_layout(layout, staging / LAYOUT_FILE_NAME)
        commit_folder(staging, target)
    barrier()
