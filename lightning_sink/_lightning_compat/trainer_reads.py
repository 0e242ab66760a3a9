"""What ``training_step`` reads from its Trainer: while ``trainer_reads`` is entered, every LightningModule of a
module sees its trainer (Lightning's private ``_trainer``, behind ``self.trainer``, ``self.global_step`` and the
rest) through a recorder, which lists each attribute read or set that is not one of the fit's settings.

A compiled step program fixes every Python value it reads when it is built; a Trainer attribute that changes
while the fit runs (``global_step``, ``current_epoch``, the LR schedulers, the optimizers through the strategy, the
loops and their progress, the logged metrics) would be the built value at every micro-batch of a call, and a value
that changes between calls would make TorchDynamo compile again at each. The settings below stay as they are for
the whole fit, so reading them is safe; anything else read is listed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from torch import nn

__all__ = ["FIT_SETTINGS", "trainer_reads", "trainer_read_hint"]

# Trainer attributes that keep their value while a fit trains (its settings and where it runs).
FIT_SETTINGS = frozenset(
    {
        "accumulate_grad_batches",
        "check_val_every_n_epoch",
        "datamodule",
        "default_root_dir",
        "device_ids",
        "estimated_stepping_batches",
        "fast_dev_run",
        "global_rank",
        "gradient_clip_algorithm",
        "gradient_clip_val",
        "is_global_zero",
        "lightning_module",
        "local_rank",
        "log_dir",
        "log_every_n_steps",
        "logger",
        "loggers",
        "max_epochs",
        "max_steps",
        "min_epochs",
        "min_steps",
        "node_rank",
        "num_devices",
        "num_nodes",
        "precision",
        "predicting",
        "sanity_checking",
        "testing",
        "training",
        "val_check_interval",
        "validating",
        "world_size",
    }
)

# How a LightningModule usually reaches a trainer attribute, for the line that names it.
_HINTS = {
    "global_step": "self.global_step",
    "current_epoch": "self.current_epoch",
    "lr_scheduler_configs": "self.lr_schedulers()",
    "strategy": "self.optimizers() or self.trainer.strategy",
}


def trainer_read_hint(name: str) -> str:
    """How training_step reads trainer attribute ``name``: ``self.trainer.<name>``, or the LightningModule property
    or method that reads it."""
    hint = _HINTS.get(name)
    return f"self.trainer.{name}" if hint is None else f"{hint} (the trainer's {name})"


class _RecordedTrainer:
    """The trainer seen through a recorder: reads and writes go to the trainer; those of non-settings are listed."""

    __slots__ = ("_recorded_reads", "_recorded_trainer")

    def __init__(self, trainer: pl.Trainer, reads: list[str]) -> None:
        object.__setattr__(self, "_recorded_trainer", trainer)
        object.__setattr__(self, "_recorded_reads", reads)

    def __getattribute__(self, name: str) -> Any:
        trainer = object.__getattribute__(self, "_recorded_trainer")
        if name == "__class__":  # (isinstance(self.trainer, pl.Trainer) holds as without the recorder)
            return type(trainer)
        if name not in FIT_SETTINGS:
            object.__getattribute__(self, "_recorded_reads").append(trainer_read_hint(name))
        return getattr(trainer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__getattribute__(self, "_recorded_reads").append(f"self.trainer.{name} (set)")
        setattr(object.__getattribute__(self, "_recorded_trainer"), name, value)


@contextlib.contextmanager
def trainer_reads(module: nn.Module) -> Iterator[list[str]]:
    """While entered, the trainer attributes (not ``FIT_SETTINGS``) that ``module``'s LightningModules read or set,
    in order, in the yielded list (each as ``trainer_read_hint`` says it); the trainers restored on exit."""
    reads: list[str] = []
    swapped = [
        (sub, sub._trainer)
        for sub in module.modules()
        if isinstance(sub, pl.LightningModule) and sub._trainer is not None
    ]
    for sub, trainer in swapped:
        sub.__dict__["_trainer"] = _RecordedTrainer(trainer, reads)
    try:
        yield reads
    finally:
        for sub, trainer in swapped:
            sub.__dict__["_trainer"] = trainer
