"""Pieces the benchmarks share: a classifier LightningModule around any net, and a quiet CPU Trainer."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class NetClassifier(pl.LightningModule):
    """Cross-entropy on ``net``'s logits, SGD with momentum 0.9."""

    def __init__(self, net: nn.Module, lr: float = 0.01) -> None:
        super().__init__()
        self.net, self.lr = net, lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A CPU Trainer without logger, checkpoints, progress bar or summary, so only training is measured."""
    return pl.Trainer(**{"accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                         "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                         **kwargs})
