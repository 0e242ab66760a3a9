"""Shared pieces of the callback tests: a module that records the loss of every step, a plain-PyTorch reference
loop, MindSpore's line format, and a stdout-line reader."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from tests.helpers import TinyClassifier, make_optimizer

# MindSpore's LossMonitor lines with dataset_sink_mode=True, sink_size=1000, verbatim.
MINDSPORE_LINES = (
    "epoch: 1 step: 1000, loss is 0.5399815",
    "epoch: 10 step: 1000, loss is 0.01490275",
    "epoch: 9 step: 1000, loss is 0.00017951085",
)
LOSS_LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\S+)$")
MICRO, SAMPLES = 4, 40  # 10 micro-batches per data pass


class RecordingClassifier(TinyClassifier):
    """Records the loss of every training step (the loss the step produced); NaN from the ``nan_at``-th step on."""

    def __init__(self, nan_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nan_at = nan_at
        self.step_losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.nan_at is not None and len(self.step_losses) >= self.nan_at:
            loss = loss * float("nan")
        self.step_losses.append(loss.detach().clone())
        return loss


def reference_losses(model: TinyClassifier, dataset: TensorDataset, window_sizes: list[int]) -> list[torch.Tensor]:
    """Plain PyTorch: the continuous, unshuffled micro-batch stream, one update per window of the given sizes."""
    optimizer = make_optimizer(model.optimizer_kind, model.parameters(), model.lr)
    x, y = dataset.tensors
    batches_per_pass = len(y) // MICRO
    losses, step = [], 0
    for size in window_sizes:
        optimizer.zero_grad()
        for _ in range(size):
            start = (step % batches_per_pass) * MICRO
            loss = F.cross_entropy(model(x[start : start + MICRO]), y[start : start + MICRO])
            (loss / size).backward()
            losses.append(loss.detach())
            step += 1
        optimizer.step()
    return losses


def epoch_windows(steps_per_epoch: int, accumulation: int, epochs: int) -> list[int]:
    """Window sizes outside sink mode with partial_window='scale': the last window of an epoch may be short."""
    whole, rest = divmod(steps_per_epoch, accumulation)
    return ([accumulation] * whole + ([rest] if rest else [])) * epochs


def loss_lines(text: str) -> list[tuple[int, int, str]]:
    """(epoch, step, printed loss) of every loss line in captured stdout."""
    return [(int(m[1]), int(m[2]), m[3]) for m in map(LOSS_LINE.match, text.splitlines()) if m]


class InfAtSteps(RecordingClassifier):
    """Multiplies the loss of the chosen steps (0-based, counted over the run) by ``factor``: an overflow there.

    ``factor=1e36`` keeps the loss itself finite while the scaled loss (scale >= 1024) overflows float32, as an fp16
    overflow does in real training; ``inf`` makes the loss itself infinite.
    """

    def __init__(self, inf_at: tuple[int, ...] = (), factor: float = float("inf"), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inf_at, self.factor = set(inf_at), factor
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.calls += 1
        return loss * self.factor if self.calls - 1 in self.inf_at else loss


def dynamic_scale_rule(updates: int, overflow_at: set[int], init_scale: float, scale_window: int) -> list[tuple]:
    """The documented DynamicLossScale rule with hysteresis=1, factor 2: (scale, overflow, skipped) after each
    update (1-based update numbers in ``overflow_at``)."""
    scale, growth, skipped, states = init_scale, 0, 0, []
    for update in range(1, updates + 1):
        overflow = update in overflow_at
        if overflow:
            growth, scale, skipped = 0, max(scale / 2, 1.0), skipped + 1
        else:
            growth += 1
            if growth == scale_window:
                growth, scale = 0, min(scale * 2, 2.0**24)
        states.append((scale, overflow, skipped))
    return states
