"""The compiled step programs as the sink loop calls them: ``CompiledAccumulate`` / ``CompiledUpdate`` (one
micro-batch per call, ``MicroBatchProgram``) and ``CompiledSeveral`` (whole windows per call, ``SeveralSteps``), each a
call of ``lightning_sink.compiled``'s ``StepPrograms``, built by the fit's choice (``compiled_choice.py`` here).

What stays where it was:

- Parameters, buffers and the optimizer's state are the module's and the optimizer's own tensors, written in place;
  learning rates (and the other scheduled hyperparameters) enter as tensors refreshed before each update, so an
  ``interval="step"`` scheduler stepped by ``SinkUpdates`` changes values, never the compiled program.
- Lightning's counters, ``global_step``, the LR schedulers, the loss-scale bookkeeping (``last_update_skipped``, the
  logged ``loss_scale``/``overflow``/``skipped_updates``) move exactly as on the direct eager path (``SinkUpdates``).
- The open window: the engine's ``Window`` counts its micro-batches and backward passes on the host as the eager
  path does (its fp32 sum is in the programs' buffers during a sink).
- ``self.log`` inside ``training_step``: the values come out of the program and are handed to ``self.log`` (during
  a sink, the log buffer of ``sink/logging.py``) after each call, with the options they were logged with.

A program given a ``StagedBatch`` (``sink/staging.py``) runs without a batch argument: it gathers that batch itself.

``CompiledSeveral`` runs M micro-batches per call (``micro_steps_per_call``) where that is exact: at a window's start,
with the accumulation the program was built for; where one graph of the loop serves every number of windows, a
segment's rest of two windows or more as well (``length_within``). Each update of the call reads its own
hyperparameters, for which ``SchedulerSteps`` steps the fit's ``interval="step"`` schedulers through the call's
updates before it. After the call every micro-batch's host effects are done in order, as the one-per-call pair does
them, the schedulers' steps excepted (``SinkLoop`` asks the rest: segment, pass and ``max_steps``; ``max_time`` is
read between calls).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import Tensor

from lightning_sink.compiled import StepOutputs, StepPrograms
from lightning_sink.sink.programs.eager import SinkUpdates
from lightning_sink.sink.programs.scheduler_steps import SchedulerSteps
from lightning_sink.sink.staging import StagedBatch
from lightning_sink.strategies.engine import StepEngine
from lightning_sink.window import FlatAllReduce

__all__ = ["CompiledAccumulate", "CompiledUpdate", "CompiledSeveral"]


class _Compiled:
    """What the compiled programs share: the window's host counts, the batch index, the log values and a window's
    end after its update."""

    loss_divisor = 1  # the programs add undivided gradients; the update divides by the window's micro-steps

    def __init__(self, programs: StepPrograms, engine: StepEngine, updates: SinkUpdates, copy_outputs: bool) -> None:
        """``copy_outputs``: CUDA graphs, whose next replay overwrites the outputs of the last."""
        self._programs, self._engine, self._updates = programs, engine, updates
        self._copy_outputs = copy_outputs

    def _start(self, batch_idx: int) -> StepPrograms:
        """One micro-batch's call about to run: the micro-batch counted into its window and ``training_step``'s
        ``batch_idx`` set."""
        self._count_micro_batch()
        self._programs.batch_index.fill_(batch_idx)
        return self._programs

    def _count_micro_batch(self) -> None:
        """Count the micro-batch into its window, as the direct pair does."""
        engine = self._engine
        window = engine.window
        if window.micro_batches == 0:
            engine.counters.zero_grad()  # Lightning's zero-grad progress, as its loop counts it at a window start
        window.count_micro_batch()

    def _outputs(self, programs: StepPrograms, out: StepOutputs) -> Tensor:
        """The micro-batch's loss, its logged values handed to ``self.log``."""
        copy = self._copy_outputs
        logs = programs.logged.host_logs(out, copy)  # (a torchmetrics Metric's calls made here, eagerly)
        if logs:
            module = self._engine.trainer.lightning_module
            options = programs.logged.options
            for name, value in logs.items():
                module.log(
                    name, value.clone() if copy and isinstance(value, Tensor) else value, **options.get(name, {})
                )
        return out.loss.clone() if copy else out.loss

    def _end_window(self, programs: StepPrograms, out: StepOutputs) -> Tensor:
        """A window's last micro-batch after its update ran (inside ``SinkUpdates.make``): its outputs, the update's
        loss-scale bookkeeping and the window's reset; its loss."""
        engine = self._engine
        loss = self._outputs(programs, out)
        scaling = engine.scaling
        scaler = None if scaling is None else scaling.scaler
        # the schedulers hold after a skipped update: the one host read of the window's flag, as on the eager path,
        # and only where a step scheduler needs it (never with several micro-batches per call: the chooser builds
        # none then, SchedulerSteps.reason)
        engine.last_update_skipped = (
            bool(engine.step_scheduler_configs)
            and scaler is not None
            and scaler.skips_overflow
            and out.found_inf is not None
            and bool(out.found_inf.item())
        )
        if scaling is not None:
            # (the scale and the skipped count come out of a call of several; a call of one leaves them None)
            engine.log_loss_scale(scaling, out.found_inf, out.scale, out.skipped)
        engine.window.clear_backward_count()
        engine.window.end()
        return loss


class CompiledAccumulate(_Compiled):
    def run(self, batch: Any, batch_idx: int) -> Tensor | None:
        programs = self._start(batch_idx)
        out = programs.accumulate(_own_batch(batch))
        self._engine.window.count_backward()  # the backward passes of the window, counted on the host
        return self._outputs(programs, out)


class CompiledUpdate(_Compiled):
    def run(self, batch: Any, batch_idx: int) -> Tensor | None:
        programs = self._start(batch_idx)
        engine = self._engine
        engine.window.close()
        result: list[Tensor] = []

        def update() -> None:
            out = programs.update(_own_batch(batch))
            if programs.rank_sum is not None:
                assert isinstance(engine.reducer, FlatAllReduce)  # (the only reducer programs are built for)
                engine.reducer.broadcast_module_buffers()  # as the eager pair does after its all-reduce
            result.append(self._end_window(programs, out))

        self._updates.make(update)
        return result[0]


def _own_batch(batch: Any) -> Any:
    """What a program takes: ``None`` for a staged micro-batch (it gathers that batch itself), else the batch."""
    return None if isinstance(batch, StagedBatch) else batch


class CompiledSeveral(_Compiled):
    """``micro_steps_per_call`` micro-batches, whole windows, in one compiled call (``SeveralSteps``)."""

    def __init__(
        self,
        programs: StepPrograms,
        engine: StepEngine,
        updates: SinkUpdates,
        copy_outputs: bool,
        count: int,
        schedulers: SchedulerSteps,
    ) -> None:
        """``count``: the micro-steps of this call, one of ``programs.call_lengths`` (the longest: any whole number
        of windows from two up to it, where the programs run them all, ``StepPrograms.any_shorter_call``);
        ``schedulers``: the fit's step schedulers, stepped through each call's updates before it."""
        super().__init__(programs, engine, updates, copy_outputs)
        assert programs.several is not None and count in programs.call_lengths
        self.count, self._window_length = count, programs.several[1]
        self._shorter = programs.any_shorter_call and count == programs.call_lengths[0]
        self._schedulers = schedulers

    def length_within(self, room: int) -> int:
        window = self._window_length
        if not self._shorter:
            return self.count if room >= self.count else 0
        windows = min(room, self.count) // window
        if room // window - windows == 1 and windows > 2:
            windows -= 1  # (a rest of one window would need programs of its own: two calls of two windows or more)
        return windows * window if windows >= 2 else 0

    def ready(self) -> bool:
        return (
            self._window_length == self._engine.accumulation_steps  # (a GradientAccumulationScheduler may change it)
            and self._engine.window.micro_batches == 0
        )

    def run(self, batches: list[Any], batch_idx: int) -> list[Callable[[], Tensor | None]]:
        programs, steps = self._programs, self._window_length
        programs.batch_index.fill_(batch_idx)  # the programs count it on per micro-step
        hyperparameters = self._schedulers.step_through(programs.rule, len(batches) // steps, self._updates)
        staged = isinstance(batches[0], StagedBatch)
        outputs = programs.run_several(None if staged else batches, hyperparameters, count=len(batches))
        return [partial(self._finish, programs, out, (i + 1) % steps == 0) for i, out in enumerate(outputs)]

    def _finish(self, programs: StepPrograms, out: StepOutputs, ends: bool) -> Tensor:
        """One micro-batch's host effects after the call, as ``CompiledAccumulate`` / ``CompiledUpdate`` do them."""
        window = self._engine.window
        self._count_micro_batch()
        if not ends:
            window.count_backward()
            return self._outputs(programs, out)
        window.close()
        result: list[Tensor] = []
        self._updates.make(lambda: result.append(self._end_window(programs, out)), step_schedulers=False)
        return result[0]
