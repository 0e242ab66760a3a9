"""The step engine of a fit, put together at train start (``SinkFit.start``): the run checked, the ``EngineParts``
built from the strategy's ``WindowParts`` and the fit's settled settings, the strategy's ``backward`` pointed at the
engine for the fit and given back after it, and the loop rules Lightning follows without sinking (with sinking the
sink loop's own, ``sink/fit_wiring.py``). The engine itself is in ``engine.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.nn import Parameter

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import UPDATING_PARTIAL_WINDOWS
from lightning_sink.precision import LossScalePrecision
from lightning_sink.strategies.engine import EngineHost, EngineParts, StepEngine
from lightning_sink.strategies.fit_checks import UpdateMakeup, check_module_and_optimizer
from lightning_sink.strategies.graph_modes import check_graph_mode_device
from lightning_sink.strategies.hooks import HookPlan
from lightning_sink.training_passes import TrainingPasses
from lightning_sink.window import GradientStore, Reducer

__all__ = [
    "WindowParts",
    "EngineSettings",
    "assemble_engine",
    "bind_backward",
    "unbind_backward",
    "install_window_rules",
]

# How the module's training_step runs under a graph mode (``graph_modes.step_function``): given by the caller, so
# that the fit decides which compiler builds its step.
StepCompiler = Callable[[Callable[..., STEP_OUTPUT], str], Callable[..., STEP_OUTPUT]]


@dataclass(frozen=True)
class WindowParts:
    """What distinguishes the strategies: where a window's gradient sum lives and how the ranks combine it."""

    make_store: Callable[[list[Parameter]], GradientStore]
    reducer: Reducer
    ranks_in_sum: int  # ranks whose gradients the reduced sum adds up (1 where the reduction averages)


@dataclass(frozen=True)
class EngineSettings:
    """The fit's settings as settled against the Trainer (``SinkFit.configure_for_trainer``)."""

    accumulation_steps: int
    partial_window: str
    sink_size: int | None
    scheduled: bool  # a GradientAccumulationScheduler changes accumulation_steps during the fit
    graph_mode: str


def assemble_engine(
    host: EngineHost,
    trainer: pl.Trainer,
    parts: WindowParts,
    settings: EngineSettings,
    passes: TrainingPasses,
    compile_step: StepCompiler,
) -> StepEngine:
    """Check the run (one optimizer, what the module and optimizer allow) and build its engine."""
    module = trainer.lightning_module
    plugin = host.precision_plugin
    scaling = plugin if isinstance(plugin, LossScalePrecision) else None
    _check_run(host, module, settings, scaling)
    passthrough = (
        settings.sink_size is None
        and settings.accumulation_steps == 1
        and host.world_size == 1
        and scaling is None
        and not settings.scheduled
    )
    hooks = HookPlan.for_run(trainer)
    check_graph_mode_device(settings.graph_mode, host.root_device)
    kind = type(plugin)
    return StepEngine(
        EngineParts(
            host=host,
            trainer=trainer,
            make_store=parts.make_store,
            reducer=parts.reducer,
            ranks_in_sum=parts.ranks_in_sum,
            scaling=scaling,
            hooks=hooks,
            counters=compat.UpdateCounters(trainer),
            passes=passes,
            accumulation_steps=settings.accumulation_steps,
            partial_window=settings.partial_window,
            sink_size=settings.sink_size,
            step_function=compile_step(module.training_step, settings.graph_mode),
            # as Lightning builds the arguments: batch_idx only for a training_step that takes it
            step_takes_batch_idx=is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2),
            needs_step_context=not (
                kind.train_step_context is Precision.train_step_context
                and kind.forward_context is Precision.forward_context
            ),
            step_scheduler_configs=_step_scheduler_configs(trainer),
            passthrough=passthrough,
        )
    )


def _check_run(
    host: EngineHost, module: pl.LightningModule, settings: EngineSettings, scaling: LossScalePrecision | None
) -> None:
    optimizers = host.optimizers
    if len(optimizers) != 1:
        raise ValueError(f"{type(host).__name__} supports exactly one optimizer; got {len(optimizers)}.")
    update = UpdateMakeup(
        accumulation_steps=settings.accumulation_steps,
        sink_size=settings.sink_size,
        scheduled=settings.scheduled,
        world_size=host.world_size,
        loss_scaling=scaling is not None,
    )
    check_module_and_optimizer(type(host).__name__, module, optimizers[0], update)


def _step_scheduler_configs(trainer: pl.Trainer) -> list[Any]:
    """The step-interval LR schedulers, which the sink loop and an overflow-skipped update step themselves."""
    return [
        config for config in trainer.lr_scheduler_configs if config.interval == "step" and not config.reduce_on_plateau
    ]


def bind_backward(host: EngineHost, engine: StepEngine) -> None:
    """The strategy's side of a new engine: its ``backward`` for the fit, and the loss scale on its device."""
    scaling, passthrough = engine.scaling, engine.parts.passthrough
    if engine.hooks.direct_backward and not passthrough:
        # Nothing would run in Lightning's Strategy.backward but loss.backward() (no backward hooks, a plain
        # precision plugin; see HookPlan): this fit's backward is the engine's, skipping four hook dispatches per
        # micro-batch. An attribute of the strategy object, removed at fit end (not when someone replaced it).
        vars(host)["backward"] = engine.window_backward
    elif scaling is not None and scaling.skip_window_on_overflow and not passthrough:
        vars(host)["backward"] = engine.hooked_backward  # Lightning's, told when a window already overflowed
    if scaling is not None:
        scaling.to_device(host.root_device)


def unbind_backward(host: EngineHost, engine: StepEngine | None) -> None:
    """Give the strategy its own ``backward`` back, unless someone replaced the engine's since."""
    bound = vars(host).get("backward")
    if engine is not None and bound in (engine.window_backward, engine.hooked_backward):  # ours, not a wrapper
        del host.backward


def install_window_rules(trainer: pl.Trainer, engine: StepEngine, partial_window: str) -> None:
    """Without sinking, what Lightning's loop cannot see: which batches make no update (windows across epochs,
    ``"drop"``), and that the step schedulers hold on an update the loss scaling skipped."""
    holds = engine.scaling is not None and bool(engine.step_scheduler_configs)
    rules = compat.LoopOverrides(
        batch_has_no_update=None if partial_window in UPDATING_PARTIAL_WINDOWS else engine.batch_has_no_update,
        hold_step_schedulers=(lambda: engine.last_update_skipped) if holds else None,
    )
    compat.install_loop_overrides(trainer, rules)
