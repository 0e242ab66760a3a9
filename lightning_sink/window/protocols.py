"""The two collaborators a strategy passes to the step engine: where a window's gradient sum lives and how the ranks
combine it. ``tests/strategies/test_window_protocols.py`` checks that every implementation has every member, and
mypy checks their signatures where the engine uses them."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["GradientStore", "Reducer"]


@runtime_checkable
class GradientStore(Protocol):
    """Where a window's gradient sum lives: ``GradientAccumulator`` (flat fp32 buffer), ``SingleStepGradients``
    (plain ``.grad``, a window of one micro-step), ``FSDPWindow`` (FSDP2's unsharded gradients) or ``NoGradients``
    (no trainable parameter)."""

    micro_steps: int  # backward passes in the open window

    @property
    def flat(self) -> Tensor | None:
        """The flat fp32 sum, where the store keeps one (what a flat all-reduce sums)."""
        ...

    def begin_micro_step(self, window_ends: bool = False) -> None:
        """Prepare ``.grad`` for a backward that adds into the window's sum (``window_ends``: its last one)."""
        ...

    def end_micro_step(self) -> None:
        """The backward is done: its gradient is in the sum."""
        ...

    def zero_grad(self) -> None:
        """What ``optimizer.zero_grad(set_to_none=True)`` followed by ``begin_micro_step`` amounts to."""
        ...

    def unscale(self, scaling: Any, divisor: float) -> Tensor | None:
        """Divide the (reduced) sum by ``divisor`` and the loss scale; the device overflow flag when scaled."""
        ...

    def has_overflow(self) -> Tensor:
        """Device flag: the window's sum so far holds inf or NaN."""
        ...

    def write_gradients(self) -> None:
        """Hand the window's mean gradient to the optimizer as ``param.grad``."""
        ...

    def end_window(self) -> None: ...

    def clear(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def scale_sum(self, factor: float) -> None:
        """Multiply the open window's sum by ``factor`` (its losses' divisor changed: ``Window.divide_losses_by``)."""
        ...

    def release(self) -> None:
        """Take off what the store attached to the parameters (hooks): another store replaces it, or the fit ended."""
        ...


@runtime_checkable
class Reducer(Protocol):
    """How the ranks combine a window: before unscaling (``reduce``) and for the overflow decision."""

    def reduce(self, store: GradientStore) -> None: ...

    def agree_on_overflow(self, found_inf: Tensor | None) -> Tensor | None: ...
