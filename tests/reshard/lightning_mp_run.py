"""A tiny Lightning ModelParallelStrategy run (4 gloo processes on CPU, FSDP2 + TP in configure_model) that
saves its sharded checkpoint: ``python tests/reshard/lightning_mp_run.py OUT_DIR``. Lightning relaunches this
script for ranks 1..3."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ShardedMLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 12), nn.Linear(12, 3)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(
            self, self.device_mesh["tensor_parallel"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        )
        for layer in (self.fc1, self.fc2):
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def forward(self, x):  # FSDP2 gathers parameters in forward hooks: go through __call__
        return self.fc2(torch.tanh(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main(out_dir: str) -> None:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, generator=generator), torch.randint(0, 3, (32,), generator=generator))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ShardedMLP(), DataLoader(data, batch_size=4))
    trainer.save_checkpoint(out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
