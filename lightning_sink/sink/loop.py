"""Sink mode's loop: K micro-batches inside one Lightning batch, each trained by a step program (``sink/programs/eager.py``),
with the logging and the LR schedulers that Lightning would have run per update done once per sink.

Windows run on across sinks and data passes (the data is one endless stream), so ``partial_window`` does not apply
here. A sink may run as several Lightning batches ("segments"), each ending at a point of the fit's schedule
(``sink/schedule.py``) or at the sink's planned end; a ``max_steps`` reached inside the sink cuts it short, and so
does a ``max_time`` deadline passed (the host clock read after each call, only when a time limit is set). The data
position records what was trained, so a resume continues the interrupted sink to its planned end. ``self.log``
calls are recorded during a segment and handed to Lightning at its end (``sink/logging.py``); the losses stay on
the device."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor

from lightning_sink import _lightning_compat as compat
from lightning_sink.compiled.program_state import stackable
from lightning_sink.data import DataPosition
from lightning_sink.sink.logging import SinkLogBuffer
from lightning_sink.sink.programs.eager import PairCall, SeveralSteps, SinkPrograms, SinkUpdates, choose_eager
from lightning_sink.sink.schedule import Segment, SinkSchedule
from lightning_sink.sink.staging import StagedBatch
from lightning_sink.sink_data import PASS_END, MicroBatchStream
from lightning_sink.strategies.engine import StepEngine
from lightning_sink.strategies.recompile_watch import RecompileWatch

__all__ = ["MaxTimeRule", "SinkLoop", "SinkLoopHooks"]


@dataclass(frozen=True)
class _SegmentCalls:
    """The calls a segment runs: one micro-batch by the pair, or several in one compiled call where they fit."""

    one: SeveralSteps
    several: tuple[SeveralSteps, ...]  # longest first
    partial_batch: SeveralSteps | None  # a data pass's partial last batch (None: ``one`` trains it)


@dataclass(frozen=True)
class _ReadAhead:
    """A micro-batch the loop read ahead (an example for a build), already prepared for the step."""

    batch: Any


@dataclass(frozen=True)
class MaxTimeRule:
    """How the loop applies the fit's ``max_time`` between calls (by default: no limit checked per step)."""

    time_left: Callable[[], float | None] = lambda: None
    """Seconds until ``max_time`` (``None``: no limit checked per step)."""
    agree: Callable[[bool], bool] | None = None
    """Under several processes, rank 0's decision that the time is up, given to every rank (the strategy's
    ``broadcast``, once per call while a time limit is set, as Lightning's ``Timer`` broadcasts once per batch)."""


@dataclass(frozen=True)
class SinkLoopHooks:
    """What a fit plugs into its sink loop, each default what a loop on its own needs (one object, so that the
    loop's constructor names the parts it runs on rather than every seam a fit may fill)."""

    max_time: MaxTimeRule = field(default_factory=MaxTimeRule)
    """The ``max_time`` deadline's clock and the ranks' agreement on it."""
    recompile_watch: RecompileWatch | None = None
    """Graph modes: TorchDynamo compiles the step, and the watch is told where each sink ends."""
    choose: Callable[[StepEngine, SinkUpdates, Callable[[], Any]], SinkPrograms] = choose_eager
    """The pair each segment runs, given the engine, the segment's update counter and a function reading the
    segment's first micro-batch ahead (an example a build compiles over; compiled programs:
    ``sink/programs/compiled_choice.py``)."""
    batches: Callable[[MicroBatchStream, float], Callable[[], Any]] | None = None
    """Per segment, given the stream and the segment's length, its next-micro-batch function (``None``: the
    stream's ``next``; staged data: ``StagedData.batches``, whose ``StagedBatch`` items the programs gather on the
    device themselves)."""
    progress: Callable[[], None] | None = None
    """Called after each step call (the progress bar, ``sink/progress.py``)."""


class SinkLoop:
    """Runs the sinks of one fit."""

    def __init__(
        self,
        engine: StepEngine,
        stream: MicroBatchStream,
        data_position: DataPosition,
        log_buffer: SinkLogBuffer | None,
        schedule: SinkSchedule,
        hooks: SinkLoopHooks = SinkLoopHooks(),
    ) -> None:
        """``hooks``: what the fit plugs in (``SinkLoopHooks``; by default no time limit, no recompile watch, the
        eager pair, the stream's ``next`` and no progress bar)."""
        self._engine = engine
        self._choose = hooks.choose  # the pair each sink runs (compiled programs: ``sink/programs/compiled_choice.py``)
        self._batches = hooks.batches
        self.stream = stream
        self._data_position, self._log_buffer, self._schedule = data_position, log_buffer, schedule
        self._sink_size = schedule.sink_size
        self._time_left, self._agree = hooks.max_time.time_left, hooks.max_time.agree
        self._recompile_watch = hooks.recompile_watch  # (graph modes: TorchDynamo compiles the step)
        self._progress = hooks.progress
        self.updates = self._sink_updates()
        self._ended_on_update = False  # the last segment's last micro-batch closed a window
        self.validation_pending = False  # Lightning decided to validate after the batch and has not zero-grad yet
        self.programs: SinkPrograms | None = None  # the last segment's
        self.validation_due = False  # the last segment ended where Lightning validates
        self.segment_complete = True  # the last segment trained all its micro-batches (max_steps, max_time cut one)
        self._pass_ended = False  # sink_size=-1: the last segment ended with its data pass
        self._read_ahead: deque[Any] = deque()  # read for a build's example, trained first (PASS_END kept in order)
        host = engine.host
        # Batches need moving unless the stream's thread already did, or they are for the CPU and no transfer hook
        # runs (a loader's batches are on the CPU already, and walking them would cost a step's worth of time).
        self._to_device = stream.copier is None and not (
            engine.hooks.direct_transfer and host.root_device.type == "cpu"
        )
        # Lightning's loop converted only the sink's placeholder; "16-true" and the like convert each real batch.
        self._converts_input = type(host.precision_plugin).convert_input is not Precision.convert_input

    def batch_started(self) -> None:
        """A Lightning batch (a segment) starts: no update yet (what Lightning's ``_should_accumulate`` is told)."""
        self.updates = self._sink_updates()
        self._ended_on_update = False

    def _sink_updates(self) -> SinkUpdates:
        buffer = self._log_buffer
        return SinkUpdates(self._engine, buffer.schedulers_stepped if buffer is not None else None)

    def made_no_update(self) -> bool:
        """Lightning's "does this batch accumulate?" (``_should_accumulate``): whether the segment made no update.
        Asked right after Lightning decided to validate, before it zero-grads for validation, the answer is instead
        whether the segment's last micro-batch left the window open, as Lightning answers for that micro-batch
        without sinking: an open window's partial sum follows zero-grad and must survive validation."""
        if self.validation_pending:
            self.validation_pending = False
            return not self._ended_on_update
        return self.updates.count == 0

    def decide_validation(self, decision: bool) -> bool:
        """Lightning's (or the schedule's) decision to validate after this batch, noted for ``made_no_update``."""
        self.validation_pending = decision
        return decision

    @property
    def sink_finished(self) -> bool:
        """Whether the sink in flight reached its planned end (the next segment starts a new sink)."""
        if self._sink_size == -1:
            return self._pass_ended
        return self._data_position.trained_in_sink >= self._sink_size

    def _next_segment(self) -> Segment:
        position, window = self._data_position, self._engine.window
        in_sink = 0 if self.sink_finished else position.trained_in_sink
        return self._schedule.next_segment(
            in_sink,
            position.trained_in_pass,
            position.pass_index,
            position.trained_total,
            window.micro_batches,
            self._engine.trainer.global_step,
        )

    def sink_continues(self) -> bool:
        """Asked when the Lightning batch (segment) about to run is taken from the loader: whether another segment
        of this sink follows it (Lightning reads one batch ahead to know the epoch's last)."""
        return not self._next_segment().ends_sink

    def run(self) -> dict[str, Tensor] | None:
        """One segment of a sink (one Lightning batch)."""
        output = self._logged_segment()
        if self._recompile_watch is not None and self.sink_finished:
            self._recompile_watch.sink_ended()  # (per sink, not per segment: it counts whole sinks' micro-batches)
        return output

    def _logged_segment(self) -> dict[str, Tensor] | None:
        buffer = self._log_buffer
        if buffer is None:
            return self._micro_batches()
        buffer.install()
        try:
            output = self._micro_batches()
            buffer.flush()
        finally:
            buffer.uninstall()
        return output

    def _micro_batches(self) -> dict[str, Tensor] | None:
        trainer = self._engine.trainer
        # the updates this segment may make before max_steps (global_step moves only through its updates)
        updates_allowed = trainer.max_steps - trainer.global_step if trainer.max_steps != -1 else -1
        segment, deadline, programs = self._begin_segment(updates_allowed)
        calls = _SegmentCalls(PairCall(programs, self._engine), programs.several, programs.partial_batch)
        length = segment.length
        next_batch = self.stream.next if self._batches is None else self._batches(self.stream, length)
        if self._read_ahead:
            next_batch = partial(self._after_read_ahead, next_batch)
        losses: list[Tensor] = []
        micro_index = 0
        # each turn: one call's micro-batches read and given to the call (several trained in one compiled call, or
        # one, trained by the pair), then each one's function and effects in order
        while micro_index < length:
            if updates_allowed != -1 and self.updates.count >= updates_allowed:
                break
            trained = self._next_call(calls, next_batch, length - micro_index, updates_allowed, micro_index)
            if trained is None:
                self._pass_ended = True
                break  # one data pass per sink: the pass ended
            if not trained:
                continue  # the pass ended before the sink's first micro-batch: the stream starts the next
            for batch, train in trained:
                loss = self._micro_step(batch, train)
                if loss is not None:
                    losses.append(loss)
                micro_index += 1
            if self._progress is not None:
                self._progress()
            if deadline is not None and self._out_of_time(deadline):
                # max_time: Lightning stops after this batch, as it would after this micro-batch; a call of several
                # is not cut, so the limit is overshot by at most one call
                break
        self._end_segment(segment, programs, complete=micro_index == length)
        if not losses:
            return None  # every micro-batch returned None: Lightning skips the batch, as for a None step
        stacked = torch.stack(losses)
        return {"loss": stacked[-1], "mean_loss": stacked.mean(), "losses": stacked}

    def _begin_segment(self, updates_allowed: int) -> tuple[Segment, float | None, SinkPrograms]:
        """The segment about to run, the ``max_time`` deadline (None: no limit; read before the programs are chosen,
        so a build counts against it), and the programs it runs."""
        segment = self._next_segment()
        if self.sink_finished:
            self._data_position.trained_in_sink = 0  # a new sink
        self._pass_ended = False
        self.validation_due = False
        seconds = self._time_left()
        deadline = time.monotonic() + seconds if seconds is not None else None
        programs = self._choose(self._engine, self.updates, self._read_example)
        if programs.build_pair is not None and self._trains_one_per_call(programs, segment.length, updates_allowed):
            programs = programs.build_pair()
        self.programs = programs
        self._engine.window.divide_losses_by(programs.update.loss_divisor)
        return segment, deadline, programs

    def _read_example(self) -> Any:
        """The segment's first micro-batch, read ahead and prepared, for the programs to be built over before
        they run it (the segment trains it first; a data pass's end read before it stays in its place)."""
        assert self._batches is None, "staged batches are gathered by the programs: a build needs no example"
        while True:
            batch = self.stream.next()
            if batch is PASS_END:
                self._read_ahead.append(batch)
                continue
            prepared = _ReadAhead(self._prepared(batch))
            self._read_ahead.append(prepared)
            return prepared.batch

    def _after_read_ahead(self, next_batch: Callable[[], Any]) -> Any:
        """The next micro-batch: those read ahead first, in order."""
        return self._read_ahead.popleft() if self._read_ahead else next_batch()

    def _next_call(
        self, calls: _SegmentCalls, next_batch: Callable[[], Any], left: float, updates_allowed: int, micro_index: int
    ) -> Sequence[tuple[Any, Callable[[], Tensor | None]]] | None:
        """The micro-batches of the next call, read and given to the call (several in one compiled call where they
        fit, else one, trained by the pair), each with the function that trains it or does its host effects. Empty:
        the data pass ended before the sink's first micro-batch; None: it ended inside a sink of one pass
        (``sink_size=-1``)."""
        updates_left = None if updates_allowed == -1 else updates_allowed - self.updates.count
        in_pass = self._data_position.trained_in_pass
        call, count = self._call_at(calls.several, left, updates_left, in_pass) or (calls.one, 1)
        if calls.partial_batch is not None and self._at_partial_batch(in_pass):
            call, count = calls.partial_batch, 1
        batches = []
        for _ in range(count):
            batch = next_batch()
            if batch is PASS_END:
                if count > 1:
                    raise RuntimeError(
                        f"The training loader ended its data pass after {self._data_position.trained_in_pass}"
                        f" batches, before its len() of {self._schedule.pass_length}: make len() match the batches"
                        " it yields, or use micro_steps_per_call=1."
                    )
                return None if self._sink_size == -1 and micro_index else ()
            batches.append(self._prepared(batch))
        first = self._data_position.trained_in_sink
        if count > 1 and not isinstance(batches[0], StagedBatch) and not stackable(batches):
            # a loader's batches of differing shapes (each padded to its longest sequence): a call for each
            return [(batch, run) for i, batch in enumerate(batches) for run in calls.one.run([batch], first + i)]
        return list(zip(batches, call.run(batches, first)))

    def _micro_step(self, batch: Any, train: Callable[[], Tensor | None]) -> Any:
        """One micro-batch's effects, in order: trained (or its call's host effects done), the data position
        advanced, and at a window's end the update's logged values handed on."""
        buffer, window = self._log_buffer, self._engine.window
        if buffer is not None:
            buffer.begin_micro_step(batch)
        ends = window.micro_batches + 1 >= self._engine.accumulation_steps
        loss = train()
        self._data_position.advance()
        self._ended_on_update = ends
        if ends and buffer is not None:
            buffer.end_update()  # the loggers get this update's values at its step (sink/logging.py)
        return loss

    def _end_segment(self, segment: Segment, programs: SinkPrograms, complete: bool) -> None:
        self.segment_complete = complete
        if complete:
            self.validation_due = segment.validates
            if self._sink_size == -1 and segment.ends_sink:
                self._pass_ended = True
        position = self._data_position
        position.sink_open = not self.sink_finished  # (saved: a resume continues an open sink in its epoch)
        if programs.end_sink is not None:
            programs.end_sink()  # the compiled programs' window sum into the store (checkpoints read it there)
        compat.set_logging_step(self._engine.trainer, updated=self.updates.count > 0)  # (the buffer writes steps)

    def _call_at(
        self, several: Sequence[SeveralSteps], left_in_segment: float, updates_left: int | None, trained_in_pass: int
    ) -> tuple[SeveralSteps, int] | None:
        """The first of ``several`` (longest first) to run the next micro-batches, and how many: within the room
        the segment (whose end is a point of the schedule: validation, a checkpoint, the sink's end), the data pass
        (whose end is read from the stream only after its last batch was trained; a partial last batch, of another
        shape than the call's, is trained apart) and ``max_steps`` (``updates_left``; None: no limit) leave, where
        the programs say the call is exact; None: no call of several fits."""
        whole = self._schedule.whole_in_pass
        if whole is None:
            return None
        room = min(left_in_segment, whole - trained_in_pass)
        if updates_left is not None:
            room = min(room, updates_left * self._engine.accumulation_steps)
        for call in several:
            count = call.length_within(int(room))
            if count and call.ready():
                return call, count
        return None

    def _trains_one_per_call(self, programs: SinkPrograms, length: float, updates_allowed: int) -> bool:
        """Whether the segment about to run will train any micro-batch one per call (by the pair): its calls counted
        ahead by ``_next_call``'s rule, before any runs (calls of several are whole windows: the window stays as it
        is between them). A ``max_time`` stop only makes fewer calls."""
        left, updates, in_pass = length, self.updates.count, self._data_position.trained_in_pass
        pass_length, steps = self._schedule.pass_length, self._engine.accumulation_steps
        while left > 0:
            if updates_allowed != -1 and updates >= updates_allowed:
                return False
            if pass_length is not None and in_pass >= pass_length:
                in_pass = 0  # (the stream reads the pass's end, and the next pass starts)
            updates_left = None if updates_allowed == -1 else updates_allowed - updates
            call = self._call_at(programs.several, left, updates_left, in_pass)
            if call is None and programs.partial_batch is not None and self._at_partial_batch(in_pass):
                if steps > 1 and left > 1:
                    return True  # (it leaves a window open: the micro-batches after it go one per call)
                call = programs.partial_batch, 1
            if call is None:
                return True
            count = call[1]
            left, updates, in_pass = left - count, updates + count // steps, in_pass + count
        return False

    def _at_partial_batch(self, trained_in_pass: int) -> bool:
        """Whether the next micro-batch is its data pass's partial last batch."""
        whole, length = self._schedule.whole_in_pass, self._schedule.pass_length
        return whole is not None and length is not None and trained_in_pass == whole < length

    def _prepared(self, batch: Any) -> Any:
        """The batch as the step gets it: converted by the precision plugin and on the device (a staged batch is
        gathered on the device by the program itself)."""
        if isinstance(batch, _ReadAhead):
            return batch.batch
        if isinstance(batch, StagedBatch):
            return batch
        if self._converts_input:
            batch = self._engine.host.precision_plugin.convert_input(batch)
        if self._to_device:
            batch = self._device_batch(batch)
        return batch

    def _out_of_time(self, deadline: float) -> bool:
        out = time.monotonic() >= deadline
        return out if self._agree is None else bool(self._agree(out))

    def _device_batch(self, batch: Any) -> Any:
        """The transfer hooks, as Lightning's loop runs them for each of its batches (``batch_to_device`` alone moves
        the batch when none is overridden)."""
        host = self._engine.host
        if not self._engine.hooks.direct_transfer:
            module = host.lightning_module
            assert module is not None
            batch = compat.before_batch_transfer(module, batch)
        return host.batch_to_device(batch)

    def close(self) -> None:
        self.stream.close()
