"""Loading a DCP checkpoint folder into a live model and its optimizers, with no code run from the files.

The steps of Lightning's ``ModelParallelStrategy`` loading of a sharded checkpoint (``get_*_state_dict``, ``dcp.load``,
``set_*_state_dict``, then ``meta.pt``), with every pickle read restricted: DCP's ``.metadata`` through this
package's metadata unpickler (DCP itself would ``pickle.load`` it), DCP's non-tensor values and ``meta.pt`` with
``weights_only=True`` unless the caller asks otherwise explicitly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_sink._torch_compat import MetadataCheckedReader, WeightsOnlyLoadPlanner
from lightning_sink.checkpoint_format.dcp_folder import LIGHTNING_META_FILE
from lightning_sink.checkpoint_format.fs import inside
from lightning_sink.checkpoint_format.save_digests import check_save_digests
from lightning_sink.layout.dcp_metadata import DCP_METADATA_FILE, read_dcp_metadata

__all__ = ["check_one_save", "load_dcp_folder"]


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


def check_one_save(folder: Path) -> None:
    """Where this package saved the folder (``SAVE_DIGESTS.json``): every file the load reads (``.metadata``, the
    ``.distcp`` shards, ``meta.pt``) has the SHA-256 and size recorded at the save, so a flipped byte or a file of
    another save is refused, naming the file, before anything is loaded. Each rank checks every file (it cannot know
    which ones DCP will read for it). Stock DCP folders record nothing and load as before."""
    names = [DCP_METADATA_FILE, LIGHTNING_META_FILE]
    names += sorted(entry.name for entry in os.scandir(folder) if entry.name.endswith(".distcp"))
    check_save_digests(
        folder, [name for name in names if os.path.lexists(folder / name)], f"checkpoint folder {str(folder)!r}"
    )


def load_dcp_folder(
    folder: Path,
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Fill ``module`` and ``optimizers`` (keys ``state_dict``, ``optimizer_{i}``) from the DCP folder; return the
    rest of the checkpoint (``meta.pt``: Lightning's loops, callbacks, schedulers...)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    check_one_save(folder)
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
