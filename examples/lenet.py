"""LeNet-5 as in MindSpore's model zoo (the network of its LeNet recipes), as a LightningModule with torchmetrics accuracy."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["LeNet5", "LeNet5Classifier"]


class LeNet5(nn.Module):
    """conv(1->6,5) relu pool, conv(6->16,5) relu pool, fc 400->120->84->classes; input 1x32x32."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class LeNet5Classifier(pl.LightningModule):
    """LeNet-5 trained with Momentum (SGD, momentum 0.9), as MindSpore's ``nn.Momentum(params, 0.01, 0.9)``."""

    def __init__(self, lr: float = 0.01, momentum: float = 0.9, num_classes: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = LeNet5(num_classes)
        self.test_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_accuracy(self(x), y)
        self.log("val_accuracy", self.val_accuracy, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_accuracy(self(x), y)
        self.log("test_accuracy", self.test_accuracy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
