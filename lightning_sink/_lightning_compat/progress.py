"""Lightning's batch and optimizer progress counters, read and moved as Lightning moves them."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_sink._lightning_compat.loop_access import automatic_optimization, epoch_loop


def is_last_batch_of_epoch(trainer: pl.Trainer) -> bool:
    """Whether the Lightning batch in flight is the last one of this epoch (known before it runs).

    Lightning's ``_TrainingEpochLoop._num_ready_batches_reached``, computed from the same attributes rather than
    called: it runs for every micro-batch, and the attribute reads stay inside this package (a guard test compares
    the two over fits with sized, limited and unsized loaders)."""
    progress = epoch_loop(trainer).batch_progress
    return progress.current.ready == trainer.fit_loop.max_batches or bool(progress.is_last_batch)


def batch_index_in_epoch(trainer: pl.Trainer) -> int:
    """``trainer.fit_loop.batch_idx`` (the batch in flight, within its epoch), read from the progress counter that
    Lightning's property derives it from."""
    return int(epoch_loop(trainer).batch_progress.current.ready) - 1


def epoch_batches_over(trainer: pl.Trainer) -> bool:
    """Whether Lightning's epoch in flight has finished its batches (its ``processed`` count), at their end or early
    (``max_steps``, ``should_stop``, ``on_train_batch_start`` returning -1): a fit resumed from a checkpoint saved now
    starts the next epoch at its first batch."""
    progress = trainer.fit_loop.epoch_progress.current  # (a ``_ProcessedTracker``, typed as its base class)
    return progress.ready > 0 and getattr(progress, "processed", progress.completed) == progress.ready


class UpdateCounters:
    """Lightning's optimizer progress counters (saved in the loop state; ``trainer.global_step`` reads the
    completed step count), moved as Lightning moves its own. Looked up once per sink: a sink counts hundreds of
    updates, and the walk from the trainer to the counters costs more than the increments."""

    def __init__(self, trainer: pl.Trainer) -> None:
        progress = automatic_optimization(trainer).optim_progress.optimizer
        self._step, self._zero_grad = progress.step, progress.zero_grad

    def update_ready(self) -> None:
        """Before the ``optimizer_step`` hook."""
        self._step.increment_ready()

    def update_completed(self) -> None:
        """After the ``optimizer_step`` hook."""
        self._step.increment_completed()

    def zero_grad(self) -> None:
        """A zero-grad whose hooks nobody overrides (``run_zero_grad`` counts the hooked one)."""
        self._zero_grad.increment_ready()
        self._zero_grad.increment_started()
        self._zero_grad.increment_completed()
