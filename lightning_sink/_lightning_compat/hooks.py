"""Lightning's own hook calls around an optimizer step and a batch, made the way its loop makes them."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer import call

from lightning_sink._lightning_compat.loop_access import automatic_optimization


def run_zero_grad(trainer: pl.Trainer, batch_idx: int, optimizer: Any) -> None:
    """Lightning's own zero-grad step: ``on_before_zero_grad`` (callbacks, module), then the module's
    ``optimizer_zero_grad``, with the optimizer's zero-grad progress counters."""
    automatic = automatic_optimization(trainer)
    automatic._on_before_zero_grad(optimizer)
    automatic._optimizer_zero_grad(batch_idx, optimizer)


def lightning_optimizer(strategy: Any) -> Any:
    """The ``LightningOptimizer`` wrapping the strategy's single optimizer, as Lightning passes it to
    ``LightningModule.optimizer_step``."""
    return strategy._lightning_optimizers[0]


def run_before_optimizer_step(trainer: pl.Trainer, optimizer: Any) -> None:
    """Call the ``on_before_optimizer_step`` hooks and clip gradients, as Lightning does after its closure."""
    precision_after_closure(trainer.strategy.precision_plugin, trainer.lightning_module, optimizer)


def precision_after_closure(plugin: Any, module: pl.LightningModule, optimizer: Any) -> None:
    """What a Lightning precision plugin does between its closure and the optimizer step: the
    ``on_before_optimizer_step`` hooks, then gradient clipping."""
    plugin._after_closure(module, optimizer)


def call_lightning_module_hook(trainer: pl.Trainer, name: str, *args: Any) -> Any:
    return call._call_lightning_module_hook(trainer, name, *args)


def before_batch_transfer(module: pl.LightningModule, batch: Any) -> Any:
    """``on_before_batch_transfer`` as Lightning's training loop calls it (the module's, or its datamodule's)."""
    return module._on_before_batch_transfer(batch, dataloader_idx=0)
