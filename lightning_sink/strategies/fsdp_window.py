"""The accumulation window of an FSDP2 (+ tensor parallel) model.

With FSDP2 the fp32 window buffers are FSDP2's own unsharded gradients: while gradient sync is off
(``FSDPModule.set_requires_gradient_sync(False)``) each backward adds into the unsharded gradient of every parameter
and nothing is reduce-scattered. With ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` FSDP2 keeps that
sum in fp32 (``reduce_dtype``), so low-precision micro-steps lose nothing to rounding - the same guarantee as
``GradientAccumulator``'s flat fp32 buffer, which cannot alias DTensor shards. The update step's backward runs with
sync on: one reduce-scatter per FSDP parameter group carries the whole window's sum, averaged over the
data-parallel ranks, into the sharded ``param.grad``. A checkpoint inside a window keeps each rank's partial sums,
and a resume puts them back into FSDP2 before the next backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_sink import _torch_compat as compat
from lightning_sink.accumulation import unique_trainable

__all__ = ["FSDPWindow"]


def _local_copy(grad: Tensor | None) -> Tensor | None:
    if grad is None:
        return None
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    return local.detach().to("cpu", copy=True)


def _like(param: Tensor, local: Tensor | None) -> Tensor | None:
    """``local`` as a gradient of ``param``: a DTensor with the same mesh and placements when ``param`` is one."""
    if local is None:
        return None
    local = local.to(param.device)
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    return local


def _check_shape(param: Tensor, local: Tensor | None) -> None:
    expected = tuple((param.to_local() if isinstance(param, DTensor) else param).shape)
    if local is not None and tuple(local.shape) != expected:
        raise ValueError(
            f"The checkpoint's accumulation window holds a partial gradient of shape {tuple(local.shape)} where this"
            f" rank's parameter part has shape {expected}: a checkpoint saved inside a window resumes on the same"
            " mesh only (resume from a window-boundary checkpoint to change the mesh)."
        )


def _restore_partial_sum(fsdp_param: Any, local: Tensor | None) -> None:
    unsharded = compat.fsdp_unsharded_param(fsdp_param)
    _check_shape(unsharded, local)
    compat.set_fsdp_partial_sum(fsdp_param, _like(unsharded, local))


class FSDPWindow:
    """Window position and gradient-sync switch for the FSDP2 modules of one model.

    A ``GradientStore`` (``lightning_sink.window``): FSDP2 itself holds the window's sum, reduce-scattered by the
    window's last backward (``begin_micro_step(window_ends=True)`` turns gradient sync on for it).
    """

    flat: Tensor | None = None  # no flat buffer: FSDP2's own gradients hold the sum

    def __init__(self, model: nn.Module, params: list[nn.Parameter], data_parallel_size: int) -> None:
        self.params = unique_trainable(params)
        if not self.params:
            raise ValueError("The optimizer holds no trainable parameters; there is nothing to accumulate.")
        self.fsdp_modules: list[FSDPModule] = [module for module in model.modules() if isinstance(module, FSDPModule)]
        if data_parallel_size > 1 and not self.fsdp_modules:
            raise ValueError(
                f"data_parallel_size={data_parallel_size} but configure_model applied no `fully_shard`: the"
                " gradients would never be reduced over the data-parallel ranks. Call"
                " `fully_shard(module, mesh=self.device_mesh['data_parallel'])` in configure_model, or use"
                " data_parallel_size=1."
            )
        self.micro_steps = 0
        self._sync: bool | None = None
        self._pending: list[Tensor | None] | None = None

    def set_gradient_sync(self, enabled: bool) -> None:
        """Off on accumulate steps (FSDP2 sums unsharded gradients locally), on for the window's last backward."""
        if self._sync is enabled:
            return
        for module in self.fsdp_modules:
            module.set_requires_gradient_sync(enabled, recurse=False)
        self._sync = enabled

    def begin_micro_step(self, window_ends: bool = False) -> None:
        """FSDP2 (or autograd, without FSDP) owns the sum; only the last backward of a window reduces it."""
        self.restore_pending()  # after a resume inside a window: its partial sums, once
        self.set_gradient_sync(window_ends)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def unscale(self, scaling: Any, divisor: float) -> Tensor | None:
        """Divide this rank's reduced shards by ``divisor`` (and the loss scale); its local overflow flag."""
        if scaling is None:
            self.divide_(divisor)
            return None
        grads = self.local_gradients()
        flat = torch.cat([grad.reshape(-1).float() for grad in grads])
        found_inf = scaling.unscale_window(flat, divisor)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        return found_inf

    def write_gradients(self) -> None:
        """The reduce-scatter wrote them into the sharded ``param.grad`` already."""

    def end_window(self) -> None:
        self.clear()

    def end_micro_step(self) -> None:
        self.micro_steps += 1

    @torch.no_grad()
    def has_overflow(self) -> Tensor:
        """Device flag: this rank's partial sums hold inf or NaN (its own part only; the update's check is agreed
        across ranks by ``OverflowFlagAllReduce``)."""
        sums = [
            grad.to_local() if isinstance(grad, DTensor) else grad for grad in self._partial_sums() if grad is not None
        ]
        if not sums:
            return torch.zeros((), dtype=torch.bool, device=self.params[0].device)
        return torch.logical_not(torch.stack([torch.isfinite(grad).all() for grad in sums]).all())

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

    def scale_sum(self, factor: float) -> None:
        """The partial sums a resume put aside, or those FSDP2 (or autograd) holds."""
        sums = self._pending if self._pending is not None else self._partial_sums()
        with torch.no_grad():
            for tensor in sums:
                if tensor is not None:
                    tensor.mul_(factor)

    def release(self) -> None:
        """Nothing attached: FSDP2 keeps the gradients in ``param.grad``."""

    # ------------------------------------------------------------------ checkpoint state inside a window
    def state_dict(self) -> dict[str, Any]:
        """The window position and, inside a window, this rank's partial sums (its local, unreduced gradients)."""
        if not self.micro_steps:
            return {"micro_steps": 0, "buffer": None}
        return {"micro_steps": self.micro_steps, "buffer": [_local_copy(grad) for grad in self._partial_sums()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_steps = int(state["micro_steps"])
        self._pending = state.get("buffer")  # put back before the next backward (FSDP2 needs its params unsharded)
        if self._pending is not None and len(self._pending) != len(self._partial_sums()):
            raise ValueError(
                f"The checkpoint's accumulation window holds {len(self._pending)} partial gradients but this model"
                f" has {len(self._partial_sums())}: was it saved from a different model or sharding?"
            )

    def restore_pending(self) -> None:
        """Give FSDP2 (or autograd) back the partial sums of a window that a checkpoint interrupted."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not self.fsdp_modules:
            for param, local in zip(self.params, pending):
                _check_shape(param, local)
                param.grad = _like(param, local)
            return
        for module in self.fsdp_modules:
            module.unshard()  # creates FSDP2's unsharded parameters, which own the window's gradient sums
        for fsdp_param, local in zip(compat.fsdp_params(self.fsdp_modules), pending):
            _restore_partial_sum(fsdp_param, local)
        for module in self.fsdp_modules:
            module.reshard()

    def _partial_sums(self) -> list[Tensor | None]:
        if not self.fsdp_modules:
            return [param.grad for param in self.params]
        return [compat.fsdp_partial_sum(fsdp_param) for fsdp_param in compat.fsdp_params(self.fsdp_modules)]

    @torch.no_grad()
    def divide_(self, divisor: float) -> None:
        if divisor != 1:
            torch._foreach_div_(self.local_gradients(), divisor)
