"""``LossScalePrecision``: Lightning precision plugin with device-resident dynamic or fixed loss scaling.

MindSpore's ``TrainAccuStepsWithLossScaleCell`` and ``TrainOneStepWithLossScaleCell``:
the loss is multiplied by the scale before backward; at the update the window's gradients are unscaled once,
checked for overflow, clipped, and the update is skipped on overflow while the scale moves down (or up after a run
of good updates). The plugin owns everything precision-specific; the sink strategies call it from their update
step, and it also works with Lightning's stock strategies through ``optimizer_step``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sink import _lightning_compat as compat
from lightning_sink.devices import available_device_types, missing_device_reason
from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale, LossScaler

__all__ = ["LossScalePrecision", "PRECISIONS"]

PrecisionName = Literal["16-mixed", "bf16-mixed", "16-true", "bf16-true", "32-true"]
PRECISIONS: tuple[PrecisionName, ...] = get_args(PrecisionName)
_FP16 = ("16-mixed", "16-true")


def _inner_plugin(precision: PrecisionName, device: str) -> Precision:
    """Lightning's own plugin for autocast / dtype conversion, used without its loss scaling."""
    if precision == "16-mixed" or precision == "bf16-mixed":
        return MixedPrecision(precision, device, scaler=None)
    if precision == "16-true" or precision == "bf16-true":
        return HalfPrecision(precision)
    return Precision()


def _autocast_device(device: object) -> str:
    """The autocast device type named by ``device``: a type autocast supports that this machine has."""
    valid = [name for name in available_device_types() if torch.amp.is_autocast_available(name)]
    reason = None
    if not isinstance(device, str) or isinstance(device, bool):
        reason = "not a string"
    else:
        try:
            parsed = torch.device(device)
        except RuntimeError:
            parsed = None
        if parsed is not None and parsed.index is not None:
            reason = "an autocast device type has no index"
        elif parsed is None or not torch.amp.is_autocast_available(parsed.type):
            reason = "not a device type autocast runs on"
        else:
            reason = missing_device_reason(parsed)
    if reason is not None:
        raise ValueError(
            f"device={device!r} is not valid: {reason}; pass one of {', '.join(map(repr, valid))} (the autocast"
            " device type of this machine's devices), or None (cuda where available, else cpu)."
        )
    assert isinstance(device, str)
    return device


def _precision_name(precision: object) -> PrecisionName:
    for name in PRECISIONS:
        if precision == name:
            return name
    raise ValueError(f"precision={precision!r} is not valid: choose one of {', '.join(map(repr, PRECISIONS))}.")


def _skips_on_device(optimizer: Optimizer) -> bool:
    """Fused Adam/AdamW take ``found_inf`` and skip inside the kernel. (Fused SGD also takes it, but on a skipped
    first step it leaves its momentum buffer uninitialised - seen with torch 2.14 on CPU - so it is not used.)"""
    fused = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and all(
        group.get("fused") for group in optimizer.param_groups
    )
    return fused and getattr(optimizer, "_step_supports_amp_scaling", False)


class LossScalePrecision(Precision):
    """Mixed or low precision with a loss scale whose state lives on the training device.

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``, ``"bf16-true"`` or ``"32-true"``.
        loss_scale: ``DynamicLossScale(...)``, ``FixedLossScale(...)``, ``None`` (no scaling), or ``"auto"``:
            a ``DynamicLossScale()`` for fp16 precisions, none for bf16 and fp32 (bf16 has fp32's range).
        skip_window_on_overflow: once a micro-step of a window overflows, its remaining micro-steps run the forward
            only (they still consume their data and report a loss). Checking costs one host sync per micro-step.
        device: the autocast device type for ``*-mixed`` (``"cuda"`` or ``"cpu"``), one this machine has (else
            refused at construction); default: ``"cuda"`` when CUDA is available, else ``"cpu"``.

    ``scale`` and ``skipped_updates`` read the device state and so synchronize with the device.
    """

    def __init__(
        self,
        precision: str = "16-mixed",
        loss_scale: DynamicLossScale | FixedLossScale | str | None = "auto",
        skip_window_on_overflow: bool = False,
        device: str | None = None,
    ) -> None:
        name = _precision_name(precision)
        if loss_scale == "auto":
            loss_scale = DynamicLossScale() if precision in _FP16 else None
        if loss_scale is not None and not isinstance(loss_scale, (DynamicLossScale, FixedLossScale)):
            raise TypeError(
                f"loss_scale={loss_scale!r} is not valid: pass DynamicLossScale(...), FixedLossScale(...), None or"
                " 'auto'."
            )
        if not isinstance(skip_window_on_overflow, bool):
            raise TypeError(f"skip_window_on_overflow={skip_window_on_overflow!r} is not valid: pass True or False.")
        self.precision = name
        self.loss_scale = loss_scale
        self.skip_window_on_overflow = skip_window_on_overflow
        self.device = (
            _autocast_device(device) if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self._inner = _inner_plugin(name, self.device)
        self.scaler = LossScaler(loss_scale) if loss_scale is not None else None
        self._overflow_on_host: bool | None = None

    # ------------------------------------------------------------------ autocast / dtypes: Lightning's own plugin
    @property
    def context_plugin(self) -> Precision:
        """Lightning's own plugin whose contexts and conversions this one uses, without its loss scaling:
        ``MixedPrecision`` (autocast) for ``*-mixed``, ``HalfPrecision`` for ``*-true`` halves, else ``Precision``."""
        return self._inner

    @override
    def convert_module(self, module: Module) -> Module:
        return self._inner.convert_module(module)

    @override
    def convert_input(self, data: Any) -> Any:
        return self._inner.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self._inner.convert_output(data)

    @override
    def tensor_init_context(self) -> Any:
        return self._inner.tensor_init_context()

    @override
    def module_init_context(self) -> Any:
        return self._inner.module_init_context()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self._inner.forward_context():
            yield

    # ------------------------------------------------------------------ loss scaling
    def to_device(self, device: torch.device) -> None:
        if self.scaler is not None:
            self.scaler.to(device)

    # The three overrides below take Lightning's own signatures, which narrow its Fabric base class's; Lightning's
    # pytorch Precision marks the same three methods with the same ignore.
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        tensor = super().pre_backward(tensor, module)  # on_before_backward hooks see the unscaled loss
        return tensor if self.scaler is None else tensor * self.scaler.scale.to(tensor.dtype)

    @override
    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        skip_backward: bool = False,
        **kwargs: Any,
    ) -> None:
        """``skip_backward``: the micro-batch's window already overflowed (``skip_window_on_overflow``), so its forward
        ran without autograd and there is nothing to backpropagate. The sink strategies pass it through Lightning's
        ``Strategy.backward``, which hands its keyword arguments on to this method."""
        if not skip_backward:
            super().backward(tensor, model, optimizer, *args, **kwargs)

    def unscale_window(self, flat_gradients: Tensor, divisor: float) -> Tensor | None:
        """Unscale a window's summed gradients in place; return the device overflow flag (None: no scaling)."""
        self._overflow_on_host = None
        if self.scaler is None:
            if divisor != 1:
                flat_gradients.div_(divisor)
            return None
        return self.scaler.check_and_unscale_(flat_gradients, divisor)

    def window_overflowed(self, found_inf: Tensor | None) -> bool:
        """The overflow flag on the host; read at most once per window."""
        if found_inf is None or self.scaler is None or not self.scaler.skips_overflow:
            return False
        if self._overflow_on_host is None:
            self._overflow_on_host = bool(found_inf.item())  # host sync: the one read of this window's flag
        return self._overflow_on_host

    def step_or_skip(self, optimizer: Optimizer, found_inf: Tensor | None, **kwargs: Any) -> Any:
        """Step the optimizer unless the window overflowed; on the device when the optimizer can skip there."""
        if found_inf is None or self.scaler is None or not self.scaler.skips_overflow:
            return optimizer.step(**kwargs)
        if _skips_on_device(optimizer):
            # the attributes torch's fused kernels read (torch.amp.GradScaler sets them on the optimizer the same way)
            vars(optimizer).update(grad_scale=None, found_inf=found_inf)
            try:
                return optimizer.step(**kwargs)
            finally:
                del vars(optimizer)["grad_scale"], vars(optimizer)["found_inf"]
        return None if self.window_overflowed(found_inf) else optimizer.step(**kwargs)

    def update_scale(self, found_inf: Tensor | None) -> None:
        if found_inf is not None and self.scaler is not None:
            self.scaler.update(found_inf)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Lightning's stock strategies: closure (scaled backward), unscale ``.grad``, clip, step or skip, update."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: nothing was backpropagated
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            self.scaler.to(grads[0].device)  # a no-op once the state is there
        self._overflow_on_host = None
        found_inf = self.scaler.found_inf
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self.scaler.scale.reciprocal())
        compat.precision_after_closure(self, model, optimizer)  # on_before_optimizer_step hooks, clipping
        result = self.step_or_skip(optimizer, found_inf, **kwargs)
        self.update_scale(found_inf)
        return result

    # ------------------------------------------------------------------ state
    @property
    def scale(self) -> float:
        """The current loss scale (1.0 without scaling). Synchronizes with the device."""
        return 1.0 if self.scaler is None else float(self.scaler.scale.item())

    @property
    def skipped_updates(self) -> int:
        """Windows skipped because of overflow so far. Synchronizes with the device."""
        return 0 if self.scaler is None else int(self.scaler.skipped.item())

    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"loss_scaler": self.scaler.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])

    def __repr__(self) -> str:
        return f"LossScalePrecision(precision={self.precision!r}, loss_scale={self.loss_scale!r})"
