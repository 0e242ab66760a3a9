"""The hyperparameters of each update inside one compiled call of several windows (``CompiledSeveral``): the fit's
``interval="step"`` LR schedulers stepped ahead on the host, exactly as ``SinkUpdates`` will step them between those
updates, each update's values read from ``param_groups``; then the schedulers and ``param_groups`` are put back as
they were. A span of updates is looked ahead at once (``SPAN_UPDATES``, or a longer call) and the segment's next
calls read their rows from it.

Why ahead and put back rather than kept: after the call ``SinkUpdates`` steps the schedulers for real, micro-batch by
micro-batch, at the update each step belongs to, so their state, ``lr_scheduler_configs``, the hooks and every logged
learning rate are those of one call per micro-batch; the lookahead only tells the program the values those steps
will produce. Any scheduler works this way (LambdaLR, OneCycleLR with its momentum cycle, chained and sequential
schedulers, ``frequency > 1``, several configs) as long as stepping it depends on nothing the call computes:

- a loss scale that skips overflowing updates: the schedulers hold after a skipped update, which is known on the
  device only after the call;
- a ``lr_scheduler_step`` override: the module's hook may do anything at each step, so it runs only once, at its
  update (``ReduceLROnPlateau`` and other monitored schedulers are stepped by Lightning at the segment's end, which
  ends a call as well, so they need nothing here).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from lightning_sink.compiled import OptimizerRule
from lightning_sink.strategies.engine import StepEngine

__all__ = ["SchedulerLookahead"]


# Updates looked ahead at once: the schedulers' state is saved and put back once per span rather than once per
# call, which costs more than the steps of a short call themselves.
SPAN_UPDATES = 64


class SchedulerLookahead:
    """Each update's hyperparameters for the calls of several windows of one segment, from the fit's step
    schedulers; looked ahead a span of updates at a time."""

    def __init__(self, engine: StepEngine) -> None:
        self._engine = engine
        self._rows: list[list[list[float]]] = []  # the values of the updates that follow global_step _after
        self._after = -1

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

    def rows(self, rule: OptimizerRule, windows: int) -> list[list[list[float]]] | None:
        """Per window of the next call, the hyperparameters its update uses (``OptimizerRule.current_values``
        rows); ``None`` without step schedulers (every update uses the current ``param_groups``)."""
        if not self._engine.step_scheduler_configs:
            return None
        step = self._engine.trainer.global_step
        first = step - self._after
        # the span looked ahead holds this call when the real steps since then followed it (nothing else steps
        # the schedulers inside a segment; the current values are compared as a check)
        if not (first >= 0 and first + windows <= len(self._rows) and self._rows[first] == rule.current_values()):
            self._rows, self._after, first = self._look_ahead(rule, windows), step, 0
        return self._rows[first : first + windows]

    def _look_ahead(self, rule: OptimizerRule, needed: int) -> list[list[list[float]]]:
        """The values of the next ``SPAN_UPDATES`` updates (at least ``needed``), the schedulers stepped ahead as
        ``SinkUpdates.make`` will step them between those updates, then put back as they were."""
        engine = self._engine
        configs = engine.step_scheduler_configs
        optimizer = rule.optimizer
        groups = [_settings_copy(group) for group in optimizer.param_groups]
        states = [copy.deepcopy(config.scheduler.state_dict()) for config in configs]
        step = engine.trainer.global_step  # the k-th update from now (from 1) makes it step + k
        rows = [rule.current_values()]
        try:
            with warnings.catch_warnings():
                # (a scheduler stepped before the optimizer's first step warns; the real steps come after it)
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                for update in range(1, max(needed, SPAN_UPDATES)):
                    try:
                        for config in configs:  # as SinkUpdates.make steps them after that update
                            if (step + update) % config.frequency == 0:
                                config.scheduler.step()
                    except Exception:
                        if update < needed:
                            raise  # a step this call needs: the run one call per micro-batch would raise it too
                        break  # past this call (OneCycleLR past its last step): stepped for real only if reached
                    rows.append(rule.current_values())
        finally:
            for config, state in zip(configs, states):
                config.scheduler.load_state_dict(state)
            for group, saved in zip(optimizer.param_groups, groups):
                _restore_settings(group, saved)
        return rows


def _settings_copy(group: dict[str, Any]) -> dict[str, Any]:
    """A ``param_groups`` entry's settings (everything but its parameters); a tensor setting cloned (schedulers
    write a tensor learning rate in place)."""
    return {
        name: value.clone() if isinstance(value, Tensor) else value for name, value in group.items() if name != "params"
    }


def _restore_settings(group: dict[str, Any], saved: dict[str, Any]) -> None:
    for name in [name for name in group if name != "params" and name not in saved]:
        del group[name]
    for name, value in saved.items():
        current = group.get(name)
        if isinstance(value, Tensor) and isinstance(current, Tensor):
            current.copy_(value)  # the same tensor object, as the optimizer and any capture hold it
        else:
            group[name] = value
