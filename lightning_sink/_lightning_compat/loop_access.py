"""Where Lightning keeps the training loops the other compat modules reach into."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def epoch_loop(trainer: pl.Trainer) -> Any:
    """The fit's training epoch loop (``_TrainingEpochLoop``)."""
    return trainer.fit_loop.epoch_loop


def automatic_optimization(trainer: pl.Trainer) -> Any:
    """The epoch loop's automatic optimization (``_AutomaticOptimization``): the closure and its counters."""
    return epoch_loop(trainer).automatic_optimization
