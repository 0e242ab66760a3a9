"""``graph_mode="compile"`` / ``"cuda_graph"`` in sink mode: one fit's choice of step programs, each program one
compiled function over the whole step (``lightning_sink.compiled``), behind the ``MicroBatchProgram`` seam of
``sink/programs/eager.py``; the per-call programs the sink loop runs are ``sink/programs/compiled.py``'s.

``CompiledProgramChooser`` is one fit's choice. At each segment's start ``choose`` hands the sink loop either the
compiled pair (``CompiledAccumulate`` / ``CompiledUpdate``) or, when the programs do not apply, the pair
``choose_programs`` picks (with ``"compile"`` the forward-compiled ``training_step``). Whether they apply is decided
once, at the fit's first segment, before anything of the run changed: the run's own reasons (the model-parallel
strategy, "cuda_graph" under DDP, hooks that run between forward and update, a precision context other than
autocast) first, then ``build_step_programs``'s (the optimizer, the module's hook overrides and registered hooks, a
``training_step`` that is not one graph or depends on host state). The programs are built then, over the segment's
first micro-batch, which the loop reads ahead and trains first (a program never builds). The fit logs one line either
way: the programs compiled, or why not and what to change. Later segments check they still apply (the optimizer's
flags and trainable parameters, and a step TorchDynamo compiled again and again for a changing Python value).

With staged training data (``sink/staging.py``) the build needs no example batch, and ``choose`` tells the staged
data per sink whether its programs gather (``StagedData.gathering``). The open window across sinks: its fp32 sum is
in the programs' buffers during a sink, in the window's store between sinks (``sink/programs/window_handover.py``).

With ``micro_steps_per_call=M`` (> 1) the programs are built with one compiled program of M micro-steps as well
(whole windows, ``StepPrograms.run_several``) where M is a multiple of the accumulation (and, staged, no more than a
sink stages), and ``choose`` adds a ``CompiledSeveral`` per call length to the pair (longest first, the longest also
a rest of two windows or more where one graph serves them; each steps the fit's step schedulers through its call's
updates first: ``SchedulerSteps``). With ``None`` (the default) the build decides M from the step's size, with a
second call as long as a staged sink (``compiled/call_length.py``), under DDP too (every process the same lengths,
agreed after the build); for CUDA graphs it is 1. With calls of several the build compiles their loop alone: the
returned programs carry ``build_pair`` until the one-micro-step pair is built, which the sink loop calls at the first
segment training a micro-batch one per call (``_with_pair``: built, agreed across processes, or the eager pair).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_sink._lightning_compat import trainer_reads
from lightning_sink._torch_compat import inductor_cache_counts, most_recompiled, recompile_limit
from lightning_sink.compiled import (
    AutocastRegion,
    ProgramSettings,
    RankSum,
    StepPrograms,
    Unavailable,
    build_step_programs,
)
from lightning_sink.compiled.build_record import BuildFigures
from lightning_sink.compiled.call_length import loader_call
from lightning_sink.compiled.program_build import error_line
from lightning_sink.sink.programs.build_agreement import agreed_build
from lightning_sink.sink.programs.build_assumptions import BuildAssumptions, clip_settings
from lightning_sink.sink.programs.build_notice import BuildNotice, cache_note, data_note, length_note, step_times
from lightning_sink.sink.programs.build_survivors import BuildSurvivors
from lightning_sink.sink.programs.compiled import CompiledAccumulate, CompiledSeveral, CompiledUpdate
from lightning_sink.sink.programs.eager import SinkPrograms, SinkUpdates, choose_eager, choose_programs
from lightning_sink.sink.programs.partial_batch import PartialBatchCall
from lightning_sink.sink.programs.run_reason import run_reason
from lightning_sink.sink.programs.scheduler_steps import SchedulerSteps
from lightning_sink.sink.programs.window_handover import WindowHandover
from lightning_sink.sink.staging import StagedData
from lightning_sink.strategies.engine import StepEngine
from lightning_sink.window import FlatAllReduce

__all__ = [
    "COMPILE_BACKEND",
    "DDP_SUM_ROUTE",
    "CompiledProgramChooser",
    "compiled_choice",
]

# torch.compile's backend for the programs: "inductor" generates fused kernels (the point of compiling); the tests
# set "aot_eager" (eager kernels, much faster to build) where compile time is not what they check.
COMPILE_BACKEND = "inductor"

# Under DDP, how the update program of one micro-step per call sums the window across the processes: "eager" (the
# update compiled as two parts, the reducer's one all-reduce of the flat bucket run eagerly between them) or "traced"
# (a functional all-reduce inside the one update program). "eager", because the two measured equal within their noise
# (benchmarks/compiled_ddp.py and its README section) and its collective is the reducer's own public all_reduce, as
# the eager pair's. A call of several micro-steps, and a build that chooses the call's length, trace it (the loop's
# updates all run inside one call); such programs are built without running (``BuildWithoutRunning``), so no build
# communicates and the processes agree on what they built afterwards (``build_agreement.py``).
DDP_SUM_ROUTE = "eager"


# Rebuilds for changed Python values before the hand-over (a value annealed per sink: else a build per sink)
REBUILDS_BEFORE_HANDOVER = 2


class CompiledProgramChooser:
    """One fit's compiled step programs, built at its first segment's start over the segment's first micro-batch
    (read ahead by the loop), or the reason there are none."""

    def __init__(
        self,
        engine: StepEngine,
        graph_mode: str,
        staging: StagedData | Unavailable | None = None,
        micro_steps_per_call: int | None = None,
        loader_limit: tuple[int | None, int] = (None, 0),
        survivors: BuildSurvivors | None = None,
    ) -> None:
        """``loader_limit``: from a loader, the sink's micro-batches (None: unknown) and the device-data budget in
        bytes, which bound a call longer than the default's (``call_length.loader_call``); ``survivors``: what
        keeps the build's objects out of later full collections until the fit's end (the fit releases it)."""
        self.engine, self.graph_mode = engine, graph_mode
        self._survivors = survivors if survivors is not None else BuildSurvivors()
        # the training data staged on the device (then the programs are built at the first sink's start and gather
        # their own batches), or why it is not (said in the fit's line on the programs)
        self.staging = staging if isinstance(staging, StagedData) else None
        self._not_staged = staging.reason if isinstance(staging, Unavailable) else None
        self.micro_steps_per_call, self._loader_limit = micro_steps_per_call, loader_limit
        self.programs: StepPrograms | None = None
        self._handover: WindowHandover | None = None  # the open window's sum between the store and the programs
        self._pair_agreed = False  # the one-micro-step pair known built on every process (until then: _with_pair)
        self.reason: str | None = None  # why there are no programs (then the eager pair runs)
        self._assumed: BuildAssumptions | None = None  # what the programs took as fixed
        self.autocast: AutocastRegion | None = None  # the precision plugin's autocast, built into the forward
        self.notice = BuildNotice(engine, graph_mode, self._build_settings())

    def _build_settings(self) -> dict[str, Any]:
        """What besides the module and optimizer decides the build (and so how long it takes)."""
        engine = self.engine
        return {
            "graph_mode": self.graph_mode,
            "backend": COMPILE_BACKEND,
            "accumulation_steps": engine.accumulation_steps,
            "micro_steps_per_call": self.micro_steps_per_call,
            "processes": engine.host.world_size,
            "staged": self.staging is not None,
            "precision": type(engine.host.precision_plugin).__name__,
            "device": str(engine.host.root_device.type),
        }

    # ------------------------------------------------------------------ at each sink's start and end
    def choose(self, engine: StepEngine, updates: SinkUpdates, example: Callable[[], Any]) -> SinkPrograms:
        """The pair this segment runs (the sink loop's ``choose``); ``example`` reads the segment's first
        micro-batch ahead, for the fit's first build on the loader path (staged, the build needs none)."""
        if self.staging is not None:
            self.staging.gathering = False  # until the compiled pair is returned
        if self.reason is None and self.programs is None:
            reason = run_reason(self.engine, self.graph_mode)
            if isinstance(reason, AutocastRegion):
                self.autocast = reason  # mixed precision: built into the programs' forward
            elif reason is not None:
                self._fall_back(reason)
        if self.reason is not None:
            return choose_programs(engine, updates)
        if self.programs is None:
            if self.build(None if self.staging is not None else example()) is None:
                return choose_programs(engine, updates)
        else:
            changed = self._changed_since_build()
            if changed is not None:
                self._fall_back(changed.reason, changed.host_state)
                return choose_programs(engine, updates)
            assert self._handover is not None
            self._handover.into_programs()
        programs, handover = self.programs, self._handover
        assert programs is not None and handover is not None
        if self.staging is not None:
            self.staging.gathering = True
        copy_outputs = self.graph_mode == "cuda_graph"  # a replay overwrites the graph's outputs
        schedulers = SchedulerSteps(engine)
        several = tuple(
            CompiledSeveral(programs, engine, updates, copy_outputs, count, schedulers)
            for count in programs.call_lengths
        )
        compiled = SinkPrograms(
            CompiledAccumulate(programs, engine, updates, copy_outputs),
            CompiledUpdate(programs, engine, updates, copy_outputs),
            end_sink=handover.into_store,
            several=several,
            # (a loss scale's state is the programs' own during a sink: its partial batches stay compiled)
            partial_batch=PartialBatchCall(engine, updates, handover) if engine.scaling is None else None,
        )
        if self._pair_agreed:
            return compiled
        return replace(compiled, build_pair=partial(self._with_pair, engine, updates, compiled))

    def _with_pair(self, engine: StepEngine, updates: SinkUpdates, compiled: SinkPrograms) -> SinkPrograms:
        """The first segment that trains a micro-batch one per call (a segment's rest too short for a call, a
        window left open): the accumulate and update programs built now (the fit's build compiled the loop alone) and,
        across processes, agreed built everywhere; where they do not build, the eager pair from here on (the
        window's sum is in the store still: the programs' buffers hold a copy)."""
        assert self.programs is not None
        self._pair_agreed = True
        failure = None
        try:
            seconds = self.programs.build_pair()
        except Exception as error:  # (the loop over the same step built: not expected, but never a crash)
            seconds, failure = 0.0, error_line(error)
        if engine.host.world_size > 1:  # (every process reaches this segment: the same calls everywhere)
            everywhere = engine.trainer.strategy.reduce_boolean_decision(failure is None, all=True)
            failure = failure or (None if everywhere else "another process could not build them (its warning says why)")
        if failure is not None:
            if self.staging is not None:
                self.staging.gathering = False
            self._fall_back(f"the accumulate and update programs of one micro-step did not build ({failure})")
            return choose_programs(engine, updates)
        if seconds:
            rank_zero_info(
                f"{type(engine.host).__name__}(graph_mode={self.graph_mode!r}): the accumulate and update programs"
                f" of one micro-step compiled in {seconds:.1f} s, for micro-batches a call of several cannot take"
                " (a segment's rest too short for a call: a schedule point, max_steps, a pass's end; or a window"
                " left open)"
            )
        return compiled

    def _changed_since_build(self) -> Unavailable | None:
        """A reason the built programs no longer apply, found at a sink's start (a window may be open: its sum is in
        the store, which the eager pair continues from)."""
        assert self.programs is not None
        rule, engine = self.programs.rule, self.engine
        changed = rule.changed_flags() or rule.lost_state()
        if changed is not None:
            return Unavailable(f"{changed} after the programs were built")
        if engine.window.micro_batches == 0:
            engine.refresh_store()  # as the direct pair does at a sink's first window start
        assert self._assumed is not None
        changed = self._assumed.changed(
            engine.trainer.lightning_module, engine.optimizer(), clip_settings(engine.trainer)
        )
        if changed is not None:
            return Unavailable(changed)
        # a Python value the step reads that a hook changes makes TorchDynamo compile again (exact, a build each time)
        again = most_recompiled(self.programs.compiled.codes)
        if again is None or again.versions < min(recompile_limit() - 1, REBUILDS_BEFORE_HANDOVER + 1):
            return None
        return Unavailable(
            f"TorchDynamo compiled the programs again {again.versions - 1} times for a Python value that changed"
            f" ({again.last_guard_failure}); keep such a value in a tensor buffer of the module to keep them",
            host_state=True,
        )

    # ------------------------------------------------------------------ the decision
    def build(self, batch: Any) -> StepPrograms | None:
        """At the fit's first segment, over its first micro-batch (with staged data, ``batch=None``): build the
        programs (compiling them now, on copies of the state), or fall back with the reason."""
        engine = self.engine
        trainer = engine.trainer
        scaling = engine.scaling
        clip_val, algorithm = clip_settings(trainer)
        start, cache_before = time.perf_counter(), inductor_cache_counts()
        data = self.staging.data() if self.staging is not None else None
        several, not_scheduled = self._call_length(data)
        with self._survivors.around_build():  # (the build's objects kept out of full collections for the fit)
            built = self._built(batch, data, several, clip_val, algorithm)
        if isinstance(built, Unavailable):
            self._fall_back(built.reason, built.host_state)
            return None
        self.programs = built
        # (under DDP agreed at the first segment that needs the pair, whatever this process built)
        self._pair_agreed = built.pair_built and engine.host.world_size == 1
        self._assumed = BuildAssumptions(trainer.lightning_module, engine.optimizer(), (clip_val, algorithm))
        self._handover = WindowHandover(built, engine.window)
        self._handover.into_programs()
        parts = [type(engine.optimizer()).__name__]
        if scaling is not None and scaling.scaler is not None:
            parts.append("loss scale")
        if clip_val is not None:
            parts.append(f"{algorithm} clipping")
        seconds = time.perf_counter() - start
        saved = built.compiled.saved
        eager, compiled = built.step_seconds(batch, engine.accumulation_steps) or (None, None)
        figures = BuildFigures(seconds, eager, compiled, loop_kept=saved is not None and saved.kept)
        cached = cache_note(cache_before, inductor_cache_counts())
        took = f"{seconds:.1f} s{saved.note if saved is not None else ''}{cached}{step_times(figures)}"
        rank_zero_info(
            self._build_line(built, parts, length_note(built, several, not_scheduled, self.micro_steps_per_call), took)
        )
        self.notice.after_build(figures)
        return built

    def _built(
        self, batch: Any, data: Any, several: int | None, clip_val: float | None, algorithm: str
    ) -> StepPrograms | Unavailable:
        """The programs built with the fit's settings (under DDP, agreed built by every process)."""
        engine = self.engine
        trainer, scaling = engine.trainer, engine.scaling
        built = build_step_programs(
            trainer.lightning_module,
            engine.optimizer(),
            batch,
            ProgramSettings(
                loss_scale=None if scaling is None else scaling.scaler,
                gradient_clip_val=clip_val,
                gradient_clip_algorithm=algorithm,
                backend=COMPILE_BACKEND,
                cuda_graph=self.graph_mode == "cuda_graph",
                autocast=self.autocast,
                rank_sum=self._rank_sum(several),
                data=data,
                micro_steps_per_call=several,
                accumulation_steps=engine.accumulation_steps if several != 1 else 1,
                loader_call=None if data is not None else loader_call(batch, *self._loader_limit),
                trainer_reads=partial(trainer_reads, trainer.lightning_module),
            ),
        )
        return agreed_build(trainer.strategy, built) if engine.host.world_size > 1 else built

    def _call_length(self, data: Any) -> tuple[int | None, str | None]:
        """The micro-steps per compiled call to build (None: the build decides from the step's size), and why a
        step scheduler keeps the calls at one micro-step, where one does."""
        engine = self.engine
        several = self.micro_steps_per_call
        if several is None and self.graph_mode == "cuda_graph":
            several = 1  # (a loop of several captured as one graph has not run on a GPU: benchmarks/README.md)
        if several is not None and several > 1 and several % engine.accumulation_steps:
            rank_zero_warn(
                f"micro_steps_per_call={several} is not a multiple of the fit's accumulation_steps="
                f"{engine.accumulation_steps} (a call runs whole windows): one micro-batch per call instead."
            )
            several = 1
        not_scheduled = SchedulerSteps(engine).reason() if several != 1 else None
        if not_scheduled is not None:
            if several is not None:  # (asked for: a warning; chosen by default: the fit's line says why)
                rank_zero_warn(
                    f"micro_steps_per_call={several}: one micro-batch per call instead, because {not_scheduled}."
                )
            several = 1
        if several is not None and several > 1 and data is not None and data[1].capacity < several:
            rank_zero_warn(
                f"micro_steps_per_call={several} is more than the {data[1].capacity} micro-batches a sink stages"
                " (sink_size, or the data pass): one micro-batch per call instead."
            )
            several = 1
        return several, not_scheduled

    def _build_line(self, built: StepPrograms, parts: list[str], length: str, took: str) -> str:
        region = self.autocast
        where = "" if region is None else f"; the forward under autocast({region.device_type!r}, {region.dtype})"
        kind = "compiled and captured as CUDA graphs" if self.graph_mode == "cuda_graph" else "compiled"
        programs = "accumulate and update programs are" if built.pair_built else "step programs are"
        # (the loop alone: a fit whose segments all take calls of several never builds the pair)
        later = (
            ""
            if built.pair_built
            else "; the accumulate and update programs of one micro-step compile when first needed"
        )
        across = ""
        if built.rank_sum is not None:
            across = f", the window summed across {built.rank_sum.ranks} processes by one all-reduce"
        return (
            f"{type(self.engine.host).__name__}(graph_mode={self.graph_mode!r}): the {programs} {kind} whole"
            f" (forward, backward, accumulation, {', '.join(parts)} update{across}){length} in {took}{where}{later};"
            f" {data_note(self.staging, self._not_staged)}"
        )

    def _rank_sum(self, several: int | None) -> RankSum | None:
        """Under DDP, the update's sum across the processes: the reducer's one flat all-reduce (``DDP_SUM_ROUTE``);
        traced into the program with ``several`` micro-steps per call, whose updates all run inside one call."""
        reducer = self.engine.reducer
        if self.engine.host.world_size == 1 or not isinstance(reducer, FlatAllReduce):
            return None
        ranks = self.engine.window.ranks_in_sum
        if DDP_SUM_ROUTE == "traced" or several is None or several > 1:
            return RankSum(ranks, group=dist.group.WORLD)
        return RankSum(ranks, all_reduce=reducer.sum_flat)

    def _fall_back(self, reason: str, host_state: bool = False) -> None:
        """No programs from here on: the eager pair runs the graph mode's compiled forward, or, for a step that
        reads Python state the host changes (``host_state``), the module's own ``training_step``, which a compiled
        forward would compile again for at each new value, up to TorchDynamo's limit."""
        self.reason = reason
        if host_state:
            self.engine.swap_step_function()
            path = "the module's own training_step, uncompiled,"
        elif self.graph_mode == "compile":
            path = "the forward-compiled training_step"
        else:
            path = "the CUDA-graph forward"
        rank_zero_warn(
            f"{type(self.engine.host).__name__}(graph_mode={self.graph_mode!r}): no whole-step programs, {path}"
            f" runs instead (the eager step programs): {reason}."
        )


def compiled_choice(
    engine: StepEngine,
    graph_mode: str,
    staging: StagedData | Unavailable | None = None,
    micro_steps_per_call: int | None = None,
    loader_limit: tuple[int | None, int] = (None, 0),
    survivors: BuildSurvivors | None = None,
) -> Callable[[StepEngine, SinkUpdates, Callable[[], Any]], SinkPrograms]:
    """The sink loop's ``choose`` for ``graph_mode``: the compiled pair where it applies, else ``choose_programs``.
    ``staging``: the fit's staged training data (``sink/staging.py``), or why there is none; ``micro_steps_per_call``:
    micro-batches per compiled call where that is exact (``CompiledSeveral``; ``None``: decided by the build);
    ``loader_limit``: what bounds a longer call from a loader, ``survivors``: what the build leaves kept out of full
    collections (``CompiledProgramChooser``)."""
    if graph_mode == "eager":
        return choose_eager
    chooser = CompiledProgramChooser(engine, graph_mode, staging, micro_steps_per_call, loader_limit, survivors)
    chooser.notice.at_fit_start()
    return chooser.choose
