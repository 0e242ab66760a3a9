"""Lightning's step-based triggers in sink mode: checked once per sink, at its end.

``ModelCheckpoint(every_n_train_steps=n)`` saves at the end of a Lightning batch whose ``global_step`` is a
multiple of n. In sink mode a Lightning batch is a whole sink of u = sink_size / accumulation_steps updates, and
saving inside a sink would cost the host round trips that sinking removes, so this check runs at sink ends only.
It fires

- at exactly every n-th update when n is a multiple of u (every sink end where ``global_step % n == 0``), and
- at every sink end when n divides u (the first sink boundary after each multiple of n);

for any other n, a multiple of n that falls inside a sink is never seen, so the strategy warns at fit start.

``Trainer(log_every_n_steps=n)`` needs no such rule: the sink's log buffer writes every update's values at the steps
Lightning would (``sink_logging.py``). Only a LightningModule that defines its own ``log`` bypasses the buffer; its
values reach the loggers once per sink, by the rule above.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_sink import _lightning_compat as compat
from lightning_sink.strategies.sink_logging import SinkLogBuffer

__all__ = ["updates_per_sink", "warn_about_unaligned_step_triggers", "ignore_one_batch_per_epoch_warning"]


def updates_per_sink(sink_size: int, accumulation_steps: int) -> int | None:
    """Optimizer updates every sink makes, or ``None`` when sink ends do not fall at a fixed number of updates."""
    if sink_size == -1 or sink_size % accumulation_steps:
        return None
    return sink_size // accumulation_steps


def _step_triggers(trainer: pl.Trainer) -> list[tuple[str, int]]:
    triggers = [
        (f"ModelCheckpoint(every_n_train_steps={n})", n)
        for n in map(compat.checkpoint_every_n_train_steps, trainer.checkpoint_callbacks)
        if n > 1
    ]
    every_n = compat.trainer_settings(trainer).log_every_n_steps
    if trainer.loggers and every_n > 1 and not SinkLogBuffer.usable(trainer.lightning_module):
        name = f"Trainer(log_every_n_steps={every_n}), for a LightningModule that overrides `log`,"
        triggers.append((name, every_n))
    return triggers


def warn_about_unaligned_step_triggers(trainer: pl.Trainer, sink_size: int, accumulation_steps: int) -> None:
    per_sink = updates_per_sink(sink_size, accumulation_steps)
    for name, n in _step_triggers(trainer):
        if per_sink is not None and (n % per_sink == 0 or per_sink % n == 0):
            continue
        sinks = (
            f"every sink makes {per_sink} updates (sink_size={sink_size} / accumulation_steps={accumulation_steps})"
            if per_sink is not None
            else f"sink ends do not fall every fixed number of updates (sink_size={sink_size},"
            f" accumulation_steps={accumulation_steps})"
        )
        valid = f"a multiple or a divisor of {per_sink}" if per_sink is not None else "1"
        rank_zero_warn(
            f"{name} is checked at the end of each sink only, and {sinks}: multiples of {n} that fall inside a"
            f" sink are skipped. Use {valid} for n, or a sink_size that is a multiple of accumulation_steps * {n}."
        )


def ignore_one_batch_per_epoch_warning() -> None:
    """Lightning warns that "the number of training batches (1) is smaller than the logging interval" whenever an
    epoch has fewer batches than ``log_every_n_steps``; in sink mode every epoch is one Lightning batch by design,
    and ``log_every_n_steps`` counts updates, honoured by the sink's log buffer. The filter is process-wide, so it also quiets that one message for later one-batch epochs."""
    warnings.filterwarnings(
        "ignore",
        message=r"The number of training batches \(1\) is smaller than the logging"
        r" interval",
    )
