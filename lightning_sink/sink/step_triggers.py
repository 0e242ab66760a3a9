"""Lightning's step-based triggers in sink mode: which ones end a sink early, and the fit-start line that says what
an epoch is.

``ModelCheckpoint(every_n_train_steps=n)`` saves at the end of a Lightning batch whose ``global_step`` is a
multiple of n; ``Trainer(log_every_n_steps=n)`` writes the logs of a module that defines its own ``log`` (which
bypasses the sink's log buffer) at such batch ends too. In sink mode each multiple of n that falls inside a sink ends
a segment of it (``sink/schedule.py``), so both fire at the same updates as without sinking. Every other module's
logged values need no segment: the sink's log buffer writes every update's values at the steps Lightning would
(``sink/logging.py``).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_sink import _lightning_compat as compat
from lightning_sink.sink.logging import SinkLogBuffer
from lightning_sink.sink.schedule import SchedulePoints, validation_points

__all__ = ["schedule_points", "describe_sink_epoch"]


def _update_multiples(trainer: pl.Trainer) -> list[tuple[str, int]]:
    triggers = [
        (f"ModelCheckpoint(every_n_train_steps={n})", n)
        for n in map(compat.checkpoint_every_n_train_steps, trainer.checkpoint_callbacks)
        if n > 0
    ]
    every_n = compat.trainer_settings(trainer).log_every_n_steps
    if trainer.loggers and every_n > 1 and not SinkLogBuffer.usable(trainer.lightning_module):
        triggers.append((f"Trainer(log_every_n_steps={every_n}), for a LightningModule that overrides `log`,", every_n))
    return triggers


def schedule_points(
    trainer: pl.Trainer, val_check_interval: int | float | None, pass_length: int | None, sink_size: int
) -> SchedulePoints:
    """The points at which this fit's sinks end early (``val_check_interval``: the Trainer's step-based value)."""
    every_in_fit, every_in_pass, every_n_passes = (None, None, None)
    if trainer.enable_validation:  # a validation loop that runs (a val loader, validation_step, batches)
        every_in_fit, every_in_pass, every_n_passes = validation_points(
            val_check_interval, trainer.check_val_every_n_epoch, pass_length
        )
    triggers = _update_multiples(trainer)
    if sink_size == -1 and pass_length is None:
        # A sink is the rest of a data pass whose length is unknown: no segment can be planned ahead.
        names = [name for name, _ in triggers] + (
            [f"val_check_interval={val_check_interval}"] if every_in_fit or every_in_pass else []
        )
        if names:
            rank_zero_warn(
                f"{', '.join(names)} is checked at the end of each sink only: with sink_size=-1 a sink is a data pass"
                " and the training loader has no length, so points inside a pass cannot be planned. Give sink_size"
                " a number of micro-batches, or the loader a length."
            )
        return SchedulePoints()
    return SchedulePoints(
        validate_every_in_fit=every_in_fit,
        validate_every_in_pass=every_in_pass,
        validate_every_n_passes=every_n_passes,
        update_multiples=tuple(sorted({n for _, n in triggers})),
    )


def describe_sink_epoch(
    sink_size: int, accumulation_steps: int, pass_length: int | None, max_epochs: int | None
) -> str:
    """The fit-start line of sink mode: what an epoch is, in micro-batches and updates."""
    steps = accumulation_steps
    data_pass = (
        f"a data pass is {pass_length} micro-batches" if pass_length is not None else "a data pass has no length"
    )
    if sink_size == -1:
        micro = pass_length
        epoch = f"epoch = sink of one data pass ({pass_length if pass_length is not None else 'unknown'} micro-batches)"
    else:
        micro = sink_size
        epoch = f"epoch = sink of {sink_size} micro-batches"
    if micro is not None:
        updates = micro // steps if micro % steps == 0 else f"{micro / steps:g} (windows run across sinks)"
        epoch += f" = {updates} updates (accumulation_steps={steps})"
    line = f"Sink mode: {epoch}; {data_pass}"
    if max_epochs is not None and max_epochs >= 0 and micro is not None:
        line += f"; max_epochs={max_epochs} trains {max_epochs * micro} micro-batches"
    line += "."
    if sink_size != -1 and pass_length is not None and sink_size > pass_length:
        line += (
            f" sink_size={sink_size} is larger than a data pass ({pass_length} micro-batches): each sink reads on into"
            " the next pass."
        )
    return line
