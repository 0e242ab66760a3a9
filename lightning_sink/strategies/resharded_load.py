"""``Trainer.fit(ckpt_path=DST)`` where DST is the output folder of ``transform_checkpoints``.

A resharded folder holds ``MANIFEST.json`` and one file per target rank, ``rank_{r}/{prefix}{r}.pt``. Each rank
loads only its own file (SHA-256 checked against the manifest), checks that the file's target layout is the
run's device mesh, and fills the live model and optimizer through ``torch.distributed.checkpoint.state_dict``'s
``get_*_state_dict`` / ``set_*_state_dict`` and ``load_into_state_dict`` - the same steps Lightning's
``_load_checkpoint`` takes for a DCP folder, with the local shards read from the rank file instead of ``dcp.load``.
Lightning's metadata (loops, callbacks, schedulers, loss scale, the lightning_sink state) comes from the carried
``meta.pt`` bytes.

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

from lightning_sink import _lightning_compat as compat
from lightning_sink._fs import inside
from lightning_sink.layout.schema import Layout
from lightning_sink.reshard import load_into_state_dict, load_resharded_checkpoint
from lightning_sink.reshard.manifest import MANIFEST_FILE_NAME, read_manifest

__all__ = [
    "is_resharded_checkpoint",
    "rank_file",
    "check_layout_matches_mesh",
    "adapt_sink_state",
    "load_resharded_into_strategy",
]


def is_resharded_checkpoint(path: Path) -> bool:
    """A ``transform_checkpoints`` output folder (a manifest, no DCP ``.metadata``), or a folder of ``rank_{r}/``
    files written one by one by ``transform_checkpoint_by_rank`` (each with its ``.sha256`` sidecar)."""
    if not path.is_dir() or (path / ".metadata").exists():
        return False
    return (path / MANIFEST_FILE_NAME).is_file() or any((path / "rank_0").glob("*.pt.sha256"))


def rank_file(folder: Path, rank: int) -> Path:
    """``rank_{rank}/{prefix}{rank}.pt`` of a resharded folder: the prefix from its manifest, or (per-rank output
    without a manifest) the one ``.pt`` file with a ``.sha256`` sidecar in ``rank_{rank}/``."""
    if not (folder / MANIFEST_FILE_NAME).is_file():
        rank_dir = inside(folder, f"rank_{rank}", f"resharded checkpoint {str(folder)!r}")
        files = sorted(
            inside(rank_dir, sidecar.with_suffix("").name, f"resharded checkpoint {str(folder)!r}")
            for sidecar in rank_dir.glob("*.pt.sha256")
        )
        if len(files) != 1:
            raise ValueError(
                f"resharded checkpoint {str(folder)!r} has no MANIFEST.json and {len(files)} rank files"
                f" with a .sha256 sidecar in rank_{rank}/ (expected exactly 1 for this rank)"
            )
        return files[0]
    manifest = read_manifest(folder)  # (its ckpt_prefix is checked to be a plain file-name prefix)
    prefix = manifest.provenance.get("ckpt_prefix", "")
    world_size = manifest.provenance.get("world_size")
    if world_size is not None and rank >= world_size:
        raise ValueError(
            f"resharded checkpoint {str(folder)!r} was made for {world_size} ranks; this run has rank"
            f" {rank}: reshard for this run's mesh (its layout from `lightning-sink layout`)"
        )
    return inside(folder, f"rank_{rank}/{prefix}{rank}.pt", f"resharded checkpoint {str(folder)!r}")


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
    """The lightning_sink state of a checkpoint saved on another mesh, made valid for this one (module docstring)."""
    if state is None:
        return None
    window = state.get("window")
    if window is not None and window.get("micro_steps", 0) > 0:
        raise ValueError(
            f"resharded checkpoint {str(file)!r} was saved inside an accumulation window ({window['micro_steps']}"
            f" of {state.get('accumulation_steps')} micro-steps done): its partial gradient sums belong to the"
            " source mesh and cannot be resharded. Save at a window boundary (e.g. at the end of fit, as"
            " ReshardCheckpoint does) and reshard that checkpoint."
        )
    data = dict(state.get("data", {}))
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
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    file = rank_file(folder, strategy.global_rank)
    checkpoint = load_resharded_checkpoint(file)  # digest-verified, every tensor checked against its layout
    check_layout_matches_mesh(checkpoint["layout"], strategy.device_mesh, strategy.world_size, file)
    meta = checkpoint["extra_files"].get(compat.DCP_METADATA_FILE_NAME)
    if meta is None:
        raise ValueError(
            f"resharded checkpoint file {str(file)!r} carries no {compat.DCP_METADATA_FILE_NAME!r}"
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
