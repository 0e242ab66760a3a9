"""The two step programs of a gradient-accumulation window, each one compiled function over the whole step.

- **accumulate** (every micro-batch but a window's last): forward, backward, the gradients added into the window's
  fp32 buffers.
- **update** (a window's last micro-batch): forward and backward, the sum (across processes too, under DDP:
  ``RankSum``), division by the window's micro-step count, unscaling and the overflow check, clipping (norm or
  value), the optimizer update (or, on overflow, none: ``torch.where``, no host sync), the loss-scale update and the
  window reset.

Route: ``torch.func.grad_and_value`` over ``torch.func.functional_call`` of the module's ``training_step`` (one graph
for forward and backward; under mixed precision the forward inside the caller's ``AutocastRegion``, the backward
outside it, as a precision plugin's step runs), the optimizer's update written functionally (``optimizer_rules``), and
``torch.compile(fullgraph=True)`` over a function that takes every tensor it reads or writes as an argument: the
parameters, buffers, optimizer state, hyperparameters, window buffers and loss-scale state. Everything it changes
it writes back in place, so the module, the optimizer (``state_dict``, schedulers) and the ``LossScaler`` hold the
current values between calls.

The programs are compiled when built, on copies of that state with an example batch (random numbers restored), so
a ``training_step`` that cannot be one graph is refused before anything changed; with calls of several micro-steps
the loop alone, the one-micro-step pair when a micro-batch first needs it (``build_pair``). One object answers the
calls (``accumulate`` / ``update`` per micro-batch, ``run_several`` per call), the window's state in ``window``.

The parts, one module each: the programs' bodies as traced (``traced_programs.py``), one micro-batch's forward and
backward (``step_gradients.py``), the window's update (``window_update.py``), the window and the hyperparameter table
(``program_state.py``), the sum across processes (``rank_sum.py``), what a call returns (``program_results.py``), how
each is compiled (``program_compile.py``), ``build_step_programs``'s checks and assembly (``program_build.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_sink.compiled.autocast_region import AutocastRegion
from lightning_sink.compiled.cuda_graphs import CapturedProgram
from lightning_sink.compiled.device_dataset import DeviceDataset, SinkIndices
from lightning_sink.compiled.logged_values import LoggedValues
from lightning_sink.compiled.metric_calls import MetricCalls
from lightning_sink.compiled.program_compile import CompiledPrograms
from lightning_sink.compiled.program_results import ProgramUnavailable, StackedRows, StepOutputs
from lightning_sink.compiled.program_state import HyperTable, ProgramWindow, clone_tree, several_call
from lightning_sink.compiled.rank_sum import RankSum
from lightning_sink.compiled.scale_rule import scaler_tensors
from lightning_sink.compiled.step_gradients import StepGradients, untrained_tensors
from lightning_sink.compiled.traced_programs import TracedPrograms
from lightning_sink.compiled.window_update import WindowUpdate

__all__ = ["ProgramUnavailable", "RankSum", "StepOutputs", "StepPrograms", "ProgramWindow"]


# a program's name, the compiled program and how to make its batch argument from one example batch
_Program = tuple[str, Callable[..., Any], Callable[[Any], Any]]


def _several_name(count: int, lengths: tuple[int, ...]) -> str:
    """A call of several's program name (compile times, captured graphs): the longest is "several"."""
    return "several" if count == lengths[0] else f"several_{count}"


class StepPrograms:
    """The compiled accumulate and update programs of one module and optimizer (``build_step_programs``)."""

    def __init__(
        self,
        module: nn.Module,
        update: WindowUpdate,
        backend: str,
        data: tuple[DeviceDataset, SinkIndices] | None = None,
        several: tuple[int, int] | None = None,
        autocast: AutocastRegion | None = None,
    ) -> None:
        self.module, self.autocast = module, autocast
        self.rule, self.scaler, self.clip, self.rank_sum = update.rule, update.scaler, update.clip, update.rank_sum
        self.sink_indices = data[1] if data is not None else None
        self.logged = LoggedValues()
        self.metric_calls = MetricCalls(module)
        self.logged.metric_calls = self.metric_calls if self.metric_calls.metrics else None
        dataset = tuple(data[0].tensors) if data is not None else ()  # read only: never copied
        gradients = StepGradients(module, autocast, self.logged, self.metric_calls, dataset)
        self._traced = TracedPrograms(gradients, update, several)
        self.params = self.rule.params
        device = self.params[0].device
        self.window = ProgramWindow(
            [torch.zeros_like(param, dtype=torch.float32) for param in self.params],
            torch.zeros((), dtype=torch.float32, device=device),
        )
        self.batch_index = torch.zeros((), dtype=torch.int64, device=device)  # training_step's batch_idx
        self._hyper = HyperTable(self.rule)
        self._hyper.size(self._windows_per_call())
        self.hyper_table = self._hyper.tables  # (the list the state holds: resized and filled in place)
        self.call_note = ""  # why the calls are as long as they are, where the build chose it
        self._shorter: int | None = None  # a second, shorter call length (unroll(shorter=...))
        # what a micro-step of a call of several returns besides tensors (log options, Metric calls), the same at
        # every micro-step: a loop returns tensors only, so it is taken from one eager run before the first call
        self._side: dict[str, Any] | None = None
        # after a build of the loop alone: the pair still to build (``build_pair``), over a copy of its example batch
        self._pair_pending, self._pair_example = False, None
        self._state = self._initial_state(data)
        # a sum across processes traced into the programs: built without running them (no collective in the build)
        quiet = self.rank_sum is not None and self.rank_sum.group is not None
        self.compiled = CompiledPrograms(self._traced, backend, device, quiet)  # (its loop kept on disk: ``saved``)
        self.compile_seconds: dict[str, float] = {}
        self.captured: dict[str, CapturedProgram] = {}

    @property
    def several(self) -> tuple[int, int] | None:
        """Several micro-steps per call: (micro-steps of the longest call, accumulation steps), the call ending on
        an update; None: one micro-step per call."""
        return self._traced.several

    @property
    def call_lengths(self) -> tuple[int, ...]:
        """The micro-steps a call of several may run, longest first (each a compiled graph); () without."""
        if self.several is None:
            return ()
        return (self.several[0],) if self._shorter is None else (self.several[0], self._shorter)

    @property
    def any_shorter_call(self) -> bool:
        """Whether a call may also run any whole number of windows from two up to the longest call's: one graph of
        the loop serves them all (``CompiledPrograms.one_loop_graph``), a segment's rest included."""
        lengths, several = self.call_lengths, self.several
        return self.compiled.one_loop_graph and several is not None and lengths[0] >= 2 * several[1]

    def _windows_per_call(self) -> int:
        """The windows in one call of several (0 without)."""
        return self.several[0] // self.several[1] if self.several is not None else 0

    def _initial_state(self, data: tuple[DeviceDataset, SinkIndices] | None) -> dict[str, Any]:
        """Every tensor the programs read or write, passed to each call as its argument: the module's, the
        optimizer's and the scaler's own tensors (written back in place), the window, the hyperparameters."""
        states, hyper = self.rule.tensors()
        return {
            "params": [param.detach() for param in self.params],
            "buffers": [tensor.detach() for _, tensor in untrained_tensors(self.module)],
            "window": self.window.buffers,
            "micro_steps": self.window.micro_steps,
            "batch_index": self.batch_index,
            "scaler": scaler_tensors(self.scaler) if self.scaler is not None else None,
            "optimizer": states,
            "hyper": hyper,
            "hyper_table": self.hyper_table,
            "data": None if data is None else {"rows": data[1].rows, "cursor": data[1].cursor},
        }

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        metrics = self.metric_calls.installed_on() if self.metric_calls.metrics else contextlib.nullcontext()
        with self.logged.installed_on(self.module), metrics:
            yield

    def host_logs(self, out: StepOutputs) -> dict[str, Any]:
        """The micro-batch's ``self.log`` values as the host hands them on (``LoggedValues.host_logs``), in order."""
        return self.logged.host_logs(out, copy_calls=bool(self.captured))

    def _call(self, name: str, batch: Any) -> Any:
        captured = self.captured.get(name)
        if captured is not None:
            return captured(batch)
        with self._running():
            return (self.compiled.accumulate if name == "accumulate" else self.compiled.update)(self._state, batch)

    def accumulate(self, batch: Any = None) -> StepOutputs:
        """Run a micro-batch that does not end its window (``None``: the staged dataset's next one)."""
        self.build_pair()
        loss, values, side = self._call("accumulate", batch)
        return self.logged.step_outputs(loss, values, side)

    def update(self, batch: Any = None) -> StepOutputs:
        """Run a window's last micro-batch, then update (or skip, on overflow) and reset the window."""
        self.build_pair()
        changed = self.rule.changed_flags()
        if changed is not None:
            raise ProgramUnavailable(f"the update program no longer applies: {changed}")
        self.rule.refresh()
        if self._sums_eagerly():
            assert self.rank_sum is not None and self.rank_sum.all_reduce is not None  # (what _sums_eagerly says)
            with self._running():
                loss, values, side, flat = self.compiled.update_sum(self._state, batch)
                self.rank_sum.all_reduce(flat)
                found_inf = self.compiled.update_apply(self._state, flat)
        else:
            loss, values, side, found_inf = self._call("update", batch)
        self.rule.note_stepped()
        return self.logged.step_outputs(loss, values, side, found_inf)

    def run_several(
        self,
        batches: list[Any] | None = None,
        hyperparameters: list[list[list[float]]] | None = None,
        count: int | None = None,
    ) -> list[StepOutputs]:
        """Run whole windows from an empty one (no ``accumulate`` since the last ``update``), ``micro_steps_per_call``
        micro-batches (``None``: ``count`` from the staged dataset, by default the longest call; one of
        ``call_lengths``, or with ``any_shorter_call`` two windows or more up to the longest), in one call. ``hyperparameters``: per window, the values its update uses (per param
        group, one float per name of ``rule.names``: ``OptimizerRule.current_values`` rows); ``None``: every update
        uses the current ``param_groups``."""
        if self.several is None:
            raise ProgramUnavailable("built without micro_steps_per_call > 1: call accumulate/update instead")
        count = len(batches) if batches is not None else self.several[0] if count is None else count
        longest, window = self.several
        if count not in self.call_lengths and not (
            self.any_shorter_call and count % window == 0 and window < count < longest
        ):
            lengths = " or ".join(map(str, self.call_lengths))
            raise ValueError(f"run_several runs {lengths} micro-steps (or whole windows between); got {count}")
        changed = self.rule.changed_flags()
        if changed is not None:
            raise ProgramUnavailable(f"the update program no longer applies: {changed}")
        self.rule.refresh()
        self._hyper.fill(hyperparameters, count // self.several[1])
        if self._side is None:
            self._side = self.eager_run(batches[0] if batches is not None else None)[-1]
        call = self._several_call(count, batches)
        captured = self.captured.get(_several_name(count, self.call_lengths))
        if captured is not None:
            stacked = captured(call)
        else:
            with self._running():
                stacked = self.compiled.several(self._state, call)
        self.rule.note_stepped()
        # a window's positions, each stacked over the windows; the outputs in order, window by window
        positions = [StackedRows(output).micro_steps(self._side) for output in stacked]
        make = self.logged.step_outputs
        return [make(*arguments) for window in zip(*positions) for arguments in window]

    def unroll(self, micro_steps: int, accumulation_steps: int, shorter: int | None = None) -> None:
        """Before ``compile``: also build ``run_several`` over ``micro_steps`` micro-steps (whole windows of
        ``accumulation_steps``), and over ``shorter`` micro-steps too where given (a second compiled length)."""
        for name, value in (("micro_steps", micro_steps), ("shorter", shorter or micro_steps)):
            if value < 2 or value % accumulation_steps:
                raise ValueError(f"{name}={value} must be a multiple of accumulation_steps={accumulation_steps}")
        if shorter is not None and shorter >= micro_steps:
            raise ValueError(f"shorter={shorter} must be fewer than micro_steps={micro_steps}")
        if self.compile_seconds:
            raise ProgramUnavailable("unroll() comes before compile(): the programs are built already")
        self._traced.several = (micro_steps, accumulation_steps)
        self._shorter = shorter
        self._hyper.size(self._windows_per_call())

    @property
    def pair_built(self) -> bool:
        """Whether the accumulate and update programs (one micro-step per call) are compiled: with calls of several,
        ``compile`` leaves them to ``build_pair``, for the first micro-batch that needs them."""
        return bool(self.compile_seconds) and not self._pair_pending

    def drop_several(self, note: str) -> None:
        """Before the programs run: no calls of several after all (their loop did not build), one micro-step per
        call; ``note`` says why (``call_note``)."""
        for count in self.call_lengths:
            self.compile_seconds.pop(_several_name(count, self.call_lengths), None)
        # (the hyperparameter table keeps its size: the programs built already were traced with it)
        self._traced.several, self._shorter, self._side = None, None, None
        self.call_note = note

    def eager_run(self, example_batch: Any) -> Any:
        """The accumulate program run once eagerly on copies of the state (nothing of the run changes)."""
        with torch.random.fork_rng(devices=self._rng_devices), self._running():
            return self._traced.accumulate_program(clone_tree(self._state), clone_tree(example_batch))

    @property
    def _rng_devices(self) -> list[torch.device]:
        """The devices whose random state a run on copies of the state saves and restores besides the CPU's."""
        device = self.params[0].device
        return [device] if device.type == "cuda" else []

    def micro_step_flops(self, example_batch: Any) -> float:
        """The FLOPs of one micro-step's matrix multiplies and convolutions (forward and backward), counted in one
        eager run of the accumulate program (``eager_run``)."""
        with FlopCounterMode(display=False) as counter:
            self.eager_run(example_batch)
        return float(counter.get_total_flops())

    def step_seconds(self, example_batch: Any, accumulation_steps: int) -> tuple[float, float] | None:
        """Seconds of one micro-step with the programs' bodies run eagerly (plain PyTorch) and compiled, on one copy
        of the state (nothing of the run changes, random numbers included). Each program is timed as the faster of
        its second and third runs (the first warms the caches); a window's accumulates and update are averaged over
        its micro-steps, a call of several over its micro-steps (the shortest call: the longest may run a whole sink).
        None where a timed call alone is not the step: captured CUDA graphs, and a sum across processes (its
        collective)."""
        if self.captured or self.rank_sum is not None:
            return None
        devices = self._rng_devices
        state, batch = clone_tree(self._state), clone_tree(example_batch)

        def timed(program: Callable[..., Any], argument: Any) -> float:
            runs = []
            for _ in range(3):
                if state["data"] is not None:
                    state["data"]["cursor"].zero_()  # (each run reads its batches from the first row)
                start = time.perf_counter()
                program(state, argument)
                if devices:
                    torch.cuda.synchronize(devices[0])
                runs.append(time.perf_counter() - start)
            return min(runs[1:])

        traced, steps = self._traced, accumulation_steps
        with torch.random.fork_rng(devices=devices), self._running():
            eager = (
                (steps - 1) * timed(traced.accumulate_program, batch) + timed(traced.update_program, batch)
            ) / steps
            if self.several is not None:
                shortest = self.call_lengths[-1]  # (a call's run is the step's time: the longest would run a sink)
                compiled = timed(self.compiled.several, self._example_call(shortest, batch)) / shortest
            else:
                compiled = (
                    (steps - 1) * timed(self.compiled.accumulate, batch) + timed(self.compiled.update, batch)
                ) / steps
        return eager, compiled

    def _sums_eagerly(self) -> bool:
        """Whether the update runs as two compiled parts with an eager all-reduce between them."""
        return self.rank_sum is not None and self.rank_sum.all_reduce is not None

    def _pair_programs(self) -> list[_Program]:
        programs: list[_Program] = [("accumulate", self.compiled.accumulate, lambda example: example)]
        if self._sums_eagerly():
            size = sum(param.numel() for param in self.params)
            flat = torch.zeros(size, dtype=torch.float32, device=self.params[0].device)
            programs.append(("update_sum", self.compiled.update_sum, lambda example: example))
            programs.append(("update_apply", self.compiled.update_apply, lambda example: flat))
        else:
            programs.append(("update", self.compiled.update, lambda example: example))
        return programs

    def _several_programs(self) -> list[_Program]:
        """The calls of several to build, longest first; where calls of two windows or more share one graph
        (``CompiledPrograms.one_loop_graph``) and the shorter has two, the shorter alone (the longer, run on copies
        of the state, would take as long as a whole sink only to find its graph built)."""
        lengths = self.call_lengths
        accumulation = self.several[1] if self.several is not None else 1
        if self.compiled.one_loop_graph and len(lengths) == 2 and lengths[1] > accumulation:
            lengths = lengths[1:]
        return [
            (_several_name(count, self.call_lengths), self.compiled.several, partial(self._example_call, count))
            for count in lengths
        ]

    def _several_call(self, count: int, batches: list[Any] | None) -> dict[str, Any]:
        """A call of ``count`` micro-steps' input (``program_state.several_call``)."""
        accumulation = self._traced.several[1] if self._traced.several is not None else 1
        return several_call(self.hyper_table, count // accumulation, accumulation, batches)

    def _example_call(self, count: int, example: Any) -> dict[str, Any]:
        return self._several_call(count, None if example is None else [example] * count)  # (None: staged data)

    def compile(self, example_batch: Any) -> None:
        """Compile the programs now, on copies of the state (nothing of the run changes, random numbers included),
        timing each; with a sum across processes traced in, without running them. With calls of several, their loop
        alone: the accumulate and update programs of one micro-step are compiled when a micro-batch first needs
        them (``build_pair``), over a copy of ``example_batch`` kept until then."""
        if self.several is None:
            self._compile(self._pair_programs(), example_batch)
            return
        if self._side is None:
            self._side = self.eager_run(example_batch)[-1]
        self._compile(self._several_programs(), example_batch)
        self._pair_pending, self._pair_example = True, clone_tree(example_batch)

    def build_pair(self) -> float:
        """Compile the accumulate and update programs where ``compile`` left them for later; the seconds it took
        (0.0 where they are built)."""
        if not self._pair_pending:
            return 0.0
        start = time.perf_counter()
        self._compile(self._pair_programs(), self._pair_example)
        self._pair_pending, self._pair_example = False, None
        return time.perf_counter() - start

    def _compile(self, programs: list[_Program], example: Any) -> None:
        devices = self._rng_devices
        for name, program, batch_of in programs:
            start = time.perf_counter()
            state = clone_tree(self._state)
            if state["data"] is not None:
                state["data"]["cursor"].zero_()  # (staged: the copy reads its batch from the first row, always filled)
            with torch.random.fork_rng(devices=devices), self._running(), self.compiled.building():
                program(state, clone_tree(batch_of(example)))
            if devices:
                torch.cuda.synchronize(devices[0])
            self.compile_seconds[name] = time.perf_counter() - start

    def capture(self, example_batch: Any) -> None:
        """Capture the compiled programs as CUDA graphs (after ``compile``); later calls replay them."""
        self.build_pair()
        device = self.params[0].device
        for name, program, batch_of in self._pair_programs() + self._several_programs():
            start = time.perf_counter()
            with self._running():
                self.captured[name] = CapturedProgram(program, self._state, batch_of(example_batch), clone_tree, device)
            torch.cuda.synchronize(device)
            self.compile_seconds[f"{name}_capture"] = time.perf_counter() - start
