"""How long a fit runs: its stopping conditions, the time a ``Timer`` leaves, and the updates it estimates."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Timer

from lightning_sink._lightning_compat.trainer_settings import trainer_settings


def can_stop_early(trainer: pl.Trainer) -> bool:
    """Whether ``trainer.should_stop`` may end the fit now (``min_epochs``/``min_steps`` are met)."""
    return bool(trainer.fit_loop._can_stop_early)


def step_time_left(trainer: pl.Trainer) -> float | None:
    """Seconds left before a ``Timer`` (``Trainer(max_time=...)``) that checks after every training batch stops the
    fit; ``None`` without such a timer."""
    for callback in trainer_settings(trainer).callbacks:
        if isinstance(callback, Timer) and callback._interval == "step" and callback._duration is not None:
            left = callback.time_remaining("train")
            if left is not None:
                return float(left)
    return None


# ``Trainer.estimated_stepping_batches`` is a property of the class; a fit that knows its updates better (sink
# mode, where an epoch is a sink) registers its own estimate here, and the property, wrapped once per Trainer class
# that defines it (``lightning`` and ``pytorch_lightning`` each have one), asks it first.
_ESTIMATES: weakref.WeakKeyDictionary[Any, Callable[[], int | float]] = weakref.WeakKeyDictionary()
_STOCK_ESTIMATES: dict[type, Callable[[Any], int | float]] = {}
_NAME = "estimated_stepping_batches"


def _estimate_owner(trainer: pl.Trainer) -> type:
    return next(cls for cls in type(trainer).__mro__ if _NAME in vars(cls))


def set_estimated_stepping_batches(trainer: pl.Trainer, estimate: Callable[[], int | float] | None) -> None:
    """Make ``trainer.estimated_stepping_batches`` return ``estimate()`` (``None``: Lightning's own again)."""
    if estimate is None:
        _ESTIMATES.pop(trainer, None)
        return
    owner = _estimate_owner(trainer)
    if owner not in _STOCK_ESTIMATES:
        stock = vars(owner)[_NAME]
        _STOCK_ESTIMATES[owner] = stock.fget

        def estimated_stepping_batches(self: Any) -> int | float:
            own = _ESTIMATES.get(self)
            return own() if own is not None else stock.fget(self)

        estimated_stepping_batches.__doc__ = stock.__doc__
        setattr(owner, _NAME, property(estimated_stepping_batches))
    _ESTIMATES[trainer] = estimate


def stock_estimated_stepping_batches(trainer: pl.Trainer) -> int | float:
    """Lightning's own ``estimated_stepping_batches`` (which loads the training data if it is not loaded yet)."""
    owner = _estimate_owner(trainer)
    fget = _STOCK_ESTIMATES.get(owner) or vars(owner)[_NAME].fget
    return fget(trainer)
