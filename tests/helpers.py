"""Small models, data and an independent plain-PyTorch reference loop for the tests."""

from __future__ import annotations

import itertools
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
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
    if kind == "adamw_fused":  # can skip an update on the device (found_inf)
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True)
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


class InjectingClassifier(TinyClassifier):
    """Multiplies the loss by inf at chosen global micro-batch indices (optionally on one rank only)."""

    def __init__(self, inf_at: tuple[int, ...] = (), inf_rank: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.inf_at, self.inf_rank = set(inf_at), inf_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        on_this_rank = self.inf_rank is None or self.global_rank == self.inf_rank
        if on_this_rank and self.trainer.fit_loop.total_batch_idx in self.inf_at:
            loss = loss * float("inf")
        return loss


def loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def group_windows(micro_batches_per_epoch: list[list[list[int]]], steps: int, partial_window: str) -> list[list[int]]:
    """Sample indices of each optimizer update, given each epoch's micro-batches (each a list of indices)."""
    if partial_window == "carry":
        stream = list(itertools.chain.from_iterable(micro_batches_per_epoch))
        return [sum(stream[i : i + steps], []) for i in range(0, len(stream) - steps + 1, steps)]
    windows = []
    for micro_batches in micro_batches_per_epoch:
        for start in range(0, len(micro_batches), steps):
            chunk = micro_batches[start : start + steps]
            if len(chunk) == steps or partial_window in ("scale", "lightning"):
                windows.append(sum(chunk, []))
    return windows


def reference_windows(
    num_samples: int, micro_batch: int, steps: int, epochs: int, partial_window: str
) -> list[list[int]]:
    """Update windows of a plain loop over ``range(num_samples)`` in order, batch ``steps * micro_batch``."""
    micro = [list(range(i, min(i + micro_batch, num_samples))) for i in range(0, num_samples, micro_batch)]
    return group_windows([micro] * epochs, steps, partial_window)


def ddp_reference_windows(
    num_samples: int, micro_batch: int, steps: int, epochs: int, partial_window: str, world: int
) -> list[list[int]]:
    """Update windows of a DDP run whose loader Lightning gave torch's shuffling ``DistributedSampler``."""
    from torch.utils.data import DistributedSampler

    per_epoch = []
    for epoch in range(epochs):
        per_rank = []
        for rank in range(world):
            sampler = DistributedSampler(range(num_samples), num_replicas=world, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            order = list(sampler)
            per_rank.append([order[i : i + micro_batch] for i in range(0, len(order), micro_batch)])
        per_epoch.append([sum(parts, []) for parts in zip(*per_rank)])  # micro-step k = all ranks' k-th batch
    return group_windows(per_epoch, steps, partial_window)


def reference_train(
    model: TinyClassifier,
    dataset: TensorDataset,
    windows: list[list[int]],
    clip: tuple[float, str] | None = None,
    skip: set[int] = frozenset(),
) -> list[float]:
    """Train ``model`` with one plain PyTorch update per window (none for windows in ``skip``); returns the LRs."""
    optimizer = make_optimizer(model.optimizer_kind, model.parameters(), model.lr)
    scheduler = (
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=model.step_lr_gamma)
        if model.step_lr_gamma is not None
        else None
    )
    lrs = []
    x, y = dataset.tensors
    for window, indices in enumerate(windows):
        if window in skip:
            continue
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


class RecordingLogger(Logger):
    """Every point Lightning writes to the loggers, as ``(step, {name: value})`` in the order written."""

    def __init__(self) -> None:
        super().__init__()
        self.points: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.points.append((step, {name: float(value) for name, value in metrics.items()}))

    def values(self, skip: tuple[str, ...] = ()) -> list[tuple[int | None, str, float]]:
        """Every value written, as ``(step, name, value)``, leaving out the names in ``skip``."""
        return [
            (step, name, value) for step, metrics in self.points for name, value in metrics.items() if name not in skip
        ]

    def by_step_and_name(self) -> dict[tuple[int | None, str], list[float]]:
        """The values written at each ``(step, name)``, in order."""
        found: dict[tuple[int | None, str], list[float]] = {}
        for step, name, value in self.values():
            found.setdefault((step, name), []).append(value)
        return found
