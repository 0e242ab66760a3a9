"""Sharded training with accumulation: an MLP on MNIST, 2-way data parallel x 2-way tensor parallel, 4 processes.

    python examples/model_parallel_mnist.py                                  # 4 gloo processes on CPU
    python examples/model_parallel_mnist.py --max-train-samples 8192 --checkpoint runs/mp.ckpt

The first Linear is split column-wise and the second row-wise over the tensor-parallel ranks, and each Linear is
fully sharded (FSDP2) over the data-parallel ranks. ``SinkModelParallelStrategy(accumulation_steps=N)`` turns FSDP2's
gradient sync off for N-1 micro-batches and reduce-scatters once per window. Lightning's launcher starts ranks 1-3 by
re-running this script. Offline: MNIST from ``--data-dir`` (torchvision layout) or sklearn digits as a fallback.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torchmetrics.classification import MulticlassAccuracy

from lightning_sink import SinkModelParallelStrategy

from digits import DigitsDataModule, exit_on_missing_data


class ShardedMLP(pl.LightningModule):
    """1024 (32x32 pixels) -> hidden -> 10, sharded in ``configure_model``."""

    def __init__(self, hidden: int = 512, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.test_accuracy = MulticlassAccuracy(num_classes=10, average="micro")

    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):
            return  # already sharded (Trainer.test after Trainer.fit calls this again)
        mesh = self.device_mesh
        # The layers hand DTensors on (use_local_output=False) and ``forward`` takes the local tensor at the end,
        # outside the FSDP2 modules: a local tensor is a view, and FSDP2 warns about modules that return views.
        plan = {"1": ColwiseParallel(use_local_output=False), "3": RowwiseParallel(use_local_output=False)}
        parallelize_module(self.net, mesh["tensor_parallel"], plan)
        for index in (1, 3):
            fully_shard(self.net[index], mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        return logits.to_local() if isinstance(logits, DTensor) else logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_accuracy(self(x).argmax(dim=1), y)
        self.log("test_accuracy", self.test_accuracy, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (torchvision layout)")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="micro-batch size per data-parallel rank")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-train-samples", type=int, default=16384)
    parser.add_argument("--checkpoint", default=None, help="save a DCP checkpoint folder (with layout.json) here")
    args = parser.parse_args(argv)

    pl.seed_everything(0, verbose=False)
    data = DigitsDataModule(args.data_dir, batch_size=args.batch_size, max_train_samples=args.max_train_samples)
    strategy = SinkModelParallelStrategy(
        args.data_parallel_size,
        args.tensor_parallel_size,
        accumulation_steps=args.accumulation_steps,
        process_group_backend="gloo",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.data_parallel_size * args.tensor_parallel_size,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = ShardedMLP()
    started = time.perf_counter()
    data.setup()
    trainer.fit(model, train_dataloaders=data.train_dataloader())  # (the model has no validation step)
    seconds = time.perf_counter() - started
    if args.checkpoint:
        trainer.save_checkpoint(args.checkpoint, weights_only=False)
    accuracy = trainer.test(model, datamodule=data, verbose=False)[0]["test_accuracy"]
    if trainer.is_global_zero:
        global_batch = args.batch_size * args.accumulation_steps * args.data_parallel_size
        print(
            f"data: {data.source}; mesh {args.data_parallel_size} x {args.tensor_parallel_size};"
            f" {trainer.global_step} updates of {global_batch} samples"
            f" ({args.accumulation_steps} micro-batches of {args.batch_size} per data-parallel rank) in {seconds:.1f} s"
        )
        print(f"final test accuracy: {accuracy:.4f}" + (f"; checkpoint: {args.checkpoint}" if args.checkpoint else ""))


if __name__ == "__main__":
    exit_on_missing_data(main)
