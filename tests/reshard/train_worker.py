"""Gloo workers for the train -> reshard -> continue test (plain torch: DTensor, FSDP2, tensor parallel, Adam).

Phase "train": 4 ranks on a 2x2 (dp, tp) mesh train a few steps and ``dcp.save`` model + optimizer state.
Phase "resume": 2 ranks with another split (tp=2 only) continue, with a fresh model each time, from a resharded
file (mode "resharded") and from DCP's own load-time resharding of the original folder (mode "dcp"); both record
losses and final parameters.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests import distributed

STEPS_BEFORE, STEPS_AFTER, GLOBAL_BATCH = 3, 3, 8


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator)


def build(mesh_shape, names):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = MLP()
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if "dp" in names:
        fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    return mesh, model, optimizer


def train_steps(model, optimizer, mesh, first_step: int, count: int) -> list[float]:
    dp_size = mesh["dp"].size() if "dp" in mesh.mesh_dim_names else 1
    dp_rank = mesh["dp"].get_local_rank() if "dp" in mesh.mesh_dim_names else 0
    losses = []
    for step in range(first_step, first_step + count):
        x, y = batch(step)
        local = slice(dp_rank * GLOBAL_BATCH // dp_size, (dp_rank + 1) * GLOBAL_BATCH // dp_size)
        loss = F.cross_entropy(model(x[local]), y[local])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # mean over dp ranks, for the record (tp ranks hold the same loss)
        losses.append(mean.item() / dist.get_world_size() * mesh["tp"].size())
    return losses


MESHES = {"dp2_tp2": ((2, 2), ("dp", "tp")), "tp2": ((2,), ("tp",))}


def _phase_train(rank: int, world_size: int, init_file: str, mesh_name: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    distributed.init_process_group(rank, world_size, init_file)
    try:
        mesh, model, optimizer = build(*MESHES[mesh_name])
        train_steps(model, optimizer, mesh, 0, STEPS_BEFORE)
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=out)
        # What training would do next on the original layout: the losses a resumed run should continue.
        next_losses = train_steps(model, optimizer, mesh, STEPS_BEFORE, STEPS_AFTER)
        if rank == 0:
            torch.save(next_losses, f"{out}.continued.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _phase_resume(rank: int, world_size: int, init_file: str, mesh_name: str, source: str, out: str) -> None:
    distributed.init_process_group(rank, world_size, init_file)
    try:
        for mode in ("resharded", "dcp"):
            _resume(rank, mesh_name, source, mode, out)
    finally:
        dist.destroy_process_group()


def _resume(rank: int, mesh_name: str, source: str, mode: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lightning_sink.layout import layout_from_state_dict, save_layout
    from lightning_sink.reshard import (
        load_into_state_dict,
        load_resharded_checkpoint,
        to_dtensors,
        transform_checkpoints,
    )

    # A fresh model and optimizer per mode.
    mesh, model, optimizer = build(*MESHES[mesh_name])
    model_state, optim_state = get_state_dict(model, optimizer)  # initialises Adam's state (zeros)
    state = {"model": model_state, "optim": optim_state}
    if mode == "resharded":
        if rank == 0:  # offline conversion; the target layout comes from this run's own state dict
            layout = save_layout(layout_from_state_dict(state), Path(out) / "target_layout.json")
            transform_checkpoints(source, Path(out) / "resharded", "ckpt_", None, layout)
        dist.barrier()
        checkpoint = load_resharded_checkpoint(Path(out) / "resharded" / f"rank_{rank}" / f"ckpt_{rank}.pt")
        load_into_state_dict(state, checkpoint)
        # The same shards as DTensors on this mesh (to_dtensors) are the values just loaded.
        rebuilt = to_dtensors(checkpoint, mesh)
        for name, value in state["model"].items():
            assert rebuilt[f"model.{name}"].to_local().shape == value.to_local().shape, name
            assert torch.equal(rebuilt[f"model.{name}"].full_tensor(), value.full_tensor()), name
    else:
        dcp.load(state, checkpoint_id=source)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = train_steps(model, optimizer, mesh, STEPS_BEFORE, STEPS_AFTER)
    params = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    exp_avg = {
        name: s["exp_avg"].full_tensor().clone() for name, s in get_state_dict(model, optimizer)[1]["state"].items()
    }
    if rank == 0:
        torch.save({"losses": losses, "params": params, "exp_avg": exp_avg}, Path(out) / f"result_{mode}.pt")
    dist.barrier()


def spawn(phase: str, world_size: int, *args: str) -> None:
    target = _phase_train if phase == "train" else _phase_resume
    distributed.spawn(target, world_size, f"{args[-1]}.init_{phase}", *args)
