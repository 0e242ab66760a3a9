"""Lightning-style sharded checkpoints: a DCP folder plus Lightning's ``meta.pt`` and a ``layout.json``.

Every rank writes its shards into the staging folder (see atomic.py); once DCP has written its ``.metadata``
(which it does only after every rank's files are written), the ranks check that rank 0's staging folder holds every
rank's files (agreement.py: on a cluster whose checkpoint path is node-local it does not, and the save fails on
every rank with nothing committed), then rank 0 adds ``meta.pt`` and the layout file and commits the folder.
"""

from __future__ import annotations

import dataclasses
import errno
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.futures import Future

from lightning_sink.checkpoint_format.agreement import CheckpointNotSharedError, check_every_rank_file_present
from lightning_sink.checkpoint_format.atomic import commit_folder, discard, staging_dir
from lightning_sink.checkpoint_format.destination import full_disk_reason, write_errors_in_words
from lightning_sink.checkpoint_format.save_digests import write_save_digests
from lightning_sink.error_text import reason_of
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
        with write_errors_in_words(staging):
            staging.mkdir(parents=True)
    barrier()
    layout = checkpoint_layout(state, world_size) if global_rank == 0 else None
    writer = _RecordingWriter(staging)
    try:
        dcp.save(state, checkpoint_id=staging, storage_writer=writer)
        check_every_rank_file_present(staging, target, writer.files_written(), global_rank, world_size)
        if global_rank == 0:
            with write_errors_in_words(staging):
                torch.save(metadata, staging / LIGHTNING_META_FILE)
                assert layout is not None  # rank 0 made it above
                save_layout(layout, staging / LAYOUT_FILE_NAME)
                write_save_digests(staging)  # last: what binds this save's files together
                commit_folder(staging, target)
    except BaseException as error:
        # DCP's own report holds every rank's traceback, many lines: one line in words instead (judged before the
        # staging folder, whose files tell a size limit, is removed).
        in_words = _in_words(error, staging) if _is_write_failure(error) else None
        if global_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a failed save leaves nothing behind
        if isinstance(error, CheckpointNotSharedError):
            # every rank raises this one: the other nodes' ranks remove the staging folder their own disk holds
            barrier()
            shutil.rmtree(staging, ignore_errors=True)
        if in_words is not None:
            raise in_words from None
        raise
    barrier()


class _RecordingWriter(FileSystemWriter):
    """DCP's own file-system writer, noting the names of the files this rank wrote (read from DCP's write results,
    so no assumption about how DCP names them)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._results: list[Future] = []

    def write_data(self, plan: Any, planner: Any) -> Future:
        future = super().write_data(plan, planner)
        self._results.append(future)
        return future

    def files_written(self) -> set[str]:
        return {
            str(result.storage_data.relative_path)
            for future in self._results
            for result in future.value()
            if hasattr(result.storage_data, "relative_path")
        }


def _first_failure(error: CheckpointException) -> BaseException:
    failures = list(getattr(error, "failures", {}).values())
    first = failures[0] if failures else error
    return first[0] if isinstance(first, tuple) else first  # (DCP pairs each rank's exception with its trace)


def _is_write_failure(error: BaseException) -> TypeGuard[CheckpointException]:
    """DCP's report of a write the file system refused (an OSError, or torch's writer's RuntimeError); other
    failures (a value that does not pickle) stay DCP's own exception."""
    if not isinstance(error, CheckpointException):
        return False
    failure = _first_failure(error)
    return isinstance(failure, OSError) or (isinstance(failure, RuntimeError) and "unexpected pos" in str(failure))


def _in_words(error: CheckpointException, staging: Path) -> OSError:
    """DCP's report of a failed write as one line naming the folder: the first rank's failure, in words."""
    failure = _first_failure(error)
    # torch's writer reports a failed write as a RuntimeError ("unexpected pos"): judged by the disk, like an OSError
    as_os_error = failure if isinstance(failure, OSError) else OSError(errno.EIO, reason_of(failure))
    reason = full_disk_reason(staging, as_os_error) or reason_of(failure)
    return OSError(f"could not write the checkpoint into {str(staging)!r}: {reason}")
