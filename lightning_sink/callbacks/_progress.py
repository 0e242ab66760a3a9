"""What one Lightning batch trained, in MindSpore's units: steps (batches through the network) and their losses;
and where the callbacks' scalars go on the loggers' step axis.

A *step* is one batch through the network, as MindSpore counts it: one micro-batch under gradient accumulation,
one of the K batches of a sink. In sink mode (``SinkStrategy(sink_size=K)``) a Lightning batch is a whole sink: its
``batch`` is a ``SinkToken`` and its ``outputs`` carry every step's loss in ``outputs["losses"]``. The printed lines
count steps; the scalars written to the loggers are on Lightning's axis, optimizer updates (``UpdateAxis``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from lightning_sink.sink_data import SinkToken

__all__ = ["StepCounter", "UpdateAxis", "is_sink", "batch_losses", "log_scalars"]


def is_sink(batch: Any) -> bool:
    return isinstance(batch, SinkToken)


def batch_losses(trainer: pl.Trainer, outputs: Any, batch: Any) -> tuple[Tensor, int] | None:
    """This Lightning batch's step losses as Lightning hands them over (a device tensor: one element per step), and
    the factor they must be multiplied by once read; None when the batch has no loss.

    Lightning divides the ``"loss"`` it hands to callbacks by ``trainer.accumulate_grad_batches`` (its closure
    normalises for its own accumulation, and the sink strategies set that attribute to N outside sink mode), so the
    factor is N there: exact when N is a power of two, within one float32 rounding otherwise. It is applied on the
    host, when the values are read, so a step costs no tensor operation. In sink mode ``"losses"`` is untouched.
    """
    if is_sink(batch):
        return outputs["losses"], 1  # (the strategy hands over detached losses)
    loss = outputs.get("loss") if isinstance(outputs, (dict, Mapping)) else outputs  # (a dict is checked fastest)
    if not isinstance(loss, Tensor):
        return None  # training_step returned None (a skipped batch) or no loss
    normalised_by = trainer.accumulate_grad_batches if trainer.lightning_module.automatic_optimization else 1
    return (loss.detach() if loss.requires_grad else loss), normalised_by


def log_scalars(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Write to every logger of the Trainer (rank 0 only, as Lightning's own loggers do)."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


class StepCounter:
    """Steps trained in the run and in the current epoch; the run total survives a restart via ``state_dict``.

    The step within the epoch is what MindSpore prints (``epoch: 1 step: 1000``): outside sink mode it is Lightning's
    ``batch_idx + 1`` (which Lightning restores on resume); in sink mode the steps of the epoch's sinks so far.
    """

    def __init__(self) -> None:
        self.total = 0  # steps trained in the whole run (MindSpore's cur_step_num)
        self.in_epoch = 0

    def start_epoch(self) -> None:
        self.in_epoch = 0

    def advance(self, outputs: Any, batch: Any, batch_idx: int) -> int:
        """Count this Lightning batch's steps; returns how many it trained."""
        if is_sink(batch):
            steps = int(outputs["losses"].numel())
            self.in_epoch += steps
        else:
            steps, self.in_epoch = 1, batch_idx + 1
        self.total += steps
        return steps

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total = int(state["total"])


class UpdateAxis:
    """Where a Lightning batch's scalars go on Lightning's step axis, the one ``self.log`` and ``LearningRateMonitor``
    write on: a value that belongs to the u-th optimizer update is written at step u - 1.

    A micro-batch belongs to the update its accumulation window makes: the update it completes, or, inside a window,
    the next one (step ``global_step``). Call ``batch_start`` at each Lightning batch's start; ``position`` at its
    end gives the step of the batch's last micro-batch, and whether that step is final: the window is closed, so no
    later batch falls on the same step.
    """

    def __init__(self) -> None:
        self._global_step_at_batch_start = 0

    def batch_start(self, trainer: pl.Trainer) -> None:
        self._global_step_at_batch_start = trainer.global_step

    def position(self, trainer: pl.Trainer) -> tuple[int, bool]:
        open_micro_steps = getattr(trainer.strategy, "micro_steps_in_window", None)  # the sink strategies' windows
        if open_micro_steps is None:  # one micro-batch per Lightning batch: it closed a window if it updated
            closed = trainer.global_step > self._global_step_at_batch_start
        else:
            closed = open_micro_steps == 0
        return (trainer.global_step - 1 if closed else trainer.global_step), closed
