"""The loss-scale rule of ``lightning_sink.loss_scale.LossScaler.update``, written over explicit tensors so it can run
inside a compiled update program (which takes every tensor it changes as an argument)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale, LossScaler

__all__ = ["SCALER_TENSORS", "scaler_tensors", "update_scale"]

SCALER_TENSORS = ("scale", "growth_tracker", "hysteresis_left", "skipped", "found_inf")  # LossScaler's, in order


def update_scale(config: DynamicLossScale | FixedLossScale, state: dict[str, Tensor], overflow: Tensor) -> None:
    """Record ``overflow`` (a bool tensor), count a skipped window and move the scale by ``LossScaler``'s rule:
    on overflow the growth counter resets and the hysteresis allowance drops, the scale dividing by
    ``scale_factor`` (not below ``min_scale``) when it is spent; after ``scale_window`` good windows in a row the
    scale multiplies by ``scale_factor`` (not above ``max_scale``) and the allowance is refilled."""
    state["found_inf"].copy_(overflow.to(state["found_inf"].dtype))
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


def scaler_tensors(scaler: LossScaler) -> dict[str, Tensor]:
    """The scaler's own device tensors by name (the program writes into them, so monitors read current values)."""
    return {name: getattr(scaler, name) for name in SCALER_TENSORS}
