"""The step engine: MindSpore's accumulation semantics inside Lightning's loop, one object per fit.

The strategies build it at train start from explicit parts (``EngineParts``: the gradient store and the reducer
they choose, the loss scaling, the hook plan, Lightning's update counters, the training passes) and delegate their
extension points to it in one call each, as Lightning's ``Strategy`` delegates to its precision plugin.

Without sinking, Lightning's automatic optimization drives each micro-batch as it does for any strategy: the
zero-grad hooks at a window's first batch, ``training_step``, the backward, and at the window's last batch the
``LightningModule.optimizer_step`` hook, the progress counters and the LR schedulers. The engine answers:

1. ``training_step``: the LightningModule's own, called directly (DDP's reducer never fires; ``graph_mode``
   applies); a micro-batch that does not end its window is the strategy's ``accumulate_step``;
2. ``pre_backward``: the gradient store prepares ``.grad`` (the fp32 window sum) before Lightning's own ``backward``
   (and its hooks) backpropagates; ``post_backward`` closes the micro-step;
3. ``update_step`` (reached through the module's ``optimizer_step`` hook and ``optimizer.step(closure)``) ends the
   window: the window's last micro-batch (the closure), one reduction, divide/unscale, the overflow decision,
   ``on_before_optimizer_step`` and clipping, step or skip, loss-scale update, window reset.

Lightning divides each loss by ``accumulate_grad_batches`` (N); a window of k micro-batches that returned a loss
is divided by k/N at its end, so every update is the mean over its micro-batches (``Window.mean_divisor``; under
``partial_window="lightning"`` it is not, as stock Lightning does not divide it). With sinking (``sink_size``) a
Lightning batch is a whole sink, run by ``sink/loop.py`` with the step programs of ``sink/programs/eager.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import UPDATING_PARTIAL_WINDOWS, MicroStep, plan_micro_step, unique_trainable
from lightning_sink.precision import LossScalePrecision
from lightning_sink.strategies.hooks import HookPlan
from lightning_sink.training_passes import TrainingPasses
from lightning_sink.window import (
    GradientStore,
    NoGradients,
    Reducer,
    WindowGradient,
    finish_window,
    ready_window_gradient,
)
from lightning_sink.window.state import Window

__all__ = ["EngineHost", "EngineParts", "StepEngine", "loss_of"]


class EngineHost(Protocol):
    """What the engine uses of the Lightning strategy that holds it (each sink strategy is one)."""

    precision_plugin: Precision

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...

    @property
    def world_size(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's ``Strategy.backward``: the backward hooks and the precision plugin's backward."""
        ...

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's ``Strategy.broadcast``: rank ``src``'s object on every rank."""
        ...

    def accumulate_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The engine's ``forward``, reached through the strategy so that wrappers placed there see it."""
        ...


def loss_of(output: STEP_OUTPUT) -> Tensor | None:
    """The loss in a ``training_step`` output, or ``None`` (the micro-batch is skipped, as in Lightning).

    An output without a loss raises Lightning's own ``MisconfigurationException``, as its closure does."""
    if type(output) is Tensor or isinstance(output, Tensor):  # the exact type first: the common case, cheapest
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return ClosureResult.from_training_step_output(output).closure_loss  # None, or Lightning's own error


def forget_gradients(optimizer: Optimizer) -> None:
    """``zero_grad(set_to_none=True)`` without calling the optimizer's own ``zero_grad`` (whose calls users count)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


@dataclass(frozen=True)
class EngineParts:
    """What a strategy builds its engine from at train start.

    ``host`` is the Lightning strategy itself, for what only it holds (its precision plugin, optimizers, device and
    ``backward``, which users wrap); the rest is chosen once per fit."""

    host: EngineHost
    trainer: pl.Trainer
    make_store: Callable[[list[Parameter]], GradientStore]  # the window's gradient store for these parameters
    reducer: Reducer
    ranks_in_sum: int  # ranks whose gradients the reduced sum adds up (1 where the reduction averages)
    scaling: LossScalePrecision | None
    hooks: HookPlan
    counters: compat.UpdateCounters
    passes: TrainingPasses
    accumulation_steps: int
    partial_window: str
    sink_size: int | None
    step_function: Callable[..., STEP_OUTPUT]  # the module's training_step, compiled under graph_mode
    step_takes_batch_idx: bool
    needs_step_context: bool  # whether the precision plugin's step context does anything
    step_scheduler_configs: list[Any]  # step-interval LR schedulers (the sink loop and overflow skips step them)
    passthrough: bool  # N=1, one process, no loss scale, no sink: Lightning's own step, untouched


class StepEngine:
    """One fit's step engine: the window, its gradient store and reducer, and the update."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.host = parts.host
        self.trainer = parts.trainer
        self.hooks = parts.hooks
        self.reducer = parts.reducer
        self.scaling = parts.scaling
        self.passes = parts.passes
        self.counters = parts.counters
        self.accumulation_steps = parts.accumulation_steps
        self.partial_window = parts.partial_window
        self.passthrough = parts.passthrough
        self.step_scheduler_configs = parts.step_scheduler_configs
        self._step_function = parts.step_function
        self._needs_step_context = parts.needs_step_context
        self._store_params: tuple[int, ...] = ()
        self.window = Window(NoGradients(), parts.ranks_in_sum)
        self.window.divide_losses_by(parts.accumulation_steps)
        self.window.divides_as_stock = parts.partial_window == "lightning" and parts.sink_size is None
        self.refresh_store(initial=True)
        self.in_update = False  # the window's last micro-batch runs inside update_step
        self.last_update_skipped = False  # the last update overflowed and was skipped (step schedulers hold)
        self._planned: tuple[int, bool] | None = None

    # ------------------------------------------------------------------ what the engine reads from Lightning
    @property
    def store(self) -> GradientStore:
        return self.window.store

    def optimizer(self) -> Optimizer:
        return self.host.optimizers[0]

    def refresh_store(self, initial: bool = False) -> None:
        """(Re)build the store when the optimizer's trainable parameters changed (param groups added by
        ``BaseFinetuning``, parameters unfrozen); called at window starts only, where the store is empty."""
        params = [p for group in self.optimizer().param_groups for p in group["params"]]
        key = tuple(id(p) for p in unique_trainable(params))
        if not initial and key == self._store_params:
            return
        if not initial:
            for param in params:
                param.grad = None  # the old store's views; the new window starts from zero
        self._store_params = key
        self.window.store.release()
        self.window.store = self.parts.make_store(params) if key else NoGradients()

    # ------------------------------------------------------------------ windows that Lightning does not delimit
    def plan_micro_step(self) -> MicroStep:
        return plan_micro_step(
            self.window.micro_batches,
            self.accumulation_steps,
            compat.is_last_batch_of_epoch(self.trainer),
            self.partial_window,
        )

    def batch_has_no_update(self) -> bool:
        """Lightning asks this several times per batch (``carry`` and ``drop``); decided once, before the batch."""
        batch_key = self.trainer.fit_loop.total_batch_idx
        if self._planned is None or self._planned[0] != batch_key:
            self._planned = (batch_key, self.plan_micro_step() is MicroStep.UPDATE)
        return not self._planned[1]

    # ------------------------------------------------------------------ one micro-batch, in call order
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Lightning's closure calls this first (the window's last micro-batch: from inside ``update_step``)."""
        window = self.window
        if self.partial_window not in UPDATING_PARTIAL_WINDOWS:
            self.batch_has_no_update()  # fix the plan for this batch before its state changes
            window.drop = self.plan_micro_step() is MicroStep.ACCUMULATE_THEN_DROP
        elif window.micro_batches and compat.batch_index_in_epoch(self.trainer) % self.accumulation_steps == 0:
            self.end_window()  # an optimizer_step hook that ran the closure without stepping
        if self.in_update or self.passthrough:
            output = self.forward(*args, **kwargs)
        else:
            output = self.host.accumulate_step(*args, **kwargs)  # (see the note below)
        window.count_micro_batch()
        if window.drop and output is None:
            self.end_window()  # dropped, and no backward follows to discard it
        self.passes.batch_trained(compat.is_last_batch_of_epoch(self.trainer))  # (sinks count their own)
        return output

    # Note: ``accumulate_step`` and ``update_step`` are reached through the strategy object, which exposes them so
    # that a wrapper placed on the strategy (counting host syncs, sync debug mode) sees every micro-batch.

    def swap_step_function(self, step: Callable[..., STEP_OUTPUT] | None = None) -> Callable[..., STEP_OUTPUT]:
        """``step`` as the training step from here on (None: the module's own ``training_step``, not the graph mode's
        compiled one), and the one it replaces: for a step that reads Python state the host changes, which a compiled
        forward would compile again for at each new value, and for a micro-batch of a shape nothing was built for."""
        module = self.host.lightning_module
        assert module is not None
        previous, self._step_function = self._step_function, module.training_step if step is None else step
        return previous

    def forward(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The module's ``training_step``; without autograd when the window already overflowed."""
        skip_backward = self.window_already_overflowed()
        self.window.overflowed = skip_backward  # read by the backward that follows (``backward``/``hooked_backward``)
        if not self._needs_step_context and not skip_backward and torch.is_grad_enabled():
            output = self._step_function(*args, **kwargs)  # nothing to enter: skip the two context managers
        else:
            with self.host.precision_plugin.train_step_context(), torch.set_grad_enabled(not skip_backward):
                output = self._step_function(*args, **kwargs)
        if output is None and self.host.world_size > 1:
            # Lightning's own rule (its loop raises the same): the ranks' reductions would no longer pair up
            raise RuntimeError(
                "Skipping the `training_step` by returning None in distributed training is not supported: every"
                " rank must contribute to each window's gradient reduction."
            )
        return output

    def pre_backward(self) -> None:
        """Before Lightning's backward (and its hooks): the store prepares ``.grad`` (the window's fp32 sum)."""
        if self.passthrough:
            return
        if self.window.store.micro_steps == 0:
            self.refresh_store()
        self.window.store.begin_micro_step(self.in_update or self.window.drop)

    def post_backward(self) -> None:
        if self.passthrough:
            return
        window = self.window
        window.store.end_micro_step()
        if window.drop:
            window.store.clear()  # the epoch ends inside a window under "drop": discard it
            window.end()

    def backward(self, loss: Tensor, skip: bool = False) -> None:
        """What Lightning's backward does with a plain precision plugin and no hooks: scale, backpropagate.
        ``skip``: the window already overflowed, its forward ran without autograd."""
        scaling = self.scaling
        if scaling is None:
            loss.backward()
        elif not skip:
            (loss if scaling.scaler is None else loss * scaling.scaler.scale.to(loss.dtype)).backward()

    def window_backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None = None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The whole backward of a micro-batch when no hook runs in it (bound as the strategy's ``backward`` for the
        fit). Lightning's ``Strategy.pre_backward``/``post_backward`` do nothing under automatic optimization."""
        if args or kwargs:  # arguments for Tensor.backward: Lightning's path (the class's backward) hands them on
            return type(self.host).backward(self.host, closure_loss, optimizer, *args, **kwargs)
        self.pre_backward()
        self.backward(closure_loss, skip=self.window.overflowed)
        self.post_backward()
        return closure_loss

    def hooked_backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None = None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """Lightning's ``Strategy.backward`` with its hooks, bound as the strategy's ``backward`` for a fit whose loss
        scaling skips overflowed windows: a micro-batch of a window that already overflowed ran its forward without
        autograd, and the precision plugin is told so as an argument of this backward."""
        if self.window.overflowed:
            kwargs["skip_backward"] = True
        return type(self.host).backward(self.host, closure_loss, optimizer, *args, **kwargs)

    # ------------------------------------------------------------------ the window's update
    def update_step(self, optimizer: Optimizer, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The window's last micro-batch (the closure: forward, backward) and the window's update."""
        scaling = self.scaling
        if scaling is None:
            return self._update_inside_step(optimizer, closure, **kwargs)
        loss = self.last_micro_step(closure)
        window = self.window
        if window.store.micro_steps == 0:
            window.end()
            return loss  # no micro-batch of this window returned a loss: nothing to apply
        found_inf = finish_window(self._window_gradient(optimizer), scaling, optimizer, **kwargs)
        window.end()
        self.last_update_skipped = bool(self.step_scheduler_configs) and scaling.window_overflowed(found_inf)
        self.log_loss_scale(scaling, found_inf)
        return loss

    def _update_inside_step(self, optimizer: Optimizer, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """``optimizer.step(closure)`` as Lightning's fp32 precision plugin calls it: the optimizer enters its
        ``step``, runs the closure (the window's last micro-batch, then its mean gradient, hooks and clipping),
        then updates, so an optimizer's own ``step`` sees the calls in stock Lightning's order."""

        def window_closure() -> Any:
            loss = self.last_micro_step(closure)
            self.ready_window_gradient(optimizer)
            return loss

        self.last_update_skipped = False
        output = optimizer.step(closure=window_closure, **kwargs)
        self.end_window()
        return output

    def ready_window_gradient(self, optimizer: Optimizer) -> None:
        """The window's mean gradient in ``.grad``, then the ``on_before_optimizer_step`` hooks and clipping. A window
        where no ``training_step`` returned a loss has no gradient (``.grad`` is ``None``, so the step changes
        nothing); its hooks still run, as stock runs them."""
        if self.window.store.micro_steps:
            ready_window_gradient(self._window_gradient(optimizer), None)
        else:
            forget_gradients(optimizer)
            self.before_optimizer_step(optimizer)

    def _window_gradient(self, optimizer: Optimizer) -> WindowGradient:
        """The current window's gradient, its mean to be stepped by ``optimizer`` after the hooks and clipping."""
        window = self.window
        return WindowGradient(
            window.store, self.reducer, window.mean_divisor(), lambda: self.before_optimizer_step(optimizer)
        )

    def end_window(self) -> None:
        if self.window.store.micro_steps:
            self.window.store.end_window()
        self.window.end()

    def last_micro_step(self, closure: Callable[[], Any]) -> Any:
        self.in_update = True
        try:
            return closure()
        finally:
            self.in_update = False

    def window_already_overflowed(self) -> bool:
        scaling = self.scaling
        store = self.window.store
        if scaling is None or not scaling.skip_window_on_overflow or store.micro_steps == 0:
            return False
        return bool(store.has_overflow().item())  # host sync: opted in, one per micro-step

    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        trainer = self.trainer
        if not self.hooks.direct_before_step:
            compat.run_before_optimizer_step(trainer, optimizer)  # on_before_optimizer_step hooks, then clipping
        elif trainer.gradient_clip_val:
            algorithm = trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM
            self.host.precision_plugin.clip_gradients(
                optimizer, trainer.gradient_clip_val, GradClipAlgorithmType(algorithm)
            )

    def log_loss_scale(
        self,
        scaling: LossScalePrecision,
        found_inf: Tensor | None,
        scale: Tensor | None = None,
        skipped: Tensor | None = None,
    ) -> None:
        """Device tensors into Lightning's logger; they are read back only when the logger writes. ``scale`` and
        ``skipped``: the scaler's values right after this update, where its own tensors have moved on since (several
        updates in one compiled call); ``None``: the scaler's own."""
        if scaling.scaler is None or found_inf is None or not self.trainer.loggers:
            return  # each self.log call costs Lightning's bookkeeping; nothing would read these without a logger
        module = self.host.lightning_module
        assert module is not None
        for name, value in (
            ("loss_scale", scaling.scaler.scale if scale is None else scale),
            ("overflow", found_inf),
            ("skipped_updates", scaling.scaler.skipped if skipped is None else skipped),
        ):
            # float: Lightning warns when it converts an integer tensor for the logger itself
            module.log(name, value.to(torch.float32, copy=True), on_step=True, on_epoch=False, batch_size=1)
