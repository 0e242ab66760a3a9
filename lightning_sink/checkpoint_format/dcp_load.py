"""Loading a DCP checkpoint folder into a live model and its optimizers, with no code run from the files.

The steps of Lightning's ``ModelParallelStrategy`` loading of a sharded checkpoint (``get_*_state_dict``, ``dcp.load``,
``set_*_state_dict``, then ``meta.pt``), with every pickle read restricted: DCP's ``.metadata`` through this
package's metadata unpickler (DCP itself would ``pickle.load`` it), DCP's non-tensor values and ``meta.pt`` with
``weights_only=True`` unless the caller asks otherwise explicitly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_sink._torch_compat import MetadataCheckedReader, WeightsOnlyLoadPlanner
from lightning_sink.checkpoint_format.dcp_folder import LIGHTNING_META_FILE
from lightning_sink.checkpoint_format.fs import inside
from lightning_sink.layout.dcp_metadata import read_dcp_metadata

__all__ = ["load_dcp_folder"]


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
