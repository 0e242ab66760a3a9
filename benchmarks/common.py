"""Pieces the benchmarks share: a classifier LightningModule around any net, and a quiet CPU Trainer."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


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
    return pl.Trainer(**{"accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                         "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                         **kwargs})


def default_trainer(root_dir: str, **kwargs: Any) -> pl.Trainer:
    """A Trainer as a user gets it by default (TensorBoard logger, progress bar), minus checkpoint files."""
    return pl.Trainer(**{"default_root_dir": root_dir, "enable_checkpointing": False, "enable_model_summary": False,
                         "num_sanity_val_steps": 0, **kwargs})
