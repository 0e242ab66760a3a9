"""The end of a window: the only place that divides, unscales, clips and steps (or skips)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_sink.window.protocols import GradientStore, Reducer

__all__ = ["WindowGradient", "finish_window", "ready_window_gradient"]


@dataclass(frozen=True)
class WindowGradient:
    """A window's gradient sum and what turns it into the mean gradient in ``.grad``.

    ``store`` holds the sum, ``reducer`` combines the ranks' sums, ``divisor`` turns the (reduced) sum into the mean,
    and ``before_step`` runs the ``on_before_optimizer_step`` hooks and clipping once the mean is in ``.grad``.
    """

    store: GradientStore
    reducer: Reducer
    divisor: float
    before_step: Callable[[], None]


def ready_window_gradient(gradient: WindowGradient, scaling: Any) -> Tensor | None:
    """Put the window's mean gradient into ``.grad``; returns the device overflow flag (``None`` without a scale)."""
    store, reducer = gradient.store, gradient.reducer
    reducer.reduce(store)
    found_inf = reducer.agree_on_overflow(store.unscale(scaling, gradient.divisor))
    store.write_gradients()
    gradient.before_step()
    return found_inf


def finish_window(gradient: WindowGradient, scaling: Any, optimizer: Optimizer, **step_kwargs: Any) -> Tensor | None:
    """Apply the window's update; returns the device overflow flag (``None`` without a loss scale).

    ``scaling`` is the ``LossScalePrecision`` plugin, which owns the scaled update (unscale, step or skip, scale
    update). Without one, the strategy runs ``ready_window_gradient`` inside ``optimizer.step(closure)`` instead.
    """
    found_inf = ready_window_gradient(gradient, scaling)
    if scaling is None:
        optimizer.step(**step_kwargs)
    else:
        scaling.step_or_skip(optimizer, found_inf, **step_kwargs)
        scaling.update_scale(found_inf)
    gradient.store.end_window()
    return found_inf
