"""``trainer.estimated_stepping_batches`` under ``partial_window="carry"``, where windows run across epochs.

Lightning counts every epoch's last window as an update, a partial one too (``ceil(batches / N)`` an epoch); carried
windows make an update only when N micro-batches are in, so a fit makes ``epochs * batches // N``. A scheduler sized
from Lightning's count (``OneCycleLR(total_steps=...)``) would not reach its end.
"""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_sink import _lightning_compat as compat

__all__ = ["carried_updates"]


def carried_updates(trainer: pl.Trainer, accumulation_steps: int) -> int | float:
    """The fit's micro-batches in whole windows of ``accumulation_steps``, capped by ``max_steps``; Lightning's own
    count where the micro-batches are not known (an unsized loader, ``max_epochs=-1``)."""
    stock = compat.stock_estimated_stepping_batches(trainer)  # (loads the training data if needed)
    batches, epochs = trainer.num_training_batches, trainer.max_epochs
    if epochs is None or epochs < 0 or batches == float("inf"):
        return stock
    updates = max(epochs, 1) * int(batches) // accumulation_steps
    return min(updates, trainer.max_steps) if trainer.max_steps != -1 else updates
