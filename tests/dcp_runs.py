"""Real multi-process DCP checkpoints for the layout and resharding tests.

``save_dcp_checkpoint`` spawns ``world_size`` gloo processes on CPU; each builds the same full tensors from a
seed, shards them with ``distribute_tensor`` on ``init_device_mesh("cpu", mesh_shape)`` and calls ``dcp.save``.
Rank 0 also writes the layout computed by ``layout_from_state_dict``. ``full_tensors`` rebuilds the full tensors
in the test process (the independent reference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.distributed import init_process_group, spawn

# name -> (shape, dtype name, placements as strings, one per mesh dim); all "state_dict.*" and "optimizer_0.*"
# names mimic Lightning's ModelParallelStrategy checkpoint keys.
TensorSpec = dict[str, tuple[tuple[int, ...], str, tuple[str, ...]]]


def full_tensors(spec: TensorSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, dtype, _) in sorted(spec.items()):
        values = torch.randn(shape, generator=generator, dtype=torch.float64)
        tensors[name] = (values * 100).to(getattr(torch, dtype))
    return tensors


NON_TENSOR_STATE = {"epoch": 3, "global_step": 17, "loops": {"fit_loop": {"batches": [1, 2, 3]}}}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        node = nested
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _parse_placement(text: str):
    """Placement strings to torch placements, without importing lightning_sink (and Lightning) in every worker."""
    import re

    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if text == "Replicate()":
        return Replicate()
    if match := re.match(r"^_StridedShard\((\d+),sf=(\d+)\)$", text):
        return _StridedShard(int(match.group(1)), split_factor=int(match.group(2)))
    return Shard(int(re.match(r"^Shard\((\d+)\)$", text).group(1)))


def _worker(
    rank: int, world_size: int, init_file: str, mesh_shape, dim_names, spec, seed, out_dir, plain_names, thread_count
):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    init_process_group(rank, world_size, init_file)
    try:
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=tuple(dim_names))
        flat: dict[str, Any] = {}
        for name, tensor in full_tensors(spec, seed).items():
            if name in plain_names:
                flat[name] = tensor
            else:
                placements = [_parse_placement(p) for p in spec[name][2]]
                flat[name] = distribute_tensor(tensor, mesh, placements)
        state = _nest(flat)
        state["meta"] = dict(NON_TENSOR_STATE)
        # thread_count > 1: each rank writes several files (__{rank}_0.distcp, __{rank}_1.distcp, ...)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(out_dir, thread_count=thread_count))
        # Each rank's own shards, as distribute_tensor cut them: the ground truth for the layout's chunks.
        local = {name: (v.to_local() if hasattr(v, "to_local") else v) for name, v in flat.items()}
        torch.save(local, Path(out_dir).parent / f"{Path(out_dir).name}.local_{rank}.pt")
        if rank == 0:  # only rank 0 pays for importing lightning_sink
            from lightning_sink.layout import layout_from_state_dict, save_layout

            save_layout(layout_from_state_dict(state), Path(out_dir) / "layout.json")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_dcp_checkpoint(
    out_dir: Path,
    spec: TensorSpec,
    mesh_shape: tuple[int, ...],
    dim_names: tuple[str, ...] | None = None,
    seed: int = 0,
    plain_names: tuple[str, ...] = (),
    thread_count: int = 1,
) -> Path:
    world_size = 1
    for size in mesh_shape:
        world_size *= size
    dim_names = dim_names or tuple(f"d{index}" for index in range(len(mesh_shape)))
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn(
        _worker,
        world_size,
        out_dir.parent / f".init_{out_dir.name}",
        mesh_shape,
        dim_names,
        spec,
        seed,
        str(out_dir),
        plain_names,
        thread_count,
    )
    return out_dir


def _dcp_load_worker(rank: int, world_size: int, init_file: str, layout_json: str, checkpoint_dir: str, out_file: str):
    """Build zero DTensors placed as the target layout says and let DCP reshard the checkpoint into them."""
    import json

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    layout = json.loads(layout_json)
    init_process_group(rank, world_size, init_file)
    try:
        mesh = init_device_mesh(
            "cpu", tuple(layout["mesh"]["shape"]), mesh_dim_names=tuple(layout["mesh"]["dim_names"])
        )
        flat: dict[str, Any] = {}
        for name, tensor in layout["tensors"].items():
            placements = [_parse_placement(p) for p in tensor["placements"]]
            shape = tuple(tensor["global_shape"])
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
            local = torch.zeros(local_shape, dtype=getattr(torch, tensor["dtype"]))
            flat[name] = DTensor.from_local(
                local,
                mesh,
                placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
        state = _nest(flat)
        dcp.load(state, checkpoint_id=checkpoint_dir)
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        loaded, _ = flatten_state_dict(state)
        torch.save({name: value.to_local() for name, value in loaded.items()}, f"{out_file}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def dcp_reshard_load(layout, checkpoint_dir: Path, out_prefix: Path) -> list[dict[str, torch.Tensor]]:
    """DCP's own load-time resharding onto ``layout`` (real gloo processes): each rank's local shards."""
    spawn(
        _dcp_load_worker,
        layout.world_size,
        out_prefix.parent / f".init_{out_prefix.name}",
        layout.to_json(),
        str(checkpoint_dir),
        str(out_prefix),
    )
    return [torch.load(f"{out_prefix}.{rank}", weights_only=True) for rank in range(layout.world_size)]
