"""The public Trainer attributes a type checker does not see."""

from __future__ import annotations

from typing import Protocol, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler


class TrainerSettings(Protocol):
    """Public Trainer attributes that Lightning's connectors set from outside the class, where a type checker does
    not see them."""

    callbacks: list[Callback]
    log_every_n_steps: int
    fast_dev_run: int | bool
    profiler: Profiler
    datamodule: pl.LightningDataModule | None


def trainer_settings(trainer: pl.Trainer) -> TrainerSettings:
    """The same trainer, typed with the attributes of ``TrainerSettings``."""
    return cast(TrainerSettings, trainer)
