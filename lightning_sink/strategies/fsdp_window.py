"""The accumulation window of an FSDP2 (+ tensor parallel) model.

With FSDP2 the fp32 window buffers are FSDP2's own unsharded gradients: while gradient sync is off
(``FSDPModule.set_requires_gradient_sync(False)``) each backward adds into the unsharded gradient of every parameter
and nothing is reduce-scattered. With ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` FSDP2 keeps that
sum in fp32 (``reduce_dtype``), so low-precision micro-steps lose nothing to rounding - the same guarantee as
``GradientAccumulator``'s flat fp32 buffer, which cannot alias DTensor shards. The update step's backward runs with
sync on: one reduce-scatter per FSDP parameter group carries the whole window's sum, averaged over the
data-parallel ranks, into the sharded ``param.grad``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["FSDPWindow"]


def _unique_trainable(params: list[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    unique = []
    for param in params:
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique


class FSDPWindow:
    """Window position and gradient-sync switch for the FSDP2 modules of one model.

    Offers the part of ``GradientAccumulator``'s interface that the step programs use (``micro_steps``,
    ``begin_micro_step``/``end_micro_step``, ``clear``, ``state_dict``); the update arithmetic lives in
    ``SinkModelParallelStrategy._apply_window_update``.
    """

    def __init__(self, model: nn.Module, params: list[nn.Parameter], data_parallel_size: int) -> None:
        self.params = _unique_trainable(params)
        if not self.params:
            raise ValueError("The optimizer holds no trainable parameters; there is nothing to accumulate.")
        self.fsdp_modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
        if data_parallel_size > 1 and not self.fsdp_modules:
            raise ValueError(
                f"data_parallel_size={data_parallel_size} but configure_model applied no `fully_shard`: the"
                " gradients would never be reduced over the data-parallel ranks. Call"
                " `fully_shard(module, mesh=self.device_mesh['data_parallel'])` in configure_model, or use"
                " data_parallel_size=1."
            )
        self.micro_steps = 0
        self._sync: bool | None = None

    def set_gradient_sync(self, enabled: bool) -> None:
        """Off on accumulate steps (FSDP2 sums unsharded gradients locally), on for the window's last backward."""
        if self._sync is enabled:
            return
        for module in self.fsdp_modules:
            module.set_requires_gradient_sync(enabled, recurse=False)
        self._sync = enabled

    def begin_micro_step(self) -> None:
        """Nothing to point anywhere: FSDP2 (or autograd, without FSDP) owns the window's gradient sum."""

    def end_micro_step(self) -> None:
        self.micro_steps += 1

    def local_gradients(self) -> list[Tensor]:
        """This rank's shard of every gradient (after the update step's reduce-scatter), as plain tensors."""
        grads = []
        for param in self.params:
            grad = param.grad
            if grad is not None:
                grads.append(grad.to_local() if isinstance(grad, DTensor) else grad)
        return grads

    def clear(self) -> None:
        for param in self.params:
            param.grad = None
        self.micro_steps = 0

    def state_dict(self) -> dict[str, Any]:
        if self.micro_steps:
            raise RuntimeError(
                f"SinkModelParallelStrategy saves checkpoints at window boundaries only, but this save comes after"
                f" micro-step {self.micro_steps} of a window: the window's partial sums are FSDP2's unsharded"
                " gradients, which a distributed checkpoint does not hold. Save after an update (e.g."
                " ModelCheckpoint(every_n_train_steps=...)), or with partial_window='scale', whose epochs end on an"
                " update. Nothing was written."
            )
        return {"micro_steps": 0, "buffer": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("micro_steps") or state.get("buffer") is not None:
            raise ValueError(
                f"The checkpoint was saved inside an accumulation window (micro-step {state.get('micro_steps')});"
                " SinkModelParallelStrategy resumes from window boundaries only."
            )
        self.micro_steps = 0

    @torch.no_grad()
    def divide_(self, divisor: float) -> None:
        if divisor != 1:
            torch._foreach_div_(self.local_gradients(), divisor)
