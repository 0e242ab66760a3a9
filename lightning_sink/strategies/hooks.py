"""Which Lightning hooks a run actually uses, so the step programs can skip dispatching the ones nobody overrides.

Lightning dispatches every hook through its call machinery (profiler, ``_current_fx_name``), which on a small model
is a noticeable part of a micro-step, and a micro-step has up to eight of them. When neither the LightningModule nor any callback overrides a hook and
the precision plugin is one whose hooks only forward to them, the step programs do the same work directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_sink import _lightning_compat as compat
from lightning_sink.precision import LossScalePrecision

__all__ = ["HookPlan"]

_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
# Precision plugins whose pre/post_backward and backward only call the hooks and ``module.backward``.
_PLAIN_PRECISION = (Precision, MixedPrecision, HalfPrecision)
# Lightning's own ``Strategy.backward``, kept before anything wraps it (``mock.patch.object(Strategy, "backward",
# wraps=trainer.strategy.backward)`` is a common way to count backward calls).
_LIGHTNING_BACKWARD = Strategy.backward


def _used(trainer: pl.Trainer, name: str, module_only: bool = False) -> bool:
    module = trainer.lightning_module
    if is_overridden(name, module, pl.LightningModule):
        return True
    return not module_only and any(
        is_overridden(name, callback, Callback) for callback in compat.trainer_settings(trainer).callbacks
    )


def _transfer_hook_used(trainer: pl.Trainer, name: str) -> bool:
    """The module's batch-transfer hook, or its datamodule's (which Lightning calls instead when overridden)."""
    datamodule = compat.trainer_settings(trainer).datamodule
    overridden_by_datamodule = datamodule is not None and is_overridden(name, datamodule, pl.LightningDataModule)
    return overridden_by_datamodule or _used(trainer, name, module_only=True)


@dataclass(frozen=True)
class HookPlan:
    direct_backward: bool  # the backward would only call loss.backward() (plus the store's own work)
    direct_before_step: bool  # no on_before_optimizer_step hook, no custom configure_gradient_clipping
    direct_transfer: bool  # no batch-transfer hooks
    direct_sink_step: bool  # sink micro-steps may skip the zero-grad, backward and optimizer-step hook dispatch
    # a sink's update may step an interval="step" scheduler itself: Lightning's own lr_scheduler_step (whose body is
    # scheduler.step()), no profiler; the hook call's bookkeeping costs more than the step
    direct_scheduler_step: bool

    @classmethod
    def for_run(cls, trainer: pl.Trainer) -> HookPlan:
        plugin = trainer.strategy.precision_plugin
        plain_precision = type(plugin) in _PLAIN_PRECISION or type(plugin) is LossScalePrecision
        # A profiler records every hook Lightning dispatches: keep them all, so its report is the one stock gives.
        unprofiled = isinstance(compat.trainer_settings(trainer).profiler, PassThroughProfiler)
        # A micro-step may call loss.backward() itself when the backward would only do that: no backward hooks, no
        # custom LightningModule.backward, a plain precision plugin, and nobody wraps Strategy.backward.
        direct_backward = (
            unprofiled
            and plain_precision
            and not any(_used(trainer, name) for name in ("on_before_backward", "on_after_backward"))
            and not _used(trainer, "backward", module_only=True)
            and getattr(trainer.strategy.backward, "__func__", None) is _LIGHTNING_BACKWARD
        )
        return cls(
            direct_backward=direct_backward,
            direct_before_step=unprofiled
            and not _used(trainer, "on_before_optimizer_step")
            and not _used(trainer, "configure_gradient_clipping", module_only=True),
            direct_transfer=unprofiled and not any(_transfer_hook_used(trainer, name) for name in _TRANSFER_HOOKS),
            direct_sink_step=direct_backward
            and not _used(trainer, "on_before_zero_grad")
            and not any(_used(trainer, name, module_only=True) for name in ("optimizer_zero_grad", "optimizer_step")),
            direct_scheduler_step=unprofiled and not _used(trainer, "lr_scheduler_step", module_only=True),
        )
