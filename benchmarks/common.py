"""Pieces the benchmarks share: the two small nets and their random data, a classifier LightningModule around any
net, quiet and default CPU Trainers, a callback timing optimizer steps, and the hand-written loops' CUDA check."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from lightning_sink import cuda_check

from lenet import LeNet5

MODELS = ("tiny_mlp", "lenet5")


@contextlib.contextmanager
def plain_torch_cuda_check() -> Iterator[None]:
    """Run the block (or, as a decorator, the function) with torch's CUDA check as a process that never imported
    Lightning has it (``PYTORCH_NVML_BASED_CUDA_CHECK`` unset), and give the setting back after: every hand-written
    loop, the anchor of each figure, is plain PyTorch's whatever Lightning or a sink strategy set it to. (Without
    NVML's library, Lightning's ``1`` makes each optimizer ``step`` try and fail to load it: ``lightning_sink/cuda_check.py``.)"""
    saved = os.environ.pop(cuda_check.VARIABLE, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[cuda_check.VARIABLE] = saved


def make_model(name: str) -> nn.Module:
    """``"tiny_mlp"``: 64-64-10; ``"lenet5"``: LeNet-5 on 1x32x32. Seeded, so every configuration starts alike."""
    torch.manual_seed(0)
    if name == "tiny_mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return LeNet5()


def make_loader(name: str, batch_size: int = 32, batches: int = 512) -> DataLoader:
    """Random inputs for ``make_model(name)`` and labels in memory, shuffled, ``batches`` whole batches an epoch."""
    shape = (64,) if name == "tiny_mlp" else (1, 32, 32)
    samples = batch_size * batches
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(samples, *shape, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )
    return DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True)


class NetClassifier(pl.LightningModule):
    """Cross-entropy on ``net``'s logits, SGD with momentum 0.9; ``log_loss`` logs it as a typical module does."""

    def __init__(self, net: nn.Module, lr: float = 0.01, log_loss: bool = False) -> None:
        super().__init__()
        self.net, self.lr, self.log_loss = net, lr, log_loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.log_loss:
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A Trainer without logger, checkpoints, progress bar or summary, so only training is measured."""
    return pl.Trainer(
        **{
            "accelerator": "cpu",
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            **kwargs,
        }
    )


def default_trainer(root_dir: str, **kwargs: Any) -> pl.Trainer:
    """A Trainer as a user gets it by default (TensorBoard logger, progress bar), minus checkpoint files."""
    return pl.Trainer(
        **{
            "default_root_dir": root_dir,
            "enable_checkpointing": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            **kwargs,
        }
    )


def synchronize(device: torch.device) -> None:
    """A GPU may still be working through queued kernels when the host reads its clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer(pl.Callback):
    """Wall time and optimizer steps from the first Lightning batch that starts at ``global_step >= warmup_steps``
    to the end of training (a sink is one Lightning batch, so sink runs are timed from a sink boundary)."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps, self.start = warmup_steps, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.start is None and trainer.global_step >= self.warmup_steps:
            self.start, self.start_step = time.perf_counter(), trainer.global_step

    def on_train_end(self, trainer, module):
        synchronize(module.device)
        self.seconds, self.steps = time.perf_counter() - self.start, trainer.global_step - self.start_step


class SinkClock(pl.Callback):
    """Each Lightning batch's wall time: in sink mode, each sink's seconds."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)
