"""What a step program's call gives back: its outputs on the device (a call of several: each position of a window
stacked over the call's windows), or, raised, that the program no longer applies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_sink.compiled.metric_calls import MetricValue

__all__ = ["ProgramUnavailable", "StackedRows", "StepOutputs"]


class ProgramUnavailable(RuntimeError):
    """A program stopped applying after it was built (e.g. a ``param_groups`` flag it was compiled for changed)."""


@dataclass(slots=True)
class StepOutputs:
    """What one program call returns, on the device (reading any of it is the caller's host sync, not ours).
    Made once per micro-step, so a plain slotted class (a frozen one costs several times as much to make)."""

    loss: Tensor  # the micro-batch's loss as training_step returned it (unscaled, detached)
    logs: dict[str, Tensor] = field(default_factory=dict)  # self.log values of this micro-batch, by name
    found_inf: Tensor | None = None  # update with loss scaling: the window overflowed and was skipped
    # an update of several in one call (``run_several``) with loss scaling: the scale and the skipped-window count
    # right after it (the scaler's own tensors hold the call's last values by the time the caller reads them)
    scale: Tensor | None = None
    skipped: Tensor | None = None
    # the micro-batch's torchmetrics Metric calls, recorded in the program, and the logged Metrics: made and
    # resolved on the host by ``LoggedValues.host_logs`` (metric_calls.py)
    metric_calls: list[Any] = field(default_factory=list)
    references: dict[str, MetricValue] = field(default_factory=dict)


class StackedRows:
    """One position of a window's outputs, stacked over a call's windows (loss, logged values and Metric tensors,
    and at the window's end found_inf, scale and skipped under a loss scale), split into rows once per call."""

    def __init__(self, output: tuple) -> None:
        loss, (logs, metric_tensors), *extra = output
        self.losses = loss.unbind(0)
        self.logs = {name: value.unbind(0) for name, value in logs.items()}
        self.metric_tensors = [tensor.unbind(0) for tensor in metric_tensors]
        self.extra = [tensor.unbind(0) for tensor in extra]

    def micro_steps(self, side: Any) -> list[tuple]:
        """Per window of the call, the arguments of ``LoggedValues.step_outputs`` for this position, made in one
        pass over the rows (a call of a whole sink makes hundreds)."""
        windows = len(self.losses)
        names = list(self.logs)
        logs = [dict(zip(names, row)) for row in zip(*self.logs.values())] if names else [{} for _ in range(windows)]
        tensors = [list(row) for row in zip(*self.metric_tensors)] if self.metric_tensors else [()] * windows
        extra = list(zip(*self.extra)) if self.extra else [()] * windows
        return [(loss, values, side, *more) for loss, values, more in zip(self.losses, zip(logs, tensors), extra)]
