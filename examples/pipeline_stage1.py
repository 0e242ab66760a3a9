"""Stage 1 of ``reshard_8_to_4.py --pipeline``: the tutorial's MLP in 2 pipeline stages on 8 processes.

Lightning has no pipeline-parallel strategy, so this stage is a hand-written PyTorch loop, as MindSpore's
pipeline example is its own script; what matters to the tutorial is what it leaves behind. Ranks 0-3 are stage 0
(layer1, layer2), ranks 4-7 stage 1 (layer3 and the loss). Each stage is a 2 x 2 mesh, data parallel x tensor
parallel, sharded as the non-pipeline stage 1 (FSDP2 over data parallel; layer1 split by output features, layer3
by input features). Rank r of stage 0 sends its activations to rank r + 4, which returns their gradient: one
micro-batch in flight (GPipe with one micro-batch), enough to produce a checkpoint saved by pipeline stages.

At the end every rank saves ``rank_{r}/checkpoint_{r}.pt``, its local shards named as a Lightning checkpoint names
them (``state_dict.net.1.weight``, ``optimizer_0.state.net.1.weight.exp_avg``, ...), and the first rank of each
stage saves the stage's layout (MindSpore's per-stage strategy file) to ``strategy/stage_{s}.json``.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler

from lightning_sink.layout import flatten_like_dcp, layout_from_state_dict, save_layout

from digits import DigitsDataModule

STAGES, STAGE_MESH = 2, (2, 2)  # pipeline stages; data parallel x tensor parallel inside each
WORLD_SIZE = STAGES * STAGE_MESH[0] * STAGE_MESH[1]
ACTIVATION = 512  # the width layer2 hands to layer3


class StageModel(nn.Module):
    """The tutorial's network (``net`` as in ``SeedMLP``, so parameter names match) with the other stage's layers
    replaced by ``Identity``: stage 0 keeps layer1 and layer2 (``net.1``, ``net.3``), stage 1 layer3 (``net.5``)."""

    def __init__(self, stage: int, in_features: int = 1024) -> None:
        super().__init__()
        self.stage = stage
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        dropped = (5,) if stage == 0 else (1, 3)
        for index in dropped:
            self.net[index] = nn.Identity()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net[:5](inputs) if self.stage == 0 else self.net[5](inputs)

    def shard(self, mesh) -> None:
        """TP on the stage's tensor-parallel dim, then FSDP2 over its data-parallel dim."""
        plan = (
            {"1": ColwiseParallel(output_layouts=Replicate())}
            if self.stage == 0
            else {"5": RowwiseParallel(input_layouts=Replicate())}
        )
        parallelize_module(self.net, mesh["tensor_parallel"], plan)
        for index in (1, 3) if self.stage == 0 else (5,):
            fully_shard(self.net[index], mesh=mesh["data_parallel"])
        fully_shard(self, mesh=mesh["data_parallel"])


class Pipeline:
    """This rank's stage, its optimizer, and its peer in the other stage."""

    def __init__(self, lr: float) -> None:
        rank = dist.get_rank()
        self.stage = rank // (WORLD_SIZE // STAGES)
        self.peer = rank + WORLD_SIZE // STAGES if self.stage == 0 else rank - WORLD_SIZE // STAGES
        world = init_device_mesh(
            "cpu", (STAGES, *STAGE_MESH), mesh_dim_names=("pipeline", "data_parallel", "tensor_parallel")
        )
        self.mesh = world["data_parallel", "tensor_parallel"]  # this stage's 2 x 2 mesh
        torch.manual_seed(0)  # both stages build the same initial network, then keep their own layers
        self.model = StageModel(self.stage)
        self.model.shard(self.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor | None:
        """Forward through both stages (and backward when ``train``); stage 1 returns the loss."""
        if self.stage == 0:
            with torch.set_grad_enabled(train):
                activations = self.model(x)
            dist.send(activations.detach().contiguous(), self.peer)
            if train:
                gradient = torch.empty_like(activations)
                dist.recv(gradient, self.peer)
                activations.backward(gradient)
            loss = None
        else:
            activations = torch.empty(len(y), ACTIVATION)
            dist.recv(activations, self.peer)
            activations.requires_grad_(train)
            with torch.set_grad_enabled(train):
                loss = F.cross_entropy(self.model(activations), y)
            if train:
                loss.backward()
                dist.send(activations.grad.contiguous(), self.peer)
        if train:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return loss

    def save(self, out: Path) -> None:
        """Local shards into ``rank_{r}/checkpoint_{r}.pt``; the stage's layout from its first rank."""
        state = {
            "state_dict": get_model_state_dict(self.model),
            "optimizer_0": get_optimizer_state_dict(self.model, self.optimizer),
        }
        local = {
            fqn: value.to_local() if isinstance(value, DTensor) else value
            for fqn, value in flatten_like_dcp(state).items()
            if isinstance(value, torch.Tensor)
        }
        rank = dist.get_rank()
        (out / "checkpoints" / f"rank_{rank}").mkdir(parents=True, exist_ok=True)
        torch.save(local, out / "checkpoints" / f"rank_{rank}" / f"checkpoint_{rank}.pt")
        if rank == self.mesh.mesh.flatten()[0].item():  # every rank of the stage would compute the same layout
            layout = layout_from_state_dict(
                state, world_size=WORLD_SIZE, pipeline_stage=self.stage, num_stages=STAGES, module=self.model
            )
            save_layout(layout, out / "strategy" / f"stage_{self.stage}.json")


def probe_loss(pipeline: Pipeline, x: torch.Tensor, y: torch.Tensor) -> float | None:
    with torch.no_grad():
        loss = pipeline.step(x, y, train=False)
    return None if loss is None else loss.item()


def train(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        pipeline = Pipeline(args.lr)
        data = DigitsDataModule(
            args.data_dir,
            batch_size=args.batch_size,
            max_train_samples=args.train_samples,
            max_test_samples=args.test_samples,
        )
        data.setup("fit")
        data_rank = (rank % (WORLD_SIZE // STAGES)) // STAGE_MESH[1]  # peers and TP ranks read the same batches
        sampler = DistributedSampler(data.train_set, num_replicas=STAGE_MESH[0], rank=data_rank, shuffle=True, seed=0)
        loader = DataLoader(data.train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
        probe_x, probe_y = (t[: args.probe_samples] for t in data.train_set.tensors)
        report(pipeline, "start", probe_loss(pipeline, probe_x, probe_y), 0)
        updates = 0
        for epoch in range(args.stage1_epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                pipeline.step(x, y)
                updates += 1
        report(pipeline, "end", probe_loss(pipeline, probe_x, probe_y), updates)
        pipeline.save(Path(args.out_dir) / "stage1_pipeline")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def report(pipeline: Pipeline, when: str, loss: float | None, updates: int) -> None:
    if loss is not None and dist.get_rank() == WORLD_SIZE // STAGES:  # the first rank of the last stage
        print(f"stage 1 (pipeline) {when}: updates {updates} probe loss {loss:.6f}", flush=True)


def run_pipeline_stage1(args: argparse.Namespace) -> None:
    """Start the 8 processes (spawned; they import this module) and wait for them."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(train, args=(args, port), nprocs=WORLD_SIZE, start_method="spawn")
