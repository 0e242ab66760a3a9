"""Loading a DCP checkpoint folder into a live model and its optimizers, with no code run from the files.

The steps of Lightning's ``ModelParallelStrategy`` loading of a sharded checkpoint (``get_*_state_dict``, ``dcp.load``,
``set_*_state_dict``, then ``meta.pt``), with every pickle read restricted: DCP's ``.metadata`` through this
package's metadata unpickler (DCP itself would ``pickle.load`` it), DCP's non-tensor values and ``meta.pt`` with
``weights_only=True`` unless the caller asks otherwise explicitly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_sink._torch_compat import MetadataCheckedReader, WeightsOnlyLoadPlanner
from lightning_sink.checkpoint_format.agreement import gather_from_every_rank
from lightning_sink.checkpoint_format.dcp_folder import LIGHTNING_META_FILE
from lightning_sink.checkpoint_format.fs import inside
from lightning_sink.checkpoint_format.save_digests import (
    SAVE_DIGESTS_FILE,
    RecordedFile,
    check_recorded_files,
    read_save_digests,
    share_of_files,
)
from lightning_sink.error_text import reason_of
from lightning_sink.layout.dcp_metadata import DCP_METADATA_FILE, read_dcp_metadata

__all__ = ["RankInWorld", "check_one_save", "load_dcp_folder"]


def _load(state: dict[str, Any], folder: Path) -> None:
    try:
        dcp.load(
            state, storage_reader=MetadataCheckedReader(folder, read_dcp_metadata), planner=WeightsOnlyLoadPlanner()
        )
    except dcp.CheckpointException as error:  # DCP wraps each rank's failure with its traceback: say the first
        failures = [failure[0] if isinstance(failure, tuple) else failure for failure in error.failures.values()]
        cause = failures[0] if failures else error
        first_line = (str(cause).strip().splitlines() or [""])[0]
        raise ValueError(
            f"DCP checkpoint {str(folder)!r} could not be loaded: {type(cause).__name__}: {first_line}"
        ) from None


def check_one_save(folder: Path, global_rank: int = 0, world_size: int = 1) -> None:
    """Where this package saved the folder (``SAVE_DIGESTS.json``): every file the load reads (``.metadata``, the
    ``.distcp`` shards, ``meta.pt``) has the SHA-256 and size recorded at the save, so a flipped byte or a file of
    another save is refused, naming the file and the tensor, before anything is loaded. Stock DCP folders record
    nothing and load as before.

    Called on every rank: each checks its share of the files (``share_of_files``: the largest first, balanced by
    bytes), and one collective gives every rank every rank's verdict, so all of them raise the same ValueError (the
    lowest failing rank's) - also when a rank could not read its share, or the ranks did not divide the files
    between them (they read different digests). Nothing waits on a rank that failed."""
    what = f"checkpoint folder {str(folder)!r}"
    names: list[str] = []
    checked: list[str] = []
    failure: str | None = None
    try:
        needed = _files_to_check(folder, what)
        if needed is not None:
            names, recorded = needed
            checked = share_of_files(recorded, names, global_rank, world_size)
            check_recorded_files(folder, recorded, checked, what)
    except ValueError as error:  # (this package's refusals: one line naming the file)
        failure = str(error)
    except Exception as error:
        failure = f"{what}: rank {global_rank} could not check its share of the files: {reason_of(error)}"
    _agree(checked, failure, names, world_size, what)


def _files_to_check(folder: Path, what: str) -> tuple[list[str], dict[str, RecordedFile]] | None:
    """The files a load reads and what ``SAVE_DIGESTS.json`` records (None: the folder has none), after checking that
    every file it records is in the folder."""
    recorded = read_save_digests(folder, what)
    if recorded is None:
        return None
    absent = sorted(name for name in recorded if not os.path.lexists(folder / name))
    if absent:
        raise ValueError(
            f"save digests {str(folder / SAVE_DIGESTS_FILE)!r}: records {absent[0]!r}"
            f"{f' and {len(absent) - 1} more' if len(absent) > 1 else ''}, which is not in the folder"
        )
    names = [DCP_METADATA_FILE, LIGHTNING_META_FILE]
    names += sorted(entry.name for entry in os.scandir(folder) if entry.name.endswith(".distcp"))
    return [name for name in names if os.path.lexists(folder / name)], recorded


def _agree(checked: list[str], failure: str | None, needed: list[str], world_size: int, what: str) -> None:
    """One collective: every rank's share and verdict; the first failure is raised on every rank."""
    reports = gather_from_every_rank((checked, failure), world_size)
    for report in reports:
        if report is not None and report[1] is not None:
            raise ValueError(report[1])
    covered = [name for report in reports if report is not None for name in report[0]]
    if sorted(covered) != sorted(needed):
        raise ValueError(
            f"{what}: the ranks did not share the check of its {len(needed)} files between them (they read"
            f" different {SAVE_DIGESTS_FILE} files): the checkpoint directory must be the same on every node"
        )


@dataclass(frozen=True)
class RankInWorld:
    """The loading process's global rank among the ``world_size`` processes that load the same folder together
    (and share the check of its files, ``check_one_save``); the default is a single process."""

    global_rank: int = 0
    world_size: int = 1


def load_dcp_folder(
    folder: Path,
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
    weights_only: bool | None,
    rank: RankInWorld = RankInWorld(),
) -> dict[str, Any]:
    """Fill ``module`` and ``optimizers`` (keys ``state_dict``, ``optimizer_{i}``) from the DCP folder; return the
    rest of the checkpoint (``meta.pt``: Lightning's loops, callbacks, schedulers...)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    check_one_save(folder, rank.global_rank, rank.world_size)
    read_dcp_metadata(folder)  # a foreign or hostile .metadata fails here, naming the file, before any collective
    model_state = {"state_dict": get_model_state_dict(module)}
    _load(model_state, folder)
    module.load_state_dict(model_state["state_dict"], strict=strict)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        _load(optimizer_state, folder)
        set_optimizer_state_dict(
            module, optimizer, optim_state_dict=optimizer_state[key], options=StateDictOptions(cpu_offload=True)
        )
    meta = inside(folder, LIGHTNING_META_FILE, f"checkpoint folder {str(folder)!r}")
    return torch.load(meta, map_location="cpu", weights_only=True if weights_only is None else weights_only)
