"""The step and hook name Lightning's logging files ``self.log`` values under, and its first-batch flag."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import lightning.pytorch as pl

from lightning_sink._lightning_compat.loop_access import automatic_optimization, epoch_loop


def set_logging_step(trainer: pl.Trainer, updated: bool) -> None:
    """The step the loggers write this sink's values at: as stock Lightning, the ``global_step`` before the batch's
    own increment (which Lightning makes after logging, only for a batch that updated)."""
    completed = automatic_optimization(trainer).optim_progress.optimizer.step.total.completed
    epoch_loop(trainer)._batches_that_stepped = completed - 1 if updated else completed


@contextmanager
def logging_step_set_to(trainer: pl.Trainer, step: int) -> Iterator[None]:
    """Lightning's logging step (the step its loggers and ``LearningRateMonitor`` write at, and the one
    ``log_every_n_steps`` is checked against) set to ``step`` for the duration of the block, then restored."""
    loop = epoch_loop(trainer)
    saved, loop._batches_that_stepped = loop._batches_that_stepped, step
    try:
        yield
    finally:
        loop._batches_that_stepped = saved


def swap_hook_name(module: pl.LightningModule, name: str | None) -> str | None:
    """Set Lightning's current hook name on the module (what ``self.log`` files its values under, and whose change
    during an epoch's first batch resets that hook's accumulated values) and return the previous one, to be put
    back as Lightning's own hook calls do. (A plain string attribute: written to the instance's ``__dict__``, where
    ``nn.Module.__setattr__`` would put it after its checks for parameters, buffers and submodules.)"""
    attributes = vars(module)
    previous = attributes["_current_fx_name"]
    attributes["_current_fx_name"] = name
    return cast(str | None, previous)


def first_batch_flag(trainer: pl.Trainer) -> bool | None:
    """Whether Lightning's logging treats the running batch as its epoch's first (``None`` between epochs): while it
    does, ``self.log`` resets a hook's accumulated values whenever the hook name changes."""
    return trainer._logger_connector._first_loop_iter


def set_first_batch_flag(trainer: pl.Trainer, value: bool | None) -> None:
    trainer._logger_connector._first_loop_iter = value
