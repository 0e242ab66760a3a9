"""What each ``LearningRateMonitor`` would have written inside a sink: Lightning runs a monitor's batch-start hook
at every batch, but a sink is one Lightning batch, so the hook sees only the sink's first update. The sink's log
buffer (``sink/logging.py``) notes the optimizers' settings after each update whose next update Lightning would
log, and at the sink's end ``replay`` runs each monitor's hook as of that moment, at that logging step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor
from torch import Tensor
from torch.optim import Optimizer

from lightning_sink import _lightning_compat as compat

__all__ = ["LearningRateReplay", "Settings"]

# One optimizer's param-group settings (everything but the parameters), as LearningRateMonitor reads them.
Settings = list[dict[str, Any]]


class LearningRateReplay:
    """The fit's ``LearningRateMonitor`` callbacks, run again at the updates a sink hid from them."""

    def __init__(self, module: pl.LightningModule) -> None:
        self._module = module
        self._trainer = module.trainer
        self.monitors = [
            callback
            for callback in compat.trainer_settings(self._trainer).callbacks
            if isinstance(callback, LearningRateMonitor)
        ]

    def settings_now(self) -> list[Settings]:
        """Every optimizer's settings as they are now (after an update and its schedulers' steps)."""
        return [_settings_of(optimizer) for optimizer in self._trainer.optimizers]

    def replay(self, global_step: int, settings: list[Settings]) -> None:
        """Each monitor's batch-start hook as Lightning would have run it at the next update's start: at that
        logging step, with the optimizer settings of that moment."""
        trainer = self._trainer
        with (
            _settings_applied(trainer.optimizers, settings),
            compat.logging_step_set_to(trainer, global_step),
        ):
            for monitor in self.monitors:
                monitor.on_train_batch_start(trainer, self._module, None, 0)


def _settings_of(optimizer: Optimizer) -> Settings:
    """A copy of every param group's settings; tensors (a tensor learning rate) are cloned, schedulers change
    them in place."""
    return [
        {
            name: value.clone() if isinstance(value, Tensor) else value
            for name, value in group.items()
            if name != "params"
        }
        for group in optimizer.param_groups
    ]


@contextmanager
def _settings_applied(optimizers: list[Optimizer], settings: list[Settings]) -> Iterator[None]:
    """The optimizers' param groups with the given settings for the duration of the block; the very same objects
    (a tensor learning rate a fused optimizer holds on to) are put back after it."""
    current = [
        [{name: value for name, value in group.items() if name != "params"} for group in optimizer.param_groups]
        for optimizer in optimizers
    ]
    for optimizer, groups in zip(optimizers, settings):
        for group, values in zip(optimizer.param_groups, groups):
            group.update(values)
    try:
        yield
    finally:
        for optimizer, groups in zip(optimizers, current):
            for group, values in zip(optimizer.param_groups, groups):
                group.update(values)
