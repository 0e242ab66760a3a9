"""``graph_mode="compile"`` / ``"cuda_graph"`` in sink mode: each step program one compiled function over the whole
step (``lightning_sink.compiled``), behind the ``StepProgram`` seam of ``programs.py``.

``CompiledSteps`` is one fit's choice. At each sink's start ``choose`` hands the sink loop either the compiled pair
(``CompiledAccumulate`` / ``CompiledUpdate``) or, when the programs do not apply, the pair ``choose_programs`` picks
(today's path: with ``"compile"`` the forward-compiled ``training_step``). Whether they apply is decided once, at the
first micro-batch of the fit's first sink, before anything of the run changed: the run's own reasons (the
model-parallel strategy, "cuda_graph" under DDP, hooks that run between forward and update, a precision context other
than autocast) first, then ``build_step_programs``'s (the optimizer, the module's hook overrides and registered
hooks, a ``training_step`` that is not one graph). The fit logs one line either way: the programs compiled, or why
not and what to change.

With the training data staged on the device (``staged_data.py``) the programs are built at the first sink's start
instead (they need no example batch: they gather their own from the staged dataset), and ``choose`` tells the
staged data per sink whether the programs it returns gather (``StagedData.gathering``); a program given a
``StagedBatch`` runs without a batch argument.

What stays where it was:

- Parameters, buffers and the optimizer's state are the module's and the optimizer's own tensors, written in place;
  learning rates (and the other scheduled hyperparameters) enter as tensors refreshed before each update, so an
  ``interval="step"`` scheduler stepped by ``SinkUpdates`` changes values, never the compiled program.
- Lightning's counters, ``global_step``, the LR schedulers, the loss-scale bookkeeping (``last_update_skipped``, the
  logged ``loss_scale``/``overflow``/``skipped_updates``) move exactly as on the direct eager path (``SinkUpdates``).
- The open window: the programs keep its fp32 sum in their own buffers during a sink; the engine's ``Window``
  counts its micro-batches and backward passes on the host as the eager path does, and at each sink's end the sum is
  written into the window's store (which the checkpoint saves), and read back from it at the next sink's start (so
  a resume mid-window, or a window that runs on across sinks, continues exactly).
- ``self.log`` inside ``training_step``: the values come out of the program and are handed to ``self.log`` (during
  a sink, the log buffer of ``sink_logging.py``) after each call, with the options they were logged with.

With ``micro_steps_per_call=M`` (> 1) the programs also hold one compiled program of M micro-steps (whole windows,
``StepPrograms.run_several``), and ``CompiledSeveral`` runs M micro-batches per call where that is exact: at a
window's start, no ``interval="step"`` LR scheduler (its value may change between the call's updates, which read
the hyperparameters once), the accumulation the program was built for. After the call every micro-batch's host
effects are done in order, as the one-per-call pair does them (``SinkLoop`` asks the rest: segment, pass,
``max_steps`` and ``max_time``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import GradientAccumulator, SingleStepGradients, unique_trainable
from lightning_sink.compiled import (
    AutocastRegion,
    RankSum,
    StepOutputs,
    StepPrograms,
    Unavailable,
    build_step_programs,
)
from lightning_sink.strategies.engine import StepEngine
from lightning_sink.strategies.programs import SinkPrograms, SinkUpdates, choose_programs
from lightning_sink.strategies.staged_data import StagedBatch, StagedData
from lightning_sink.strategies.step_autocast import step_autocast
from lightning_sink.window import FlatAllReduce, NoGradients

__all__ = [
    "COMPILE_BACKEND",
    "CompiledSteps",
    "CompiledAccumulate",
    "CompiledUpdate",
    "CompiledSeveral",
    "compiled_choice",
]

# torch.compile's backend for the programs. "inductor" generates fused kernels (the point of compiling); the tests
# set "aot_eager" (the same graphs run by eager kernels, much faster to build) where compile time is not what they
# check.
COMPILE_BACKEND = "inductor"

# Under DDP, how the update program sums the window across the processes: "eager" (the update compiled as two parts,
# the reducer's one all-reduce of the flat bucket run eagerly between them) or "traced" (a functional all-reduce
# inside the one update program). "eager", because the two measured equal within their noise (benchmarks/compiled_ddp.py
# and its README section) and the eager route is the safer one: its build communicates nothing, so a rank whose build
# fails is caught by the ranks' agreement after the build (the traced build runs its all-reduce while compiling, and
# the other rank would wait in it), and its collective is the reducer's own public all_reduce, as the eager pair's.
DDP_SUM_ROUTE = "eager"

# Hooks that run between a micro-batch's forward and the window's update: a compiled program would not call them.
_CALLBACK_HOOKS_BETWEEN = ("on_before_backward", "on_after_backward", "on_before_zero_grad", "on_before_optimizer_step")
_MODULE_HOOKS_BETWEEN = _CALLBACK_HOOKS_BETWEEN + (
    "backward",
    "optimizer_zero_grad",
    "optimizer_step",
    "configure_gradient_clipping",
)


class CompiledSteps:
    """One fit's compiled step programs, built at the first micro-batch of its first sink (they need an example
    batch), or the reason there are none."""

    def __init__(
        self,
        engine: StepEngine,
        graph_mode: str,
        staging: StagedData | Unavailable | None = None,
        micro_steps_per_call: int = 1,
    ) -> None:
        self.engine = engine
        self.graph_mode = graph_mode
        # the training data staged on the device (then the programs are built at the first sink's start and gather
        # their own batches), or why it is not (said in the fit's line on the programs)
        self.staging = staging if isinstance(staging, StagedData) else None
        self._not_staged = staging.reason if isinstance(staging, Unavailable) else None
        self.micro_steps_per_call = micro_steps_per_call
        self.programs: StepPrograms | None = None
        self.reason: str | None = None  # why there are no programs (then the eager pair runs)
        self._trainable: tuple[int, ...] = ()  # the parameters the programs were built over
        self.autocast: AutocastRegion | None = None  # the precision plugin's autocast, built into the forward

    # ------------------------------------------------------------------ at each sink's start and end
    def choose(self, engine: StepEngine, updates: SinkUpdates) -> SinkPrograms:
        """The pair this sink runs (the sink loop's ``choose``)."""
        if self.staging is not None:
            self.staging.gathering = False  # until the compiled pair is returned
        if self.reason is None and self.programs is None:
            reason = self._run_reason()
            if reason is not None:
                self._fall_back(reason)
        if self.reason is not None:
            return choose_programs(engine, updates)
        if self.programs is None and self.staging is not None:
            if self.build(None) is None:  # staged: built now, before the sink takes its batches
                return choose_programs(engine, updates)
        elif self.programs is not None:
            reason = self._changed_since_build()
            if reason is not None:
                self._fall_back(reason)
                return choose_programs(engine, updates)
            self._load_window()
        if self.staging is not None:
            self.staging.gathering = True
        several = CompiledSeveral(self, updates) if self.micro_steps_per_call > 1 else None
        return SinkPrograms(
            CompiledAccumulate(self, updates),
            CompiledUpdate(self, updates),
            end_sink=self._save_window,
            several=several,
        )

    def _changed_since_build(self) -> str | None:
        """A reason the built programs no longer apply, found at a sink's start (a window may be open: its sum is in
        the store, which the eager pair continues from)."""
        assert self.programs is not None
        changed = self.programs.rule.changed_flags()
        if changed is not None:
            return f"{changed} after the programs were built"
        if self.engine.window.micro_batches == 0:
            self.engine.refresh_store()  # as the direct pair does at a sink's first window start
        if self._trainable_key() != self._trainable:
            return "the optimizer's trainable parameters changed (a parameter unfrozen or a param group added)"
        return None

    def _trainable_key(self) -> tuple[int, ...]:
        params = [p for group in self.engine.optimizer().param_groups for p in group["params"]]
        return tuple(sorted(id(p) for p in unique_trainable(params)))

    def _views(self) -> list[tuple[Tensor, Tensor]]:
        """Pairs (the store's view of a parameter's sum, the programs' buffer of it)."""
        assert self.programs is not None
        store = self.engine.window.store
        if not isinstance(store, GradientAccumulator):
            return []  # windows of one micro-step: never open at a sink's end
        buffers = {id(param): buffer for param, buffer in zip(self.programs.params, self.programs.window.buffers)}
        return [(view, buffers[id(param)]) for param, view in zip(store.params, store.views)]

    def _load_window(self) -> None:
        """The open window's sum, from the store (where a resume or the last sink left it), into the programs."""
        assert self.programs is not None
        store = self.engine.window.store
        if not store.micro_steps:
            return
        for view, buffer in self._views():
            buffer.copy_(view)
        self.programs.window.micro_steps.fill_(float(store.micro_steps))

    def _save_window(self) -> None:
        """At a sink's end: an open window's sum into the store, which the checkpoint saves."""
        if self.programs is None or not self.engine.window.store.micro_steps:
            return
        for view, buffer in self._views():
            view.copy_(buffer)

    # ------------------------------------------------------------------ the decision
    def _run_reason(self) -> str | None:
        """Why this run cannot use compiled programs, whatever its module and optimizer."""
        engine = self.engine
        host, trainer = engine.host, engine.trainer
        if host.world_size > 1 and not isinstance(engine.reducer, FlatAllReduce):
            return (
                f"{type(host).__name__} combines the ranks' gradients with {type(engine.reducer).__name__}, which"
                " the compiled programs do not do (the model-parallel strategy stays eager)"
            )
        if host.world_size > 1 and self.graph_mode == "cuda_graph":
            return "the CUDA-graph programs are for one process: use graph_mode='compile' under DDP"
        store = engine.window.store
        if isinstance(store, NoGradients):
            return "the optimizer holds no trainable parameter"
        if not isinstance(store, (GradientAccumulator, SingleStepGradients)):
            return (
                f"{type(host).__name__} keeps the window's gradients in {type(store).__name__} (sharded by the"
                " model-parallel strategy), which stays eager"
            )
        if engine.parts.needs_step_context:
            region = step_autocast(host.precision_plugin)  # mixed precision: built into the programs' forward
            if isinstance(region, str):
                return region
            self.autocast = region
        used = _hooks_between(trainer)
        if used:
            return (
                f"{', '.join(used)} overridden: a compiled program would not call it; move that work into"
                " training_step, remove the override, or use graph_mode='eager'"
            )
        if not (engine.hooks.direct_sink_step and engine.hooks.direct_before_step):
            return (
                "Lightning's hooks are dispatched here (a profiler records them, or Strategy.backward is wrapped):"
                " run without the profiler or the wrapper, or use graph_mode='eager'"
            )
        return None

    def build(self, batch: Any) -> StepPrograms | None:
        """At the fit's first micro-batch (with staged data, ``batch=None``: at its first sink's start): build the
        programs (compiling them now, on copies of the state), or fall back with the reason."""
        engine = self.engine
        trainer = engine.trainer
        module = trainer.lightning_module
        scaling = engine.scaling
        clip_val = trainer.gradient_clip_val or None
        algorithm = GradClipAlgorithmType(trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM).value
        start = time.perf_counter()
        several = self.micro_steps_per_call
        if several > 1 and several % engine.accumulation_steps:
            rank_zero_warn(
                f"micro_steps_per_call={several} is not a multiple of the fit's accumulation_steps="
                f"{engine.accumulation_steps} (a call runs whole windows): one micro-batch per call instead."
            )
            several = 1
        data = self.staging.data() if self.staging is not None else None
        if several > 1 and data is not None and data[1].capacity < several:
            rank_zero_warn(
                f"micro_steps_per_call={several} is more than the {data[1].capacity} micro-batches a sink stages"
                " (sink_size, or the data pass): one micro-batch per call instead."
            )
            several = 1
        built = build_step_programs(
            module,
            engine.optimizer(),
            batch,
            loss_scale=None if scaling is None else scaling.scaler,
            gradient_clip_val=clip_val,
            gradient_clip_algorithm=algorithm,
            backend=COMPILE_BACKEND,
            cuda_graph=self.graph_mode == "cuda_graph",
            autocast=self.autocast,
            rank_sum=self._rank_sum(),
            data=data,
            micro_steps_per_call=several,
            accumulation_steps=engine.accumulation_steps if several > 1 else 1,
        )
        if engine.host.world_size > 1:
            # every rank runs the same pair, or the ranks' all-reduces would not pair up
            built_everywhere = trainer.strategy.reduce_boolean_decision(not isinstance(built, Unavailable), all=True)
            if not built_everywhere and not isinstance(built, Unavailable):
                built.rule.discard_created()
                built = Unavailable("another process could not build its programs (its warning names the reason)")
        if isinstance(built, Unavailable):
            self._fall_back(built.reason)
            return None
        self.programs = built
        self._trainable = self._trainable_key()
        self._load_window()
        parts = [type(engine.optimizer()).__name__]
        if scaling is not None and scaling.scaler is not None:
            parts.append("loss scale")
        if clip_val is not None:
            parts.append(f"{algorithm} clipping")
        region = self.autocast
        where = "" if region is None else f"; the forward under autocast({region.device_type!r}, {region.dtype})"
        kind = "compiled and captured as CUDA graphs" if self.graph_mode == "cuda_graph" else "compiled"
        across = ""
        if built.rank_sum is not None:
            across = f", the window summed across {built.rank_sum.ranks} processes by one all-reduce"
        unrolled = f", and {several} micro-steps unrolled into one program" if several > 1 else ""
        rank_zero_info(
            f"{type(engine.host).__name__}(graph_mode={self.graph_mode!r}): the accumulate and update programs are"
            f" {kind} whole (forward, backward, accumulation, {', '.join(parts)} update{across}){unrolled} in"
            f" {time.perf_counter() - start:.1f} s{where}; {self._data_note()}"
        )
        return built

    def _rank_sum(self) -> RankSum | None:
        """Under DDP, the update's sum across the processes: the reducer's one flat all-reduce (``DDP_SUM_ROUTE``)."""
        reducer = self.engine.reducer
        if self.engine.host.world_size == 1 or not isinstance(reducer, FlatAllReduce):
            return None
        ranks = self.engine.window.ranks_in_sum
        if DDP_SUM_ROUTE == "traced":
            return RankSum(ranks, group=dist.group.WORLD)
        return RankSum(ranks, all_reduce=reducer.sum_flat)

    def _data_note(self) -> str:
        if self.staging is not None:
            return (
                f"each batch gathered on the device from the training set staged there"
                f" ({self.staging.staged_bytes / 2**20:.1f} MiB)"
            )
        if self._not_staged is not None:
            return f"batches read by the loader path (not staged on the device: {self._not_staged})"
        return "batches read by the loader path"

    def _fall_back(self, reason: str) -> None:
        self.reason = reason
        path = "the forward-compiled training_step" if self.graph_mode == "compile" else "the CUDA-graph forward"
        rank_zero_warn(
            f"{type(self.engine.host).__name__}(graph_mode={self.graph_mode!r}): no whole-step programs, {path}"
            f" runs instead (the eager step programs): {reason}."
        )


def _hooks_between(trainer: Any) -> list[str]:
    """The hooks between a micro-batch's forward and the window's update that this run overrides, named with who
    overrides them."""
    module = trainer.lightning_module
    found = [
        f"LightningModule.{name}" for name in _MODULE_HOOKS_BETWEEN if is_overridden(name, module, pl.LightningModule)
    ]
    for callback in compat.trainer_settings(trainer).callbacks:
        found += [
            f"{type(callback).__name__}.{name}"
            for name in _CALLBACK_HOOKS_BETWEEN
            if is_overridden(name, callback, pl.Callback)
        ]
    return found


class _Compiled:
    """What both compiled programs share: the window's host counts, the batch index, the log values, and the eager
    pair to hand over to when the programs turn out not to apply at the fit's first micro-batch."""

    loss_divisor = 1  # the programs add undivided gradients; the update divides by the window's micro-steps

    def __init__(self, steps: CompiledSteps, updates: SinkUpdates) -> None:
        self._steps, self._updates = steps, updates
        self._engine = steps.engine
        self._eager: SinkPrograms | None = None

    def _programs(self, batch: Any) -> StepPrograms | None:
        steps = self._steps
        if steps.programs is None and steps.reason is None:
            steps.build(batch)
        if steps.programs is None and self._eager is None:
            self._eager = choose_programs(self._engine, self._updates)
        return steps.programs

    def _open(self, programs: StepPrograms, batch_idx: int) -> None:
        """Count the micro-batch into its window, as the direct pair does."""
        engine = self._engine
        window = engine.window
        if window.micro_batches == 0:
            engine.counters.zero_grad()  # Lightning's zero-grad progress, as its loop counts it at a window start
        window.micro_batches += 1
        programs.batch_index.fill_(batch_idx)

    def _outputs(self, programs: StepPrograms, out: StepOutputs) -> Tensor:
        """The micro-batch's loss, its logged values handed to ``self.log``."""
        copy = self._steps.graph_mode == "cuda_graph"  # a replay overwrites the graph's outputs
        if out.logs:
            module = self._engine.trainer.lightning_module
            options = programs.logged.options
            for name, value in out.logs.items():
                module.log(name, value.clone() if copy else value, **options.get(name, {}))
        return out.loss.clone() if copy else out.loss


class CompiledAccumulate(_Compiled):
    def run(self, batch: Any, batch_idx: int) -> Tensor | None:
        programs = self._programs(batch)
        if programs is None:
            assert self._eager is not None
            return self._eager.accumulate.run(batch, batch_idx)
        self._open(programs, batch_idx)
        out = programs.accumulate(_own_batch(batch))
        self._engine.window.store.micro_steps += 1  # the backward passes of the window, counted on the host
        return self._outputs(programs, out)


class CompiledUpdate(_Compiled):
    def run(self, batch: Any, batch_idx: int) -> Tensor | None:
        programs = self._programs(batch)
        if programs is None:
            assert self._eager is not None
            return self._eager.update.run(batch, batch_idx)
        engine = self._engine
        self._open(programs, batch_idx)
        engine.window.micro_batches = 0
        result: list[Tensor] = []

        def update() -> None:
            out = programs.update(_own_batch(batch))
            if programs.rank_sum is not None:
                assert isinstance(engine.reducer, FlatAllReduce)  # (the only reducer programs are built for)
                engine.reducer.broadcast_module_buffers()  # as the eager pair does after its all-reduce
            result.append(self._outputs(programs, out))
            scaling = engine.scaling
            scaler = None if scaling is None else scaling.scaler
            # the schedulers hold after a skipped update: the one host read of the window's flag, as on the eager
            # path, and only where a step scheduler needs it
            engine.last_update_skipped = (
                bool(engine.step_scheduler_configs)
                and scaler is not None
                and scaler.skips_overflow
                and out.found_inf is not None
                and bool(out.found_inf.item())
            )
            if scaling is not None:
                engine.log_loss_scale(scaling, out.found_inf)
            engine.window.store.micro_steps = 0
            engine.window.end()

        self._updates.make(update)
        return result[0]


def _own_batch(batch: Any) -> Any:
    """What a program takes: ``None`` for a staged micro-batch (it gathers that batch itself), else the batch."""
    return None if isinstance(batch, StagedBatch) else batch


class CompiledSeveral(_Compiled):
    """``micro_steps_per_call`` micro-batches, whole windows, in one compiled call (``SeveralSteps``)."""

    def __init__(self, steps: CompiledSteps, updates: SinkUpdates) -> None:
        super().__init__(steps, updates)
        self.count = steps.micro_steps_per_call

    def ready(self) -> bool:
        programs, engine = self._steps.programs, self._engine
        return (
            programs is not None
            and programs.several is not None
            and programs.several[1] == engine.accumulation_steps  # (a GradientAccumulationScheduler may change it)
            and engine.window.micro_batches == 0
            and not engine.step_scheduler_configs
        )

    def run(self, batches: list[Any], batch_idx: int) -> list[Callable[[], Tensor | None]]:
        programs = self._steps.programs
        assert programs is not None and programs.several is not None  # (ready() said so)
        steps = programs.several[1]
        programs.batch_index.fill_(batch_idx)  # the programs count it on per micro-step
        outputs = programs.run_several([_own_batch(batch) for batch in batches])
        return [partial(self._finish, programs, out, (i + 1) % steps == 0) for i, out in enumerate(outputs)]

    def _finish(self, programs: StepPrograms, out: StepOutputs, ends: bool) -> Tensor:
        """One micro-batch's host effects after the call, as ``CompiledAccumulate`` / ``CompiledUpdate`` do them."""
        engine = self._engine
        window = engine.window
        if window.micro_batches == 0:
            engine.counters.zero_grad()
        window.micro_batches += 1
        if not ends:
            window.store.micro_steps += 1
            return self._outputs(programs, out)
        window.micro_batches = 0
        result: list[Tensor] = []

        def update() -> None:
            result.append(self._outputs(programs, out))
            engine.last_update_skipped = False  # (read only by step schedulers, which this path never has)
            scaling = engine.scaling
            if scaling is not None:
                engine.log_loss_scale(scaling, out.found_inf, out.scale, out.skipped)
            window.store.micro_steps = 0
            window.end()

        self._updates.make(update)
        return result[0]


def compiled_choice(
    engine: StepEngine,
    graph_mode: str,
    staging: StagedData | Unavailable | None = None,
    micro_steps_per_call: int = 1,
) -> Callable[[StepEngine, SinkUpdates], SinkPrograms]:
    """The sink loop's ``choose`` for ``graph_mode``: the compiled pair where it applies, else ``choose_programs``.
    ``staging``: the fit's staged training data (``staged_data.py``), or why there is none; ``micro_steps_per_call``:
    micro-batches per compiled call where that is exact (``CompiledSeveral``)."""
    if graph_mode == "eager":
        return choose_programs
    return CompiledSteps(engine, graph_mode, staging, micro_steps_per_call).choose
