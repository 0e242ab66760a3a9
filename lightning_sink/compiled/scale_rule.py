"""The loss-scale step of a compiled update program: the window's overflow recorded, then the one rule
(``lightning_sink.loss_scale.scale_rule``, which ``LossScaler.update`` also runs), looked up when the program is
traced."""

from __future__ import annotations

from torch import Tensor

from lightning_sink import loss_scale
from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale, LossScaler

__all__ = ["scaler_tensors", "update_scale"]


def update_scale(config: DynamicLossScale | FixedLossScale, state: dict[str, Tensor], overflow: Tensor) -> None:
    """Record ``overflow`` (a bool tensor) as the window's ``found_inf``, then move the scale by the one rule."""
    state["found_inf"].copy_(overflow.to(state["found_inf"].dtype))
    loss_scale.scale_rule(config, state, overflow)


def scaler_tensors(scaler: LossScaler) -> dict[str, Tensor]:
    """The scaler's own device tensors by name (the program writes into them, so monitors read current values)."""
    return scaler.tensors()
