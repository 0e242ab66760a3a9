"""The two collaborators a strategy injects into the step engine."""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

__all__ = ["GradientStore", "Reducer"]


class GradientStore(Protocol):
    """Where a window's gradient sum lives: ``GradientAccumulator`` (flat fp32 buffer), ``SingleStepGradients``
    (plain ``.grad``, a window of one micro-step) or ``FSDPWindow`` (FSDP2's unsharded gradients)."""

    micro_steps: int  # backward passes in the open window

    def begin_micro_step(self, window_ends: bool = False) -> None: ...

    def end_micro_step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def unscale(self, scaling: Any, divisor: float) -> Tensor | None: ...

    def write_gradients(self) -> None: ...

    def end_window(self) -> None: ...

    def clear(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Reducer(Protocol):
    """How the ranks combine a window: before unscaling (``reduce``) and for the overflow decision."""

    def reduce(self, store: GradientStore) -> None: ...

    def agree_on_overflow(self, found_inf: Tensor | None) -> Tensor | None: ...
