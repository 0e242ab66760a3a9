"""A fit's sink loop wired into Lightning at train start (``SinkFit.start`` in sink mode): the micro-batch stream
over the user's loader (the training data staged on the device where it fits, ``staging.py``), the schedule of
segment ends (``schedule.py``), the progress bar counting micro-batches (``progress.py``), the programs each segment
runs (``programs/compiled_choice.py``), and the loop rules Lightning follows for sinks; all of it undone at fit end."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info

from lightning_sink import _lightning_compat as compat
from lightning_sink.compiled import Unavailable
from lightning_sink.data import DataPosition, whole_batches_in_pass
from lightning_sink.device_prefetch import CudaBatchCopier
from lightning_sink.sink.logging import SinkLogBuffer
from lightning_sink.sink.loop import MaxTimeRule, SinkLoop, SinkLoopHooks
from lightning_sink.sink.programs.build_survivors import BuildSurvivors
from lightning_sink.sink.programs.compiled_choice import compiled_choice
from lightning_sink.sink.progress import SinkProgress, epoch_micro_batches
from lightning_sink.sink.schedule import SchedulePoints, SinkSchedule
from lightning_sink.sink.staging import StagedData, StagingConditions, default_device_data_budget, plan_staging
from lightning_sink.sink.step_triggers import describe_sink_epoch, schedule_points
from lightning_sink.sink_data import MicroBatchStream, SinkLoader, default_prefetch_depth
from lightning_sink.strategies.engine import EngineHost, StepEngine
from lightning_sink.strategies.recompile_watch import RecompileWatch

__all__ = ["SinkSettings", "SinkWiring"]


@dataclass(frozen=True)
class SinkSettings:
    """The fit's settings the sink loop is wired from (``SinkFit`` holds them, settled against the Trainer)."""

    sink_size: int
    accumulation_steps: int
    graph_mode: str
    micro_steps_per_call: int | None
    prefetch_depth: int | None  # None: from the device and the loader (``default_prefetch_depth``)
    device_data_budget: int | None  # None: from the device (``default_device_data_budget``)
    val_check_interval: int | float | None  # the Trainer's own, which the sink schedule reads in its place


class SinkWiring:
    """One fit's sink loop and the progress bar it advances, held from ``wire`` to ``unwire``."""

    def __init__(self) -> None:
        self.loop: SinkLoop | None = None
        self._progress: SinkProgress | None = None  # the progress bar counts micro-batches
        self._survivors = BuildSurvivors()  # the compiled build's objects, out of full collections until unwire

    def wire(
        self,
        host: EngineHost,
        trainer: pl.Trainer,
        engine: StepEngine,
        sink_loader: SinkLoader,
        position: DataPosition,
        settings: SinkSettings,
    ) -> SinkLoop:
        """Build the sink loop over ``sink_loader``'s loader and install Lightning's loop rules for sinks."""
        loader, sink_size = sink_loader.loader, settings.sink_size
        _check_one_stream(type(host).__name__, sink_size, trainer)
        depth = _prefetch_depth(host, loader, settings)
        staging = _staging(host, engine, loader, position, settings, depth)
        staged = staging if isinstance(staging, StagedData) else None
        stream = MicroBatchStream(
            loader,
            position,
            depth,
            copier=_device_copier(host, engine, depth),
            read_pass=staged.read_pass if staged is not None else None,
        )
        watch = RecompileWatch(sink_size, settings.graph_mode) if settings.graph_mode != "eager" else None
        pass_length = sized_len(loader)
        position.sink_mode = True
        points = schedule_points(trainer, settings.val_check_interval, pass_length, sink_size)
        whole = whole_batches_in_pass(loader, pass_length)
        schedule = SinkSchedule(points, sink_size, settings.accumulation_steps, pass_length, whole)
        self._progress = SinkProgress.install(
            trainer, epoch_micro_batches(sink_size, pass_length), lambda: position.trained_in_sink
        )
        self.loop = loop = SinkLoop(
            engine,
            stream,
            position,
            SinkLogBuffer(trainer.lightning_module),
            schedule,
            SinkLoopHooks(
                max_time=_max_time_rule(host, trainer),
                recompile_watch=watch,
                choose=compiled_choice(
                    engine,
                    settings.graph_mode,
                    staging,
                    settings.micro_steps_per_call,
                    (sink_size if sink_size > 0 else pass_length, _budget(host, settings)),
                    self._survivors,
                ),
                batches=staged.batches if staged is not None else None,
                progress=self._progress.advance if self._progress is not None else None,
            ),
        )
        sink_loader.sink_continues = loop.sink_continues
        _install_loop_rules(trainer, loop, position, points)
        rank_zero_info(describe_sink_epoch(sink_size, settings.accumulation_steps, pass_length, trainer.max_epochs))
        return loop

    def unwire(self) -> None:
        """Give the progress bar its hooks back, close the loop (its stream's reading thread) and give the build's
        objects back to the collector; Lightning's loop rules are removed by whoever removes the fit's
        (``compat.remove_loop_overrides``)."""
        if self._progress is not None:
            self._progress.remove()
            self._progress = None
        if self.loop is not None:
            self.loop.close()
            self.loop = None
        self._survivors.release()


def _install_loop_rules(trainer: pl.Trainer, loop: SinkLoop, position: DataPosition, points: SchedulePoints) -> None:
    """Lightning's loop rules for sinks (``LoopOverrides.for_sinks``), validation deciding after each segment by
    the fit's schedule points where it has them, else by Lightning's own rule."""
    scheduled = None
    if points.validate_every_in_fit or points.validate_every_in_pass:
        scheduled = _validates_after_segment(trainer, loop, position, points.validate_every_n_passes)

    def validates(lightning_decides: Callable[[], bool]) -> bool:
        if scheduled is not None:
            return loop.decide_validation(scheduled())
        # Lightning validates at its epoch's end, or at an early stop: a sink that max_steps cut short read as the
        # epoch's last batch (Lightning read its end ahead), but the epoch did not end there
        cut = not loop.segment_complete and not loop.sink_finished and not trainer.should_stop
        return loop.decide_validation(lightning_decides() and not cut)

    overrides = compat.LoopOverrides.for_sinks(loop.made_no_update, lambda: loop.sink_finished, validates)
    compat.install_loop_overrides(trainer, overrides)
    # The loggers' step as Lightning's restart leaves it (the updates made): a checkpoint saved at a segment's end
    # holds it one behind after an update, which Lightning's restart adds back only for a batch it saw update.
    compat.set_logging_step(trainer, updated=False)


def _validates_after_segment(
    trainer: pl.Trainer, loop: SinkLoop, position: DataPosition, every_n_passes: int | None
) -> Callable[[], bool]:
    """Lightning's "validate after this batch?" for a step-based ``val_check_interval``: at the segment ends the
    schedule placed, and when the fit is told to stop (as Lightning validates before an early stop)."""

    def validates() -> bool:
        if not trainer.enable_validation:
            return False
        if loop.validation_due:
            return True
        in_validated_pass = every_n_passes is None or (position.pass_index + 1) % every_n_passes == 0
        return trainer.should_stop and compat.can_stop_early(trainer) and in_validated_pass

    return validates


def _max_time_rule(host: EngineHost, trainer: pl.Trainer) -> MaxTimeRule:
    """The Trainer's ``max_time`` as the loop reads it between calls."""
    return MaxTimeRule(
        time_left=lambda: compat.step_time_left(trainer),
        # Ranks reading their own clocks could end a segment at different micro-batches, and their updates'
        # collectives would then no longer pair up: rank 0's clock decides, as Lightning's Timer does.
        agree=host.broadcast if host.world_size > 1 else None,
    )


def _staging(
    host: EngineHost,
    engine: StepEngine,
    loader: Any,
    position: DataPosition,
    settings: SinkSettings,
    prefetch_depth: int,
) -> StagedData | Unavailable:
    """The training data staged on the device for the compiled programs (``staging.py``), or why not."""
    conditions = StagingConditions(
        graph_mode=settings.graph_mode,
        prefetch_depth=prefetch_depth,
        direct_transfer=engine.hooks.direct_transfer,
        converts_input=type(host.precision_plugin).convert_input is not Precision.convert_input,
    )
    return plan_staging(
        loader,
        conditions,
        budget=_budget(host, settings),
        position=position,
        device=host.root_device,
        sink_size=settings.sink_size,
    )


def _prefetch_depth(host: EngineHost, loader: Any, settings: SinkSettings) -> int:
    """``prefetch_depth``, or by default (``default_prefetch_depth``) from the device and the loader."""
    if settings.prefetch_depth is not None:
        return settings.prefetch_depth
    return default_prefetch_depth(host.root_device, loader)


def _device_copier(host: EngineHost, engine: StepEngine, prefetch_depth: int) -> CudaBatchCopier | None:
    """On CUDA, the prefetch thread copies batches to the GPU, unless transfer hooks must run in this thread."""
    device = host.root_device
    if device.type != "cuda" or not engine.hooks.direct_transfer or prefetch_depth == 0:
        return None
    return CudaBatchCopier(device)


def _budget(host: EngineHost, settings: SinkSettings) -> int:
    """The bytes of training data the fit may hold on its device (``device_data_budget``, else the device's
    default)."""
    budget = settings.device_data_budget
    return default_device_data_budget(host.root_device) if budget is None else budget


def _check_one_stream(strategy: str, sink_size: int, trainer: pl.Trainer) -> None:
    """A sink reads one endless stream of micro-batches, on through the passes of one loader."""
    loaders = compat.training_loader_count(trainer)
    if loaders > 1:
        raise ValueError(
            f"{strategy}(sink_size={sink_size}) trains from one training loader, but the fit has {loaders} (a dict or"
            " list of loaders, which Lightning combines): combine them into one DataLoader (a Dataset that returns"
            " both batches), or train without sink_size."
        )
    overfit = getattr(trainer, "overfit_batches", 0)  # (set by Lightning's debugging flags, untyped)
    if overfit:
        raise ValueError(
            f"Trainer(overfit_batches={overfit}) trains the same batches in every epoch, but"
            f" {strategy}(sink_size={sink_size}) reads on through the data from sink to sink: train without"
            " sink_size, or overfit a loader over a Subset of those batches."
        )
