"""Whether a run can use compiled step programs at all, whatever its module and optimizer: the reasons that belong
to the run (its strategy, its precision plugin, the hooks it overrides), decided at the fit's first segment before
``build_step_programs`` looks at the module and optimizer (``sink/programs/compiled_choice.py``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import GradientAccumulator, SingleStepGradients
from lightning_sink.compiled import AutocastRegion
from lightning_sink.strategies.engine import StepEngine
from lightning_sink.strategies.step_autocast import step_autocast
from lightning_sink.window import FlatAllReduce, NoGradients

__all__ = ["run_reason"]

# Hooks that run between a micro-batch's forward and the window's update: a compiled program would not call them.
_CALLBACK_HOOKS_BETWEEN = ("on_before_backward", "on_after_backward", "on_before_zero_grad", "on_before_optimizer_step")
_MODULE_HOOKS_BETWEEN = _CALLBACK_HOOKS_BETWEEN + (
    "backward",
    "optimizer_zero_grad",
    "optimizer_step",
    "configure_gradient_clipping",
)


def run_reason(engine: StepEngine, graph_mode: str) -> str | AutocastRegion | None:
    """Why this run cannot use compiled programs (one line, with what to change); else the precision plugin's
    autocast the programs' forward runs under (mixed precision), or None."""
    host, trainer = engine.host, engine.trainer
    if host.world_size > 1 and not isinstance(engine.reducer, FlatAllReduce):
        return (
            f"{type(host).__name__} combines the ranks' gradients with {type(engine.reducer).__name__}, which"
            " the compiled programs do not do (the model-parallel strategy stays eager)"
        )
    if host.world_size > 1 and graph_mode == "cuda_graph":
        return "the CUDA-graph programs are for one process: use graph_mode='compile' under DDP"
    store = engine.window.store
    if isinstance(store, NoGradients):
        return "the optimizer holds no trainable parameter"
    if not isinstance(store, (GradientAccumulator, SingleStepGradients)):
        return (
            f"{type(host).__name__} keeps the window's gradients in {type(store).__name__} (sharded by the"
            " model-parallel strategy), which stays eager"
        )
    region = step_autocast(host.precision_plugin) if engine.parts.needs_step_context else None
    if isinstance(region, str):
        return region
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
    return region


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
