"""The store of a window without trainable parameters. (The flat fp32 store and the pass-through store are in
``lightning_sink.accumulation``, the FSDP2 one in ``lightning_sink.strategies.fsdp_window``.)"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["NoGradients"]


class NoGradients:
    """The store while the optimizer holds no trainable parameter (all frozen, or ``configure_optimizers``
    returned ``None``): micro-steps are counted, the update is the optimizer's own (a no-op without gradients)."""

    flat: Tensor | None = None
    follows_zero_grad = True

    def __init__(self) -> None:
        self.micro_steps = 0

    def begin_micro_step(self, window_ends: bool = False) -> None:
        pass

    def end_micro_step(self) -> None:
        self.micro_steps += 1

    def zero_grad(self) -> None:
        pass

    def unscale(self, scaling: Any, divisor: float) -> Tensor | None:
        return None

    def has_overflow(self) -> Tensor:
        """No gradient, so nothing can overflow."""
        return torch.zeros((), dtype=torch.bool)

    def write_gradients(self) -> None:
        pass

    def end_window(self) -> None:
        self.micro_steps = 0

    def clear(self) -> None:
        self.micro_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"micro_steps": 0, "buffer": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_steps = 0

    def scale_sum(self, factor: float) -> None:
        """No sum."""

    def release(self) -> None:
        """Nothing attached."""
