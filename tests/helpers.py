"""Small models, data and an independent plain-PyTorch reference loop for the tests."""

from __future__ import annotations

import itertools
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_dataset(num_samples: int = 80, in_dim: int = 8, classes: int = 4, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, in_dim, generator=generator)
    y = torch.randint(0, classes, (num_samples,), generator=generator)
    return TensorDataset(x, y)


def make_optimizer(kind: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    raise ValueError(kind)


class TinyClassifier(pl.LightningModule):
    """An MLP classifier whose optimizer (and optional per-step LR schedule) the test chooses."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.1, step_lr_gamma: float | None = None, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.optimizer_kind, self.lr, self.step_lr_gamma = optimizer, lr, step_lr_gamma
        self.seen_lrs: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.seen_lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.optimizer_kind, self.parameters(), self.lr)
        if self.step_lr_gamma is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=self.step_lr_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def reference_windows(
    num_samples: int, micro_batch: int, steps: int, epochs: int, partial_window: str
) -> list[list[int]]:
    """Sample indices of each optimizer update for a plain loop with batch ``steps * micro_batch``."""
    window = steps * micro_batch
    if partial_window == "carry":
        stream = list(itertools.chain.from_iterable(range(num_samples) for _ in range(epochs)))
        return [stream[i : i + window] for i in range(0, len(stream) - window + 1, window)]
    windows = []
    for _ in range(epochs):
        for start in range(0, num_samples, window):
            chunk = list(range(start, min(start + window, num_samples)))
            if len(chunk) == window or partial_window == "scale":
                windows.append(chunk)
    return windows


def reference_train(
    model: TinyClassifier,
    dataset: TensorDataset,
    windows: list[list[int]],
    clip: tuple[float, str] | None = None,
) -> list[float]:
    """Train ``model`` with one plain PyTorch update per window; returns the LR used at each update."""
    optimizer = make_optimizer(model.optimizer_kind, model.parameters(), model.lr)
    scheduler = (
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=model.step_lr_gamma)
        if model.step_lr_gamma is not None
        else None
    )
    lrs = []
    x, y = dataset.tensors
    for indices in windows:
        optimizer.zero_grad()
        F.cross_entropy(model(x[indices]), y[indices]).backward()
        if clip is not None:
            value, algorithm = clip
            if algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), value)
            else:
                torch.nn.utils.clip_grad_value_(model.parameters(), value)
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return lrs


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)
