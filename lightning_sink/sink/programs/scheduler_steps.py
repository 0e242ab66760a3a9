"""The hyperparameters of each update inside one compiled call of several windows (``CompiledSeveral``): before the
call, the fit's ``interval="step"`` LR schedulers are stepped through the call's updates by the step that
``SinkUpdates`` takes after each update with one call per micro-batch, and each update's values are read from
``param_groups`` on the way; the call's updates then leave the schedulers alone (``SinkUpdates.make`` is told so).

Why stepped once, before the call: the program needs every update's values as inputs, and the schedulers' state
after the call, ``lr_scheduler_configs`` and the values ``param_groups`` hold are then those of one call per
micro-batch, reached by the same ``step()`` calls in the same order (at the same ``global_step`` for a
``frequency``). Nothing between the updates of one call reads them (its micro-batches run no user hook) but the
``LearningRateMonitor`` replay of the sink's log buffer, which is handed the settings each update left as they are
stepped through (``SinkUpdates.schedulers_stepped``). Any scheduler works this way (LambdaLR, OneCycleLR with
its momentum cycle, chained and sequential schedulers, ``frequency > 1``, several configs) as long as stepping it
depends on nothing the call computes:

- a loss scale that skips overflowing updates: the schedulers hold after a skipped update, which is known on the
  device only after the call;
- a ``lr_scheduler_step`` override: the module's hook may do anything at each step, so it runs only once, at its
  update (``ReduceLROnPlateau`` and other monitored schedulers are stepped by Lightning at the segment's end, which
  ends a call as well, so they need nothing here).

A scheduler that raises at one of the call's steps (OneCycleLR past its ``total_steps``) raises before the call,
where one call per micro-batch would raise after that update.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_sink.compiled import OptimizerRule
from lightning_sink.sink.programs.eager import SinkUpdates
from lightning_sink.strategies.engine import StepEngine

__all__ = ["SchedulerSteps"]


class SchedulerSteps:
    """Steps the fit's step schedulers through the updates of one compiled call, before it; each update's
    hyperparameters on the way."""

    def __init__(self, engine: StepEngine) -> None:
        self._engine = engine

    def reason(self) -> str | None:
        """Why the updates of one call cannot follow this fit's step schedulers (then one window per call)."""
        engine = self._engine
        if not engine.step_scheduler_configs:
            return None
        module = engine.trainer.lightning_module
        if is_overridden("lr_scheduler_step", module, pl.LightningModule):
            return (
                f"{type(module).__name__}.lr_scheduler_step is overridden and an interval='step' scheduler runs: the"
                " hook must run at each update, between the updates a call of several would hold"
            )
        scaling = engine.scaling
        if scaling is not None and scaling.scaler is not None and scaling.scaler.skips_overflow:
            return (
                "an interval='step' scheduler holds after an update skipped on overflow, which is known on the device"
                " only after a call of several updates"
            )
        return None

    def step_through(self, rule: OptimizerRule, windows: int, updates: SinkUpdates) -> list[list[list[float]]] | None:
        """Per window of the next call, the hyperparameters its update uses (``OptimizerRule.current_values``
        rows), the schedulers stepped after each of those updates by ``SinkUpdates.step_schedulers``, as one call
        per micro-batch steps them (and ``updates.schedulers_stepped`` told of each); ``None`` without step
        schedulers (every update uses the current ``param_groups``, nothing is stepped)."""
        if not self._engine.step_scheduler_configs:
            return None
        # the call steps the optimizer before these steps take effect: a scheduler would otherwise warn on the
        # fit's first call that it stepped first
        rule.note_stepped()
        step = self._engine.trainer.global_step  # the k-th update of the call makes it step + k
        rows = []
        for update in range(1, windows + 1):
            rows.append(rule.current_values())
            updates.step_schedulers(step + update)
            if updates.schedulers_stepped is not None:
                updates.schedulers_stepped(step + update)
        return rows
