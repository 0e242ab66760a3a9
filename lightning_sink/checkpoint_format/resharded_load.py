"""``Trainer.fit(ckpt_path=DST)`` where DST is the output folder of ``transform_checkpoints``.

A resharded folder (resharded_folder.py) holds one file per target rank. Each rank loads only its own file
(SHA-256 checked against the manifest), checks that the file's target layout is the run's device mesh, and fills
the live model and optimizer through ``torch.distributed.checkpoint.state_dict``'s ``get_*_state_dict`` /
``set_*_state_dict`` and ``load_into_state_dict`` - the same steps Lightning's ``_load_checkpoint`` takes for a
DCP folder, with the local shards read from the rank file instead of ``dcp.load``. Lightning's metadata (loops,
callbacks, schedulers, loss scale, the lightning_sink state) comes from the carried ``meta.pt`` bytes.

The lightning_sink state is saved by a run with another mesh, so it is adapted here (see ``adapt_sink_state``):

- the accumulation window must be closed: a checkpoint saved inside a window holds every source rank's partial
  gradient sums on the source layout, which no other mesh can continue; it is refused.
- the data position must be at a data-pass boundary outside sink mode: Lightning's own mid-epoch batch counter and
  the per-rank loader length both depend on the data-parallel size. In sink mode (``sink_size=K``, where a
  Lightning epoch is one sink and Lightning counts no loader batches) a mid-pass position restarts that pass: the
  pass index (the sampler's epoch) is kept and the pass is read from its start.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lightning_sink.checkpoint_format.dcp_folder import LIGHTNING_META_FILE
from lightning_sink.checkpoint_format.live_state import load_into_state_dict
from lightning_sink.checkpoint_format.rank_file import load_resharded_checkpoint
from lightning_sink.checkpoint_format.resharded_folder import rank_file_path
from lightning_sink.layout.schema import Layout

__all__ = [
    "check_layout_matches_mesh",
    "adapt_sink_state",
    "load_resharded_into_strategy",
]


def check_layout_matches_mesh(layout: Layout, device_mesh: Any, world_size: int, file: Path) -> None:
    """The file's target mesh (shape, dim names, rank order) must be the run's ``device_mesh``."""
    actual = (
        tuple(device_mesh.mesh.shape),
        tuple(device_mesh.mesh_dim_names or ()),
        device_mesh.mesh.flatten().tolist(),
    )
    expected = (layout.mesh.shape, tuple(layout.mesh.dim_names), layout.mesh.flat_ranks())
    if layout.world_size != world_size or actual != expected:
        raise ValueError(
            f"resharded checkpoint file {str(file)!r} was made for {layout.world_size} ranks on mesh"
            f" {dict(zip(expected[1], expected[0]))} (ranks {expected[2]}), but this run has {world_size} ranks on"
            f" mesh {dict(zip(actual[1], actual[0]))} (ranks {actual[2]}): reshard for this run's layout"
            " (`lightning-sink layout` with its data_parallel_size and tensor_parallel_size)"
        )


def adapt_sink_state(state: dict[str, Any] | None, file: Path, sink_mode: bool) -> dict[str, Any] | None:
    """The lightning_sink state of a checkpoint saved on another mesh, made valid for this one (module docstring).
    A malformed state is returned as it is: the strategy's state check refuses it, naming the field."""
    if not isinstance(state, dict):
        return state
    window, data = state.get("window"), state.get("data")
    if not (isinstance(window or {}, dict) and isinstance(data, dict)):
        return state
    micro_steps = window.get("micro_steps", 0) if window is not None else 0
    if type(micro_steps) is not int or type(data.get("trained_in_pass", 0)) is not int:
        return state
    if micro_steps > 0:
        raise ValueError(
            f"resharded checkpoint {str(file)!r} was saved inside an accumulation window ({micro_steps}"
            f" of {state.get('accumulation_steps')} micro-steps done): its partial gradient sums belong to the"
            " source mesh and cannot be resharded. Save at a window boundary (e.g. at the end of fit, as"
            " ReshardCheckpoint does) and reshard that checkpoint."
        )
    data = dict(data)
    if data.get("trained_in_pass", 0) > 0:
        if not sink_mode:
            raise ValueError(
                f"resharded checkpoint {str(file)!r} was saved after {data['trained_in_pass']} batches of a data"
                " pass: on another data-parallel size neither the per-rank position nor Lightning's mid-epoch"
                " batch count carry over. Save at the end of an epoch (max_epochs, or ReshardCheckpoint at the"
                " end of such a fit), or train in sink mode (sink_size=K), where the pass restarts."
            )
        data["trained_in_pass"] = 0  # sink mode: the interrupted pass is read again from its start
    return {**state, "window": None, "data": data}


def load_resharded_into_strategy(strategy: Any, folder: Path, weights_only: bool | None) -> dict[str, Any]:
    """Fill ``strategy``'s model and optimizers from this rank's file; return Lightning's metadata (``meta.pt``)."""
    file = rank_file_path(folder, strategy.global_rank)
    checkpoint = load_resharded_checkpoint(file)  # digest-verified, every tensor checked against its layout
    check_layout_matches_mesh(checkpoint["layout"], strategy.device_mesh, strategy.world_size, file)
    meta = checkpoint["extra_files"].get(LIGHTNING_META_FILE)
    if meta is None:
        raise ValueError(
            f"resharded checkpoint file {str(file)!r} carries no {LIGHTNING_META_FILE!r}"
            " (Lightning's loops and callbacks): its source was not a Lightning checkpoint"
        )
    module, strict = strategy.model, strategy.lightning_module.strict_loading
    model_state = {"state_dict": get_model_state_dict(module)}
    load_into_state_dict(model_state, checkpoint, strict=strict)
    module.load_state_dict(model_state["state_dict"], strict=strict)
    for index, optimizer in enumerate(strategy.optimizers):
        key = f"optimizer_{index}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}  # (initialises Adam's state first)
        try:
            load_into_state_dict(optimizer_state, checkpoint, strict=True)
        except ValueError as error:
            raise ValueError(
                f"resharded checkpoint file {str(file)!r} lacks state of optimizer {index} ({error}). A file converted"
                " for inference (a layout with parameters only, `lightning-sink layout --no-optimizer`) can be used by"
                " Trainer.test/predict, not to resume Trainer.fit: reshard with a layout that includes the optimizer."
            ) from None
        set_optimizer_state_dict(
            module, optimizer, optim_state_dict=optimizer_state[key], options=StateDictOptions(cpu_offload=True)
        )
    # Unset means torch's own default, True: no code is unpickled from the carried Lightning state.
    return torch.load(io.BytesIO(meta), map_location="cpu", weights_only=True if weights_only is None else weights_only)
