"""The checks a sink strategy makes when a fit starts: settings that contradict each other, or a module or optimizer
that the strategy's windows cannot serve. Each raises ``ValueError`` with the values involved and what to change.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.optim import Optimizer

__all__ = [
    "draws_own_batches",
    "needs_closure",
    "settle_accumulation_steps",
    "UpdateMakeup",
    "check_module_and_optimizer",
    "check_sink_callbacks",
]


def draws_own_batches(module: pl.LightningModule) -> bool:
    """``training_step(dataloader_iter)``: the module fetches its batches, so a step need not be one batch."""
    return is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)


def needs_closure(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure that re-evaluates the loss (``torch.optim.LBFGS``, ...)."""
    try:
        parameter = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


def settle_accumulation_steps(
    strategy: str,
    requested: int | None,
    from_trainer: int,
    scheduled: bool,
    sink_size: int | None,
    automatic_optimization: bool,
) -> int:
    """The window size N of this fit: the strategy's ``accumulation_steps``, else the Trainer's
    ``accumulate_grad_batches`` (which a ``GradientAccumulationScheduler`` changes per epoch)."""
    if requested is not None and scheduled:
        raise ValueError(
            f"{strategy}(accumulation_steps={requested}) and a GradientAccumulationScheduler callback both set the"
            " window size: pass accumulation_steps=None to let the scheduler choose it per epoch."
        )
    if scheduled and sink_size is not None:
        raise ValueError(
            f"GradientAccumulationScheduler changes the window size per epoch, but {strategy}(sink_size={sink_size})"
            " runs windows across sinks (its epochs): give accumulation_steps instead, or train without sink_size."
        )
    if requested is not None and from_trainer not in (1, requested):
        raise ValueError(
            f"{strategy}(accumulation_steps={requested}) conflicts with Trainer(accumulate_grad_batches="
            f"{from_trainer}): set one of them, or both to the same value."
        )
    steps = requested or from_trainer
    if not automatic_optimization and sink_size is not None:
        raise ValueError(
            f"{strategy}(sink_size={sink_size}) runs automatic optimization's steps inside a sink, but this"
            " LightningModule sets `automatic_optimization = False`, whose training_step steps the optimizer itself:"
            " remove sink_size (manual optimization then runs as with Lightning's own strategy)."
        )
    if not automatic_optimization and steps > 1:
        raise ValueError(
            f"{strategy}(accumulation_steps={steps}) accumulates for automatic optimization only, but this"
            " LightningModule sets `automatic_optimization = False`. Set accumulation_steps=1 and accumulate by hand:"
            " call `self.manual_backward(loss / N)` on every batch and `opt.step(); opt.zero_grad()` on every N-th"
            " batch."
        )
    return steps


@dataclass(frozen=True)
class UpdateMakeup:
    """What goes into one optimizer update of this fit: the micro-batches of a window (``accumulation_steps``;
    ``scheduled`` when a ``GradientAccumulationScheduler`` sets it per epoch; ``sink_size`` when a sink runs them),
    the processes whose gradients are summed (``world_size``), and whether a loss scale checks the gradients first."""

    accumulation_steps: int
    sink_size: int | None
    scheduled: bool
    world_size: int
    loss_scaling: bool

    @property
    def sums_windows(self) -> bool:
        """Whether the window store sums each window's gradients in its own buffer (``_summing_cause`` says why),
        rather than leaving one micro-step's ``.grad`` as it is: several micro-batches, several processes, or a
        loss scale that checks the sum first."""
        return self.accumulation_steps > 1 or self.scheduled or self.world_size > 1 or self.loss_scaling


def check_module_and_optimizer(
    strategy: str, module: pl.LightningModule, optimizer: Optimizer, update: UpdateMakeup
) -> None:
    """A ``training_step(dataloader_iter)`` and an optimizer that needs a closure both assume one batch per update."""
    steps, sink_size = update.accumulation_steps, update.sink_size
    why = f"sink_size={sink_size}" if sink_size is not None else f"accumulation_steps={steps}"
    windows = sink_size is not None or steps > 1 or update.scheduled
    if windows and draws_own_batches(module):
        raise ValueError(
            f"training_step(dataloader_iter) draws its own batches, but {strategy}({why}) must see every micro-batch"
            " to close its windows: take `batch` (and `batch_idx`) instead, or train with accumulation_steps=1 and"
            " no sink_size."
        )
    sparse = _sparse_gradient_layer(module)
    if update.sums_windows and sparse is not None:
        raise ValueError(
            f"{sparse} gives its weight sparse gradients, but {strategy} sums each window's gradients in one dense"
            f" fp32 buffer here ({_summing_cause(update)}), which makes them dense (and SparseAdam refuses dense"
            " gradients): construct it with sparse=False, or train with accumulation_steps=1 on one process without"
            " a loss scale."
        )
    one_batch_per_update = sink_size is None and steps == 1 and update.world_size == 1 and not update.loss_scaling
    if needs_closure(optimizer) and not one_batch_per_update:
        raise ValueError(
            f"{type(optimizer).__name__}.step needs a closure that re-evaluates the loss, but {strategy}"
            f" {_no_closure_reason(update)}: use it with accumulation_steps=1, no sink_size, one process and no loss"
            " scale, or choose an optimizer that steps without a closure."
        )


def _sparse_gradient_layer(module: nn.Module) -> str | None:
    """The first layer whose weight gets sparse gradients (``Embedding`` / ``EmbeddingBag`` with ``sparse=True``),
    named as ``named_modules`` names it, or None."""
    for name, layer in module.named_modules():
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)) and layer.sparse and layer.weight.requires_grad:
            return f"{name or 'the module'} ({type(layer).__name__}(sparse=True))"
    return None


def _summing_cause(update: UpdateMakeup) -> str:
    """The setting that makes the window store sum gradients rather than hand them on as they are."""
    if update.accumulation_steps > 1 or update.scheduled:
        return f"accumulation_steps={update.accumulation_steps}{', scheduled' if update.scheduled else ''}"
    if update.world_size > 1:
        return f"{update.world_size} processes"
    return "a loss scale"


def _no_closure_reason(update: UpdateMakeup) -> str:
    """Why no closure can re-evaluate the loss here, in the terms of the setting that prevents it."""
    steps, sink_size, scheduled = update.accumulation_steps, update.sink_size, update.scheduled
    if sink_size is not None:
        return f"runs the micro-batches inside a sink (sink_size={sink_size}), where no closure re-runs one"
    if steps > 1 or scheduled:
        return (
            f"steps once per window of {steps} micro-batches (accumulation_steps={steps}{', scheduled' if scheduled else ''})"
            " on their averaged gradient and cannot re-run them"
        )
    if update.world_size > 1:
        return (
            f"sums the gradients of its {update.world_size} processes in one reduction before each step, which a"
            " closure's re-evaluation would skip"
        )
    return "unscales the gradients and checks them for overflow before each step (a loss scale), which a closure's re-evaluation would skip"


def check_sink_callbacks(
    strategy: str, sink_size: int, callbacks: Sequence[Callback], module: pl.LightningModule
) -> None:
    """Callbacks that need an epoch of known length, which a sink is not (an epoch is a sink, its batches the
    sink's segments)."""
    averaging = any(isinstance(callback, StochasticWeightAveraging) for callback in callbacks)
    if averaging and StochasticWeightAveraging.pl_module_contains_batch_norm(module):  # (the callback's own rule)
        raise ValueError(
            f"StochasticWeightAveraging recomputes BatchNorm statistics in an extra epoch of known length after the"
            f" last one, but {strategy}(sink_size={sink_size}) makes each epoch a sink of unknown batch count: train"
            " without sink_size, or recompute the statistics after the fit with torch.optim.swa_utils.update_bn."
        )
