"""The end of a window inside the update program, on the window's summed gradient: division by the micro-step
count (and the ranks, under ``RankSum``), unscaling and the overflow check, clipping (norm or value), the
optimizer update (or, on overflow, none: ``torch.where``, no host sync), the loss-scale update and the window
reset. The window mean and the scale rule are the eager path's own functions (``window_mean_divisor``,
``scale_rule``), looked up when the program is traced."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_sink.compiled.optimizer_rules import OptimizerRule
from lightning_sink.compiled.rank_sum import RankSum
from lightning_sink.compiled.scale_rule import update_scale
from lightning_sink.loss_scale import DynamicLossScale, LossScaler
from lightning_sink.window import state as window_state

__all__ = ["WindowUpdate"]


class WindowUpdate:
    """How a window's update runs: the optimizer's ``rule``, the loss ``scaler`` (None: no scaling), the ``clip``
    (algorithm and value; None: no clipping) and the sum across processes (``rank_sum``; None: one process)."""

    def __init__(
        self,
        rule: OptimizerRule,
        scaler: LossScaler | None,
        clip: tuple[str, float] | None,
        rank_sum: RankSum | None,
    ) -> None:
        self.rule, self.scaler, self.clip, self.rank_sum = rule, scaler, clip, rank_sum

    def apply(self, state: dict[str, Any], sums: list[Tensor]) -> Tensor | None:
        """Divide, unscale, check for overflow, clip, update (or skip), update the scale, reset the window."""
        ranks = 1 if self.rank_sum is None else self.rank_sum.ranks
        # the micro-steps before this one and this one; the programs add undivided losses (loss divisor 1)
        divisor = window_state.window_mean_divisor(state["micro_steps"] + 1, ranks, 1)
        scaler = state["scaler"]
        factor = 1.0 / divisor if scaler is None else 1.0 / (scaler["scale"] * divisor)
        sums = [total * factor for total in sums]
        overflow = None
        if scaler is not None:
            overflow = torch.stack([torch.isfinite(total).all() for total in sums]).logical_not().any()
        if self.clip is not None:
            sums = self._clipped(sums)
        skip = overflow if self.scaler is not None and self._skips_overflow() else None
        grads = [total.to(param.dtype) for total, param in zip(sums, state["params"])]
        self.rule.apply(state["params"], grads, state["optimizer"], state["hyper"], skip)
        if scaler is not None:
            assert self.scaler is not None and overflow is not None  # both exist exactly when scaler does
            update_scale(self.scaler.config, scaler, overflow)
        for buffer in state["window"]:
            buffer.zero_()
        state["micro_steps"].zero_()
        return None if scaler is None else scaler["found_inf"].clone()

    def _skips_overflow(self) -> bool:
        assert self.scaler is not None  # asked only when the programs scale the loss
        config = self.scaler.config
        return isinstance(config, DynamicLossScale) or config.drop_overflow_update

    def _clipped(self, sums: list[Tensor]) -> list[Tensor]:
        assert self.clip is not None  # asked only when the programs clip
        algorithm, value = self.clip
        if algorithm == "value":
            return [total.clamp(-value, value) for total in sums]
        # torch.nn.utils.clip_grad_norm_'s rule: the 2-norm of the per-tensor norms, a coefficient at most 1
        total_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(total) for total in sums]))
        coefficient = torch.clamp(value / (total_norm + 1e-6), max=1.0)
        return [total * coefficient for total in sums]
