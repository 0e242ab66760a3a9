"""The step engine shared by every sink strategy: MindSpore's accumulation semantics inside Lightning's loop.

Without sinking, Lightning's automatic optimization drives each micro-batch as it does for any strategy: the
zero-grad hooks at a window's first batch, ``training_step``, the backward, and at the window's last batch the
``LightningModule.optimizer_step`` hook, the progress counters and the LR schedulers. The engine sits in the
extension points a strategy owns:

1. ``training_step`` calls the LightningModule directly (DDP's reducer never fires; ``graph_mode`` applies);
2. ``pre_backward`` lets the gradient store prepare ``.grad`` (the fp32 window sum) before Lightning's own
   ``backward`` (and its hooks) backpropagates, ``post_backward`` closes the micro-step;
3. ``optimizer_step`` (reached through the module's ``optimizer_step`` hook and ``optimizer.step(closure)``) ends
   the window. Without a loss scale, as Lightning's own precision plugin, it hands ``optimizer.step`` a closure
   that runs the window's last micro-batch, then readies the mean gradient (one reduction, the division,
   ``on_before_optimizer_step`` and clipping); with one, as Lightning's mixed precision, it runs the closure,
   then ``finish_window``: reduction, divide/unscale, the hooks and clipping, step or skip, loss-scale update.

Lightning divides each loss by ``accumulate_grad_batches`` (N); a window of k micro-steps that returned a loss
is divided by k/N at its end, so every update is the mean over its micro-batches. With sinking (``sink_size``) a
Lightning batch is a whole sink; ``_run_sink`` below runs its micro-steps and calls the same hooks, in the same
order, as Lightning would per micro-batch and per update (see ``docs/lightning-compatibility.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.optim import Optimizer

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import MicroStep, SingleStepGradients, plan_micro_step
from lightning_sink.precision import LossScalePrecision
from lightning_sink.sink_data import PASS_END, SinkToken
from lightning_sink.strategies.fit_lifecycle import FitLifecycleMixin
from lightning_sink.window import finish_window, ready_window_gradient

__all__ = ["StepEngineMixin"]


def _loss_of(output: STEP_OUTPUT) -> Tensor | None:
    """The loss in a ``training_step`` output, or ``None`` (the micro-batch is skipped, as in Lightning).

    An output without a loss raises Lightning's own ``MisconfigurationException``, as its closure does."""
    if type(output) is Tensor or isinstance(output, Tensor):  # the type check first: isinstance costs ~0.5 us
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return ClosureResult.from_training_step_output(output).closure_loss  # None, or Lightning's own error


def _forget_gradients(optimizer: Optimizer) -> None:
    """``zero_grad(set_to_none=True)`` without calling the optimizer's own ``zero_grad`` (whose calls users count)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


class StepEngineMixin(FitLifecycleMixin):
    """Mixed into a Lightning ``Strategy`` subclass: one micro-batch and the sink loop around it, in call order (the
    fit's settings and collaborators: ``fit_lifecycle.py``)."""

    # ------------------------------------------------------------------ windows that Lightning does not delimit
    def _plan_micro_step(self) -> MicroStep:
        return plan_micro_step(
            self._accumulator.micro_steps,
            self.accumulation_steps,
            compat.is_last_batch_of_epoch(self._trainer),
            self.partial_window,
        )

    def _batch_has_no_update(self) -> bool:
        """Lightning asks this several times per batch (``carry`` and ``drop``); decided once, before the batch."""
        batch_key = self._trainer.fit_loop.total_batch_idx
        if self._planned is None or self._planned[0] != batch_key:
            self._planned = (batch_key, self._plan_micro_step() is MicroStep.UPDATE)
        return not self._planned[1]

    # ------------------------------------------------------------------ one micro-batch, in call order
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Lightning's closure calls this first (the window's last micro-batch: from inside ``optimizer_step``)."""
        if not self._accumulating:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        if self._stream is not None:
            return self._run_sink()
        if self.partial_window != "scale":
            self._batch_has_no_update()  # fix the plan for this batch before its state changes
            self._drop_window = self._plan_micro_step() is MicroStep.ACCUMULATE_THEN_DROP
        elif self._accumulator.micro_steps and self._trainer.fit_loop.batch_idx % self.accumulation_steps == 0:
            self._accumulator.end_window()  # an optimizer_step hook that ran the closure without stepping
        if self._in_update or self._passthrough:
            output = self._forward(*args, **kwargs)
        else:
            output = self.accumulate_step(*args, **kwargs)
        self._passes.batch_trained(compat.is_last_batch_of_epoch(self._trainer))  # (sinks count their own)
        return output

    def accumulate_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The forward of a micro-batch that does not end its window; Lightning's closure runs its backward."""
        return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        skip_backward = self._window_already_overflowed()
        if self._scaling is not None:
            self._scaling.skip_backward = skip_backward  # the plugin's backward (and _direct_backward) skip it
        if not self._needs_step_context and not skip_backward and torch.is_grad_enabled():
            output = self._step_function(*args, **kwargs)  # nothing to enter: the contexts cost a few us a step
        else:
            with self.precision_plugin.train_step_context(), torch.set_grad_enabled(not skip_backward):
                output = self._step_function(*args, **kwargs)
        if output is None and self.world_size > 1:
            # Lightning's own rule (its loop raises the same): the ranks' reductions would no longer pair up
            raise RuntimeError(
                "Skipping the `training_step` by returning None in distributed training is not supported: every"
                " rank must contribute to each window's gradient reduction."
            )
        return output

    @contextmanager
    def block_backward_sync(self) -> Any:
        """Nothing to block: the LightningModule is called directly, so DDP's reducer never fires."""
        yield

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Before Lightning's backward (and its hooks): the store prepares ``.grad`` (the window's fp32 sum).

        The engine lives in ``pre_backward``/``post_backward`` rather than ``backward``, so ``Strategy.backward``
        stays Lightning's own (what code that wraps or counts it expects)."""
        super().pre_backward(closure_loss)  # type: ignore[misc]
        if not self._accumulating or self._passthrough:
            return
        store = self._accumulator
        if store.micro_steps == 0:
            self._refresh_store()
            store = self._accumulator
        store.begin_micro_step(self._in_update or self._drop_window)

    def post_backward(self, closure_loss: Tensor) -> None:
        if self._accumulating and not self._passthrough:
            self._accumulator.end_micro_step()
            if self._drop_window:
                self._accumulator.clear()  # the epoch ends inside a window under "drop": discard it
                self._drop_window = False
        super().post_backward(closure_loss)  # type: ignore[misc]

    def _window_backward_direct(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        if args or kwargs:  # arguments for Tensor.backward: Lightning's path hands them on
            return Strategy.backward(self, closure_loss, optimizer, *args, **kwargs)  # type: ignore[arg-type]
        self.pre_backward(closure_loss)
        self._direct_backward(closure_loss)
        self.post_backward(closure_loss)
        return closure_loss

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Without transfer hooks to run (``HookPlan``), the move itself, without dispatching to nobody. A sink's
        placeholder batch stays as it is: the transfer hooks see each real micro-batch instead (``_to_device``)."""
        if self._direct_transfer or isinstance(batch, SinkToken):
            return move_data_to_device(batch, device or self.root_device)  # type: ignore[attr-defined]
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    def _direct_backward(self, loss: Tensor) -> None:
        """What Lightning's backward does with a plain precision plugin and no hooks: scale, backpropagate."""
        scaling = self._scaling
        if scaling is None:
            loss.backward()
        elif not scaling.skip_backward:  # the window already overflowed: its forward ran without autograd
            (loss if scaling.scaler is None else loss * scaling.scaler.scale.to(loss.dtype)).backward()

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Reached from the module's ``optimizer_step`` hook through ``optimizer.step(closure=...)``."""
        if not self._accumulating or self._passthrough:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        return self.update_step(optimizer, closure, **kwargs)

    def update_step(self, optimizer: Optimizer, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The window's last micro-batch (the closure: forward, backward) and the window's update."""
        scaling = self._scaling
        if scaling is None:
            return self._update_inside_step(optimizer, closure, **kwargs)
        loss = self._last_micro_step(closure)
        store = self._accumulator
        if store.micro_steps == 0:
            return loss  # no micro-batch of this window returned a loss: nothing to apply
        found_inf = finish_window(
            store,
            self._reducer,
            scaling,
            optimizer,
            self._window_divisor(),
            lambda: self._before_optimizer_step(optimizer),
            **kwargs,
        )
        self._last_update_skipped = bool(self._step_scheduler_configs) and scaling.window_overflowed(found_inf)
        self._log_loss_scale(scaling, found_inf)
        return loss

    def _update_inside_step(self, optimizer: Optimizer, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """``optimizer.step(closure)`` as Lightning's fp32 precision plugin calls it: the optimizer enters its
        ``step``, runs the closure (the window's last micro-batch, then its mean gradient, hooks and clipping),
        then updates, so an optimizer's own ``step`` sees the calls in stock Lightning's order."""
        store = self._accumulator

        def window_closure() -> Any:
            loss = self._last_micro_step(closure)
            self._ready_window_gradient(optimizer)
            return loss

        self._last_update_skipped = False
        output = optimizer.step(closure=window_closure, **kwargs)
        if store.micro_steps:
            store.end_window()
        return output

    def _ready_window_gradient(self, optimizer: Optimizer) -> None:
        """The window's mean gradient in ``.grad``, then the ``on_before_optimizer_step`` hooks and clipping. A window
        where no ``training_step`` returned a loss has no gradient (``.grad`` is ``None``, so the step changes
        nothing); its hooks still run, as stock runs them."""
        store = self._accumulator
        if store.micro_steps:
            ready_window_gradient(
                store, self._reducer, None, self._window_divisor(), lambda: self._before_optimizer_step(optimizer)
            )
        else:
            _forget_gradients(optimizer)
            self._before_optimizer_step(optimizer)

    def _last_micro_step(self, closure: Callable[[], Any]) -> Any:
        self._in_update = True
        try:
            return closure()
        finally:
            self._in_update = False

    def _window_divisor(self) -> float:
        """Lightning divided every loss by N; the mean over the k micro-steps (on every rank) divides by k/N more."""
        return self._accumulator.micro_steps * self._ranks_in_sum() / self._loss_divisor()

    def _ranks_in_sum(self) -> int:
        """Ranks whose gradients the reduced window sums (FSDP2's reduce-scatter averages them already)."""
        return self.world_size

    def _loss_divisor(self) -> int:
        """What each micro-step's loss was divided by before backward: Lightning's ``accumulate_grad_batches``
        (the sink's hook path divides as Lightning does), 1 on the sink's direct path."""
        if self._stream is not None and self._hooks.direct_sink_step:
            return 1
        return self.accumulation_steps

    def _window_already_overflowed(self) -> bool:
        scaling = self._scaling
        if scaling is None or not scaling.skip_window_on_overflow or self._accumulator.micro_steps == 0:
            return False
        return bool(self._accumulator.has_overflow().item())  # host sync: opted in, one per micro-step

    def _before_optimizer_step(self, optimizer: Optimizer) -> None:
        trainer = self._trainer
        if not self._hooks.direct_before_step:
            compat.run_before_optimizer_step(trainer, optimizer)  # on_before_optimizer_step hooks, then clipping
        elif trainer.gradient_clip_val:
            self.precision_plugin.clip_gradients(
                optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm or "norm"
            )

    def _log_loss_scale(self, scaling: LossScalePrecision, found_inf: Tensor | None) -> None:
        """Device tensors into Lightning's logger; they are read back only when the logger writes."""
        if scaling.scaler is None or found_inf is None or not self._trainer.loggers:
            return  # Lightning's self.log costs ~0.1 ms a call; nothing would read these without a logger
        module = self.lightning_module
        for name, value in (
            ("loss_scale", scaling.scaler.scale),
            ("overflow", found_inf),
            ("skipped_updates", scaling.scaler.skipped),
        ):
            # float: Lightning warns when it converts an integer tensor for the logger itself
            module.log(name, value.to(torch.float32, copy=True), on_step=True, on_epoch=False, batch_size=1)

    def _step_lr_schedulers(self, trainer: pl.Trainer) -> None:
        for config in self._step_scheduler_configs:
            if trainer.global_step % config.frequency == 0:
                compat.call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)

    # ------------------------------------------------------------------ the sink loop
    def _run_sink(self) -> dict[str, Tensor] | None:
        """K micro-steps inside one Lightning batch; nothing is read back to the host (losses stay on the device).

        Windows run on across sinks and data passes (the data is one endless stream), so ``partial_window`` does
        not apply here. A ``max_steps`` reached inside the sink ends it; the data position records what was trained.
        ``self.log`` calls are recorded during the sink and handed to Lightning at its end (``sink_logging.py``).
        """
        buffer = self._log_buffer
        if buffer is None:
            return self._run_micro_steps()
        buffer.install()
        try:
            output = self._run_micro_steps()
            buffer.flush()
        finally:
            buffer.uninstall()
        return output

    def _run_micro_steps(self) -> dict[str, Tensor] | None:
        trainer, stream, buffer = self._trainer, self._stream, self._log_buffer
        self._counters = compat.UpdateCounters(trainer)
        self._store_checked = False
        # the updates this sink may make before max_steps (global_step moves only through this sink's updates)
        updates_allowed = trainer.max_steps - trainer.global_step if trainer.max_steps != -1 else -1
        # Batches need moving unless the stream's thread already did, or they are for the CPU and no transfer hook
        # runs (a loader's batches are on the CPU already; walking them costs ~10 us a step).
        to_device = stream.copier is None and not (self._direct_transfer and self.root_device.type == "cpu")
        # Lightning's loop converted only the sink's placeholder; "16-true" and the like convert each real batch.
        converts_input = type(self.precision_plugin).convert_input is not Precision.convert_input  # type: ignore[attr-defined]
        micro_step = self._choose_micro_step()
        losses: list[Tensor] = []
        micro_index = 0
        while self.sink_size == -1 or micro_index < self.sink_size:
            if updates_allowed != -1 and self._sink_updates >= updates_allowed:
                break
            batch = stream.next()
            if batch is PASS_END:
                if self.sink_size == -1 and micro_index:
                    break  # one data pass per sink
                continue
            if converts_input:
                batch = self.precision_plugin.convert_input(batch)  # type: ignore[attr-defined]
            if to_device:
                batch = self._to_device(batch)
            if buffer is not None:
                buffer.begin_micro_step(batch)
            loss = micro_step(batch, micro_index)
            if loss is not None:
                losses.append(loss)
            self._data_position.advance()
            micro_index += 1
            if self._sink_window_batches == 0 and buffer is not None:
                buffer.end_update()  # the loggers get this update's values at its step (sink_logging.py)
        compat.set_logging_step(trainer, updated=self._sink_updates > 0)
        if not losses:
            return None  # every micro-batch returned None: Lightning skips the batch, as for a None step
        stacked = torch.stack(losses)
        return {"loss": stacked[-1], "mean_loss": stacked.mean(), "losses": stacked}

    def _choose_micro_step(self) -> Callable[[Any, int], Tensor | None]:
        """This sink's micro-step: with every hook (``HookPlan``), without hook dispatch, or, for windows of one
        micro-step on one process without a loss scale, a plain loop's step."""
        if not self._hooks.direct_sink_step:
            return self._sink_micro_step
        if self.accumulation_steps == 1 and self._scaling is None:
            # Every micro-step starts a window, and no hook runs inside this sink to change the trainable set.
            self._refresh_store()
            if isinstance(self._accumulator, SingleStepGradients):
                clips = bool(self._trainer.gradient_clip_val)
                self._work_before_step = clips or not self._hooks.direct_before_step
                return self._sink_single_step
        return self._sink_micro_step_direct

    def _step_args(self, batch: Any, batch_idx: int) -> tuple[Any, ...]:
        return (batch, batch_idx) if self._step_takes_batch_idx else (batch,)

    def _count_sink_update(self, run_update: Callable[[], Any]) -> None:
        """One update, counted as Lightning counts its own; then the step-interval LR schedulers."""
        self._counters.update_ready()
        run_update()
        self._counters.update_completed()
        self._sink_updates += 1
        if self._step_scheduler_configs and not self._last_update_skipped:
            self._step_lr_schedulers(self._trainer)

    def _sink_micro_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        """One micro-batch with every hook, in Lightning's order: ``training_step``; at a window's first batch
        ``on_before_zero_grad`` and ``optimizer_zero_grad``; the backward hooks; at its last batch the module's
        ``optimizer_step`` hook, whose ``optimizer.step(closure)`` runs this micro-batch and the update."""
        trainer, optimizer = self._trainer, self.optimizers[0]
        starts = self._sink_window_batches == 0
        result: list[Tensor | None] = [None]

        def closure() -> Tensor | None:
            output = self._forward(*self._step_args(batch, batch_idx))
            step = ClosureResult.from_training_step_output(output, self.accumulation_steps)
            if starts:
                compat.run_zero_grad(trainer, batch_idx, optimizer)
            if step.closure_loss is not None:
                self.backward(step.closure_loss, optimizer)
                result[0] = step.loss
            return step.loss

        if starts and self._accumulator.micro_steps:
            self._accumulator.end_window()  # an optimizer_step hook that ran the closure without stepping
        self._sink_window_batches += 1
        if self._sink_window_batches < self.accumulation_steps:
            closure()
            return result[0]
        self._sink_window_batches = 0
        self._count_sink_update(
            lambda: compat.call_lightning_module_hook(
                trainer, "optimizer_step", trainer.current_epoch, batch_idx, compat.lightning_optimizer(self), closure
            )
        )
        return result[0]

    def _sink_micro_step_direct(self, batch: Any, batch_idx: int) -> Tensor | None:
        """The same micro-step when nobody overrides its hooks: no dispatch, no closure object."""
        if self._sink_window_batches == 0:
            if not self._store_checked:
                # Parameters unfrozen or param groups added: that happens in hooks (finetuning callbacks), and none
                # runs inside a sink on this path, so the first window start of each sink is the one to check.
                self._refresh_store()
                self._store_checked = True
            self._accumulator.zero_grad()  # what the default optimizer_zero_grad (set_to_none=True) leaves
            self._counters.zero_grad()
        store = self._accumulator
        self._sink_window_batches += 1
        ends = self._sink_window_batches == self.accumulation_steps
        output = self._forward(*self._step_args(batch, batch_idx))
        loss = _loss_of(output)
        if loss is not None:
            store.begin_micro_step(ends)
            self._direct_backward(loss)  # (not divided by N: _loss_divisor is 1 on this path)
            store.end_micro_step()
            loss = loss.detach()
        if ends:
            self._sink_window_batches = 0
            optimizer = self.optimizers[0]
            if self._scaling is None:
                self._count_sink_update(lambda: self._direct_update(optimizer))
            else:
                self._count_sink_update(lambda: self.update_step(optimizer, lambda: None))
        return loss

    def _direct_update(self, optimizer: Optimizer) -> None:
        """The update of the direct path without a loss scale. The window's forwards and backwards already ran and
        nobody hooks into the update, so there is nothing for ``optimizer.step`` to run inside it: the mean gradient
        is readied first, then the optimizer steps (with no closure, as a plain loop calls it)."""
        self._ready_window_gradient(optimizer)
        self._last_update_skipped = False
        optimizer.step()
        self._accumulator.end_window()

    def _sink_single_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        """Nothing to sum, reduce, unscale, divide or dispatch: a plain loop's zero-grad, forward, backward and
        step, with Lightning's progress counters moved as its own loop moves them."""
        self._accumulator.zero_grad()  # as the default optimizer_zero_grad: set_to_none=True
        self._counters.zero_grad()
        loss = _loss_of(self._forward(*self._step_args(batch, batch_idx)))
        if loss is not None:
            loss.backward()
            loss = loss.detach()
        self._count_sink_update(self._single_step_update)
        return loss

    def _single_step_update(self) -> None:
        optimizer = self.optimizers[0]
        if self._work_before_step:
            self._before_optimizer_step(optimizer)  # on_before_optimizer_step hooks, clipping
        optimizer.step()  # (a step without a loss: every .grad is None, nothing changes)

    def _to_device(self, batch: Any) -> Any:
        """The transfer hooks, as Lightning's loop runs them for each of its batches (``batch_to_device`` alone moves
        the batch when none is overridden)."""
        if not self._direct_transfer:
            batch = compat.before_batch_transfer(self.lightning_module, batch)  # type: ignore[attr-defined]
        return self.batch_to_device(batch)  # type: ignore[attr-defined]
