"""Small modules with a ``training_step``, their batches, and the plain PyTorch loop the compiled programs are held
to (written here, independent of the package)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Classifier(nn.Module):
    """Cross-entropy on a small net's logits; logs twice the loss and the logits' mean, as a LightningModule would
    with ``self.log``."""

    def __init__(self, batch_norm: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(8, 16)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(16))
        layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 4)]
        self.net = nn.Sequential(*layers)

    def log(self, name: str, value: Any, **kwargs: Any) -> None:  # replaced while a compiled program runs
        pass

    def loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self.net(x)
        return F.cross_entropy(logits, y), logits.mean()

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        loss, mean = self.loss(batch)
        self.log("double_loss", 2 * loss, prog_bar=True)
        self.log("logits_mean", mean)
        return loss


class ConvClassifier(Classifier):
    """The same module with a small convolution net with max-pooling on 1x14x14 images (``make_image_batches``):
    the kind of net whose layouts Inductor would change on a CPU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 8, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32, 4),
        )


def make_image_batches(count: int, batch_size: int = 6, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, 1, 14, 14, generator=generator),
            torch.randint(0, 4, (batch_size,), generator=generator),
        )
        for _ in range(count)
    ]


def make_batches(count: int, batch_size: int = 6, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch_size, 8, generator=generator), torch.randint(0, 4, (batch_size,), generator=generator))
        for _ in range(count)
    ]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3, amsgrad=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.99)),
}


def windows_of(batches: list, accumulation: int) -> list[list]:
    """Consecutive windows of ``accumulation`` micro-batches; the last one may be shorter (a partial window)."""
    return [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]


def eager_loop(
    model: Classifier,
    optimizer: torch.optim.Optimizer,
    windows: list[list],
    clip: tuple[str, float] | None = None,
    scheduler: Any = None,
    scaler: torch.amp.GradScaler | None = None,
) -> list[dict[str, float]]:
    """The plain loop: each window's mean loss backward, clipping, the step (through ``scaler`` if given), the
    scheduler; returns what ``training_step`` logs per micro-batch."""
    logged = []
    for window in windows:
        optimizer.zero_grad()
        for batch in window:
            loss, mean = model.loss(batch)
            logged.append({"double_loss": 2 * loss.item(), "logits_mean": mean.item()})
            scaled = loss / len(window)
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        if clip is not None and clip[0] == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip[1])
        elif clip is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip[1])
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return logged


def run_programs(programs: Any, windows: list[list], scheduler: Any = None) -> list[dict[str, float]]:
    """The same windows through the compiled programs (update on each window's last micro-batch)."""
    logged = []
    for window in windows:
        for position, batch in enumerate(window):
            last = position == len(window) - 1
            outputs = programs.update(batch) if last else programs.accumulate(batch)
            logged.append({name: value.item() for name, value in outputs.logs.items()})
        if scheduler is not None:
            scheduler.step()
    return logged


def max_relative_difference(model: nn.Module, reference: nn.Module) -> float:
    pairs = list(zip(model.state_dict().values(), reference.state_dict().values()))
    return max(
        ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12)).item() for a, b in pairs
    )
