"""MindSpore's two step programs, as a sink runs them: one interface, three implementations chosen once per fit.

- The *accumulate program* trains a micro-batch that does not end its window: forward, backward, its gradient
  added into the window's fp32 sum.
- The *update program* trains the window's last micro-batch the same way, then makes the update: the one
  reduction, divide/unscale, the overflow agreement, ``on_before_optimizer_step`` and clipping, the optimizer step
  (or the skip), the loss-scale update and the window reset.

Both satisfy ``MicroBatchProgram``: ``run(batch, batch_idx)`` trains one micro-batch (already on the device) and returns
its detached loss, ``None`` when ``training_step`` returned ``None``; the window state they work on
(``lightning_sink.window.state.Window``) is given at construction and held, so a program that runs a whole step
as one compiled function can keep it on the device. ``loss_divisor`` is what the program divides each loss by
before its backward; the update divides the window's sum by the rest (``Window.mean_divisor``).

The implementations (``choose_programs`` picks them from the ``HookPlan``):

- ``HookedAccumulate`` / ``HookedUpdate``: every Lightning hook in Lightning's order (the zero-grad hooks at a
  window's first micro-batch, ``Strategy.backward`` with its hooks, the module's ``optimizer_step`` hook whose
  ``optimizer.step(closure)`` runs the last micro-batch); each loss divided by N, as Lightning's closure does.
- ``DirectAccumulate`` / ``DirectUpdate``: nobody overrides those hooks, so no dispatch and no closure; each loss
  divided by N all the same (so that the window's sum rounds as stock's; under a loss scale, whole, as the
  compiled programs take it), the update divides by the rest.
- ``SingleStepUpdate``: windows of one micro-step on one process without a loss scale: nothing to sum, reduce,
  unscale or divide; a plain loop's zero-grad, forward, backward and step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from lightning.pytorch.loops.optimization.automatic import ClosureResult
from torch import Tensor

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import SingleStepGradients
from lightning_sink.strategies.engine import StepEngine, loss_of
from lightning_sink.window.state import Window

__all__ = [
    "MicroBatchProgram",
    "SeveralSteps",
    "PairCall",
    "SinkPrograms",
    "SinkUpdates",
    "HookedAccumulate",
    "HookedUpdate",
    "DirectAccumulate",
    "DirectUpdate",
    "SingleStepUpdate",
    "choose_eager",
    "choose_programs",
]


class MicroBatchProgram(Protocol):
    """One micro-batch of a window: the accumulate program, or the update program that ends the window."""

    loss_divisor: int  # what each micro-batch's loss is divided by before its backward

    def run(self, batch: Any, batch_idx: int) -> Tensor | None:
        """Train one micro-batch (on the device already); its detached loss, ``None`` for a ``None`` step."""
        ...


class SeveralSteps(Protocol):
    """Micro-batches (whole windows) trained in one call, where that is exact (``ready``)."""

    def length_within(self, room: int) -> int:
        """The micro-batches of a call where ``room`` are left before the segment's, the data pass's or
        ``max_steps``' end; 0: no call of this kind fits."""
        ...

    def ready(self) -> bool:
        """Whether the next micro-batches may run in one call (asked at each candidate micro-batch)."""
        ...

    def run(self, batches: list[Any], batch_idx: int) -> list[Callable[[], Tensor | None]]:
        """Train ``batches`` (the first one's index in its sink is ``batch_idx``) in one call; then, per micro-batch
        in order, a function doing its host-side effects (counting, ``self.log``, an update's bookkeeping) and
        returning its detached loss."""
        ...


class PairCall:
    """A call of one micro-batch, trained by the pair (the ``SeveralSteps`` of one): the accumulate program, or
    the update program where the micro-batch ends its window. Training runs in the micro-batch's function, so its
    effects come in the same order as a call of several's."""

    def __init__(self, programs: SinkPrograms, engine: StepEngine) -> None:
        self._programs, self._engine = programs, engine

    def length_within(self, room: int) -> int:
        return min(room, 1)

    def ready(self) -> bool:
        return True

    def run(self, batches: list[Any], batch_idx: int) -> list[Callable[[], Tensor | None]]:
        (batch,) = batches
        return [partial(self._train, batch, batch_idx)]

    def _train(self, batch: Any, batch_idx: int) -> Tensor | None:
        engine = self._engine  # (read when it trains: several such functions may be made before the first runs)
        ends = engine.window.micro_batches + 1 >= engine.accumulation_steps
        return (self._programs.update if ends else self._programs.accumulate).run(batch, batch_idx)


class SinkUpdates:
    """Counts the updates of one sink as Lightning counts its own (progress counters), then steps the
    step-interval LR schedulers (not after an update skipped on overflow; not for an update of a compiled call of
    several, whose schedulers were stepped before the call: ``sink/programs/scheduler_steps.py``)."""

    def __init__(self, engine: StepEngine, schedulers_stepped: Callable[[int], None] | None = None) -> None:
        """``schedulers_stepped``: told the global step of each update whose schedulers were stepped before its
        compiled call (the sink's log buffer keeps the settings a LearningRateMonitor reads after it)."""
        self._engine = engine
        self.schedulers_stepped = schedulers_stepped
        self.count = 0

    def make(self, run_update: Callable[[], Any], step_schedulers: bool = True) -> None:
        engine = self._engine
        engine.counters.update_ready()
        run_update()
        engine.counters.update_completed()
        self.count += 1
        if step_schedulers and engine.step_scheduler_configs and not engine.last_update_skipped:
            self.step_schedulers(engine.trainer.global_step)

    def step_schedulers(self, global_step: int) -> None:
        """The step-interval schedulers' steps after the update that made ``global_step``: each config's every
        ``frequency`` updates, as Lightning steps them (a compiled call of several steps them before the call)."""
        engine = self._engine
        trainer, direct = engine.trainer, engine.hooks.direct_scheduler_step
        for config in engine.step_scheduler_configs:
            if global_step % config.frequency == 0:
                if direct:
                    config.scheduler.step()  # LightningModule.lr_scheduler_step's body (HookPlan)
                else:
                    compat.call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)


def _step_args(engine: StepEngine, batch: Any, batch_idx: int) -> tuple[Any, ...]:
    return (batch, batch_idx) if engine.parts.step_takes_batch_idx else (batch,)


class _Hooked:
    """What both hooked programs share: the closure Lightning's automatic optimization would build."""

    def __init__(self, engine: StepEngine, window: Window, updates: SinkUpdates) -> None:
        self._engine, self._window, self._updates = engine, window, updates
        self.loss_divisor = engine.accumulation_steps

    def _closure(self, batch: Any, batch_idx: int, starts: bool, result: list[Tensor | None]) -> Callable[[], Any]:
        engine = self._engine
        trainer, optimizer, module = engine.trainer, engine.optimizer(), engine.trainer.lightning_module

        def closure() -> Tensor | None:
            # Inside the module's optimizer_step hook Lightning's current hook name is "optimizer_step"; its own
            # closure runs training_step as the "training_step" hook, and self.log files values under that name.
            hook = compat.swap_hook_name(module, "training_step")
            try:
                output = engine.forward(*_step_args(engine, batch, batch_idx))
            finally:
                compat.swap_hook_name(module, hook)
            step = ClosureResult.from_training_step_output(output, self.loss_divisor)
            if starts:
                compat.run_zero_grad(trainer, batch_idx, optimizer)
            if step.closure_loss is not None:
                engine.host.backward(step.closure_loss, optimizer)  # Lightning's backward, with its hooks
                result[0] = step.loss
            return step.loss

        return closure

    def _open(self) -> bool:
        """Count the micro-batch into its window; whether it is the window's first."""
        window = self._window
        starts = window.micro_batches == 0
        if starts and window.store.micro_steps:
            self._engine.end_window()  # an optimizer_step hook that ran the closure without stepping
        window.count_micro_batch()
        return starts


class HookedAccumulate(_Hooked):
    def run(self, batch: Any, batch_idx: int) -> Tensor | None:
        result: list[Tensor | None] = [None]
        self._closure(batch, batch_idx, self._open(), result)()
        return result[0]


class HookedUpdate(_Hooked):
    def run(self, batch: Any, batch_idx: int) -> Tensor | None:
        engine = self._engine
        trainer = engine.trainer
        result: list[Tensor | None] = [None]
        closure = self._closure(batch, batch_idx, self._open(), result)
        self._window.close()
        self._updates.make(
            lambda: compat.call_lightning_module_hook(
                trainer,
                "optimizer_step",
                trainer.current_epoch,
                batch_idx,
                compat.lightning_optimizer(engine.host),
                closure,
            )
        )
        return result[0]


class _Direct:
    """What both direct programs share: forward and backward into the window's sum, no hook dispatch. Each loss
    is divided by N before its backward, as Lightning's closure divides it, so that the sum rounds as stock's (a
    window the compiled programs began, of whole losses, is rescaled when this pair takes it on:
    ``Window.divide_losses_by``). Under a loss scale each loss stays whole, as the compiled programs scale it: the
    package's scale rule is its own, and a division before the scaling would move where fp16 overflows."""

    def __init__(self, engine: StepEngine, window: Window, updates: SinkUpdates) -> None:
        self._engine, self._window, self._updates = engine, window, updates
        self._store_checked = False  # whether this sink has checked the trainable set
        self.loss_divisor = engine.accumulation_steps if engine.scaling is None else 1

    def _micro_step(self, batch: Any, batch_idx: int, ends: bool) -> Tensor | None:
        engine, window = self._engine, self._window
        if window.micro_batches == 0:
            if not self._store_checked:
                # Parameters unfrozen or param groups added: that happens in hooks (finetuning callbacks), and none
                # runs inside a sink on this path, so the first window start of each sink is the one to check.
                engine.refresh_store()
                self._store_checked = True
            window.store.zero_grad()  # what the default optimizer_zero_grad (set_to_none=True) leaves
            engine.counters.zero_grad()
        window.count_micro_batch()
        loss = loss_of(engine.forward(*_step_args(engine, batch, batch_idx)))
        if loss is not None:
            store = window.store
            store.begin_micro_step(ends)
            divisor = self.loss_divisor
            engine.backward(loss / divisor if divisor != 1 else loss, skip=window.overflowed)
            store.end_micro_step()
            loss = loss.detach()
        return loss


class DirectAccumulate(_Direct):
    def run(self, batch: Any, batch_idx: int) -> Tensor | None:
        return self._micro_step(batch, batch_idx, ends=False)


class DirectUpdate(_Direct):
    def run(self, batch: Any, batch_idx: int) -> Tensor | None:
        loss = self._micro_step(batch, batch_idx, ends=True)
        self._window.close()
        self._updates.make(self._update)
        return loss

    def _update(self) -> None:
        engine = self._engine
        optimizer = engine.optimizer()
        if engine.scaling is not None:
            engine.update_step(optimizer, lambda: None)
            return
        # The window's forwards and backwards already ran and nobody hooks into the update, so there is nothing
        # for optimizer.step to run inside it: the mean gradient is readied first, then the optimizer steps (with
        # no closure, as a plain loop calls it).
        engine.ready_window_gradient(optimizer)
        engine.last_update_skipped = False
        optimizer.step()
        engine.end_window()


class SingleStepUpdate:
    """Nothing to sum, reduce, unscale, divide or dispatch: a plain loop's zero-grad, forward, backward and step,
    with Lightning's progress counters moved as its own loop moves them."""

    loss_divisor = 1

    def __init__(self, engine: StepEngine, window: Window, updates: SinkUpdates) -> None:
        self._engine, self._window, self._updates = engine, window, updates
        trainer = engine.trainer
        # whether the update has hooks or clipping before its step
        self._work_before_step = bool(trainer.gradient_clip_val) or not engine.hooks.direct_before_step

    def run(self, batch: Any, batch_idx: int) -> Tensor | None:
        engine = self._engine
        self._window.store.zero_grad()  # as the default optimizer_zero_grad: set_to_none=True
        engine.counters.zero_grad()
        loss = loss_of(engine.forward(*_step_args(engine, batch, batch_idx)))
        if loss is not None:
            loss.backward()
            loss = loss.detach()
        self._updates.make(self._update)
        return loss

    def _update(self) -> None:
        optimizer = self._engine.optimizer()
        if self._work_before_step:
            self._engine.before_optimizer_step(optimizer)  # on_before_optimizer_step hooks, clipping
        optimizer.step()  # (a step without a loss: every .grad is None, nothing changes)


@dataclass(frozen=True)
class SinkPrograms:
    """The pair a sink runs: ``accumulate`` for micro-batches inside a window, ``update`` for its last one."""

    accumulate: MicroBatchProgram
    update: MicroBatchProgram
    end_sink: Callable[[], None] | None = None  # called at the sink's end (compiled programs save the window there)
    # calls of several micro-batches (compiled programs), longest first: the loop runs the longest that fits
    several: tuple[SeveralSteps, ...] = ()
    # compiled programs built with their calls of several alone: before a segment that trains any micro-batch one
    # per call, the loop calls it for the programs to run instead (the pair built, or the eager pair where it did not)
    build_pair: Callable[[], SinkPrograms] | None = None
    # compiled programs: the call of a data pass's partial last batch, a shape they were not built for (the eager
    # pair trains it: ``sink/programs/partial_batch.py``); None: the pair trains it
    partial_batch: SeveralSteps | None = None


def choose_programs(engine: StepEngine, updates: SinkUpdates) -> SinkPrograms:
    """With every hook (``HookPlan``), without hook dispatch, or, for windows of one micro-step on one process
    without a loss scale, a plain loop's step."""
    window = engine.window
    if not engine.hooks.direct_sink_step:
        return SinkPrograms(HookedAccumulate(engine, window, updates), HookedUpdate(engine, window, updates))
    direct = DirectAccumulate(engine, window, updates)
    if engine.accumulation_steps == 1 and engine.scaling is None:
        # Every micro-step starts a window, and no hook runs inside this sink to change the trainable set.
        engine.refresh_store()
        if isinstance(window.store, SingleStepGradients):
            return SinkPrograms(direct, SingleStepUpdate(engine, window, updates))
    return SinkPrograms(direct, DirectUpdate(engine, window, updates))


def choose_eager(engine: StepEngine, updates: SinkUpdates, example: Callable[[], Any]) -> SinkPrograms:
    """The sink loop's ``choose`` in eager graph mode: ``choose_programs`` (the eager pair builds nothing, so it
    never reads the example micro-batch)."""
    return choose_programs(engine, updates)
