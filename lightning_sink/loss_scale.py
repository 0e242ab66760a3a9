"""Loss-scale settings and the device-resident scaler that applies them.

``DynamicLossScale`` and ``FixedLossScale`` mirror MindSpore's ``DynamicLossScaleManager`` and
``FixedLossScaleManager``; ``LossScaler`` keeps the scale, its counters and the skipped-update count as tensors on
the training device and updates them with tensor ops, so deciding to skip a window and adjusting the scale never
needs the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_sink.counts import check_count_fits

__all__ = ["DynamicLossScale", "FixedLossScale", "LossScaler", "SCALER_TENSORS", "scale_rule"]


_SCALE_DTYPE = torch.float32  # of the device-resident scale (LossScaler.scale)
_LARGEST_SCALE = torch.finfo(_SCALE_DTYPE).max


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_scale(owner: str, name: str, value: object) -> None:
    """A real number that the scale's dtype holds as a finite value (NaN and infinity named as such)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}({name}={value!r}) is not valid: pass a number (int or float).")
    if isinstance(value, float) and not math.isfinite(value):
        what = "NaN (not a number)" if math.isnan(value) else "infinite"
        raise ValueError(f"{owner}({name}={value!r}) is {what}: pass a finite number > 0.")
    _require(
        abs(value) <= _LARGEST_SCALE,
        f"{owner}({name}={value!r}) does not fit the loss scale's dtype {_SCALE_DTYPE} (largest finite value"
        f" {_LARGEST_SCALE:.4g}): pass a smaller value.",
    )


def _require_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({name}={value!r}) is not valid: pass True or False.")


@dataclass(frozen=True)
class DynamicLossScale:
    """A loss scale that drops on overflow and grows after a run of good updates.

    Args:
        init_scale: the first scale (2**16, torch ``GradScaler``'s start). MindSpore's ``DynamicLossScaleManager``
            starts at 2**24, which skips the first windows of a typical fp16 run while the scale halves down to what
            the gradients allow (measured by benchmarks/loss_scale_start.py: 4 of LeNet-5's first 23 updates from
            2**24, none from 2**20 or below); ``DynamicLossScale(init_scale=2**24)`` is MindSpore's setting.
        scale_factor: divide by this on overflow, multiply by it to grow (2.0).
        scale_window: grow after this many consecutive updates without overflow (2000).
        min_scale: the scale never drops below this (1.0).
        max_scale: the scale never grows above this (2**24).
        hysteresis: overflows needed before the scale drops, as in DeepSpeed/Megatron (1: drop on every overflow).
            The allowance is refilled each time the scale grows.

    Rule per window (an update attempt): on overflow the growth counter resets and the hysteresis allowance
    decreases; when it reaches 0 the scale becomes ``max(scale / scale_factor, min_scale)``. Without overflow the
    growth counter increases; when it reaches ``scale_window`` it resets, the allowance is refilled and the scale
    becomes ``min(scale * scale_factor, max_scale)``. With ``hysteresis=1`` and no ``min_scale``/``max_scale`` in
    reach this is exactly ``torch.amp.GradScaler``'s rule.
    """

    init_scale: float = 2.0**16
    scale_factor: float = 2.0
    scale_window: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    hysteresis: int = 1

    def __post_init__(self) -> None:
        for name in ("init_scale", "scale_factor", "min_scale", "max_scale"):
            _require_scale("DynamicLossScale", name, getattr(self, name))
        for name in ("scale_window", "hysteresis"):
            check_count_fits(name, getattr(self, name), "DynamicLossScale")
        _require(self.init_scale > 0, f"DynamicLossScale(init_scale={self.init_scale!r}) must be > 0.")
        _require(self.scale_factor > 1, f"DynamicLossScale(scale_factor={self.scale_factor!r}) must be > 1.")
        _require(
            isinstance(self.scale_window, int) and not isinstance(self.scale_window, bool) and self.scale_window >= 1,
            f"DynamicLossScale(scale_window={self.scale_window!r}) must be an int >= 1.",
        )
        _require(
            0 < self.min_scale <= self.max_scale,
            f"DynamicLossScale(min_scale={self.min_scale!r}, max_scale={self.max_scale!r}) needs"
            " 0 < min_scale <= max_scale.",
        )
        _require(
            self.min_scale <= self.init_scale <= self.max_scale,
            f"DynamicLossScale(init_scale={self.init_scale!r}) must lie in [min_scale, max_scale] ="
            f" [{self.min_scale!r}, {self.max_scale!r}].",
        )
        _require(
            isinstance(self.hysteresis, int) and not isinstance(self.hysteresis, bool) and self.hysteresis >= 1,
            f"DynamicLossScale(hysteresis={self.hysteresis!r}) must be an int >= 1.",
        )


@dataclass(frozen=True)
class FixedLossScale:
    """A constant loss scale (MindSpore's ``FixedLossScaleManager``).

    Args:
        loss_scale: the constant scale (128.0).
        drop_overflow_update: skip a window whose gradients overflow (True); False applies it anyway, as
            MindSpore does.
    """

    loss_scale: float = 128.0
    drop_overflow_update: bool = True

    def __post_init__(self) -> None:
        _require_scale("FixedLossScale", "loss_scale", self.loss_scale)
        _require_bool("FixedLossScale", "drop_overflow_update", self.drop_overflow_update)
        _require(self.loss_scale > 0, f"FixedLossScale(loss_scale={self.loss_scale!r}) must be > 0.")


class LossScaler:
    """Device-resident loss-scale state for one run."""

    def __init__(self, config: DynamicLossScale | FixedLossScale) -> None:
        self.config = config
        self.dynamic = isinstance(config, DynamicLossScale)
        if isinstance(config, DynamicLossScale):
            self.skips_overflow, init, hysteresis = True, config.init_scale, config.hysteresis
        else:
            self.skips_overflow, init, hysteresis = config.drop_overflow_update, config.loss_scale, 1
        self.scale = torch.tensor(float(init), dtype=torch.float32)
        self.growth_tracker = torch.zeros((), dtype=torch.int64)
        self.hysteresis_left = torch.tensor(hysteresis, dtype=torch.int64)
        self.skipped = torch.zeros((), dtype=torch.int64)
        self.found_inf = torch.zeros((), dtype=torch.float32)  # of the last window

    def to(self, device: torch.device) -> LossScaler:
        for name in SCALER_TENSORS:
            setattr(self, name, getattr(self, name).to(device))
        return self

    def check_and_unscale_(self, flat_gradients: Tensor, divisor: float) -> Tensor:
        """Divide the window's gradient sum by ``scale * divisor`` and flag non-finite values (on the device).

        A window's buffer holds the sum of its micro-steps' gradients; inf and NaN are absorbing under addition, so
        one check of the sum is the OR of every micro-step's overflow check, and on DDP the summing all-reduce has
        already carried any rank's overflow to every rank.
        """
        flat_gradients.mul_(self.scale.reciprocal() / divisor)
        torch.logical_not(torch.isfinite(flat_gradients).all(), out=self.found_inf)
        return self.found_inf

    def update(self, found_inf: Tensor) -> None:
        """Count a skipped window and move the scale by the documented rule (``scale_rule``), on the device."""
        scale_rule(self.config, self.tensors(), found_inf > 0)

    def tensors(self) -> dict[str, Tensor]:
        """The scaler's own device tensors by name (a compiled program writes into them, so monitors read them)."""
        return {name: getattr(self, name) for name in SCALER_TENSORS}

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name).detach().cpu().clone() for name in SCALER_TENSORS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            getattr(self, name).copy_(value)


SCALER_TENSORS = ("scale", "growth_tracker", "hysteresis_left", "skipped", "found_inf")  # LossScaler's, in order


def scale_rule(config: DynamicLossScale | FixedLossScale, state: dict[str, Tensor], overflow: Tensor) -> None:
    """The one loss-scale update rule, on explicit tensors (``LossScaler.update`` calls it, and the compiled update
    program traces it): count a skipped window (``overflow``, a bool tensor) where the config skips them; on overflow
    the growth counter resets and the hysteresis allowance drops, the scale dividing by ``scale_factor`` (not below
    ``min_scale``) when it is spent; after ``scale_window`` good windows in a row the scale multiplies by
    ``scale_factor`` (not above ``max_scale``) and the allowance is refilled."""
    skips = isinstance(config, DynamicLossScale) or config.drop_overflow_update
    if skips:
        state["skipped"].add_(overflow.to(state["skipped"].dtype))
    if not isinstance(config, DynamicLossScale):
        return
    growth = torch.where(overflow, torch.zeros_like(state["growth_tracker"]), state["growth_tracker"] + 1)
    hysteresis = torch.where(overflow, state["hysteresis_left"] - 1, state["hysteresis_left"])
    drop = overflow & (hysteresis <= 0)
    grow = growth >= config.scale_window
    scale = state["scale"]
    new_scale = torch.where(drop, (scale / config.scale_factor).clamp(min=config.min_scale), scale)
    new_scale = torch.where(grow, (new_scale * config.scale_factor).clamp(max=config.max_scale), new_scale)
    state["growth_tracker"].copy_(torch.where(grow, torch.zeros_like(growth), growth))
    state["hysteresis_left"].copy_(torch.where(grow, torch.full_like(hysteresis, config.hysteresis), hysteresis))
    scale.copy_(new_scale)
