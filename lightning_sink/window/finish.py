"""The end of a window: the only place that divides, unscales, clips and steps (or skips)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_sink.window.protocols import GradientStore, Reducer

__all__ = ["finish_window", "ready_window_gradient"]


def ready_window_gradient(
    store: GradientStore, reducer: Reducer, scaling: Any, divisor: float, before_step: Callable[[], None]
) -> Tensor | None:
    """Put the window's mean gradient into ``.grad``; returns the device overflow flag (``None`` without a scale).

    ``divisor`` turns the store's (reduced) sum into the mean gradient; ``before_step`` runs the
    ``on_before_optimizer_step`` hooks and clipping once the mean is in ``.grad``.
    """
    reducer.reduce(store)
    found_inf = reducer.agree_on_overflow(store.unscale(scaling, divisor))
    store.write_gradients()
    before_step()
    return found_inf


def finish_window(
    store: GradientStore,
    reducer: Reducer,
    scaling: Any,
    optimizer: Optimizer,
    divisor: float,
    before_step: Callable[[], None],
    **step_kwargs: Any,
) -> Tensor | None:
    """Apply the window's update; returns the device overflow flag (``None`` without a loss scale).

    ``scaling`` is the ``LossScalePrecision`` plugin, which owns the scaled update (unscale, step or skip, scale
    update). Without one, the strategy runs ``ready_window_gradient`` inside ``optimizer.step(closure)`` instead.
    """
    found_inf = ready_window_gradient(store, reducer, scaling, divisor, before_step)
    if scaling is None:
        optimizer.step(**step_kwargs)
    else:
        scaling.step_or_skip(optimizer, found_inf, **step_kwargs)
        scaling.update_scale(found_inf)
    store.end_window()
    return found_inf
