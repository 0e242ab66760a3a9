"""``self.log`` inside a sink: recorded on the device per micro-step, handed to Lightning once per sink.

Lightning's ``self.log`` costs about 0.1 ms a call on CPU (validation, metadata, result bookkeeping), which is a
fifth of a small model's whole step; a sink of K micro-steps would pay it K times per key although Lightning reads
the values only once, at the sink's end (a sink is one Lightning batch). ``SinkLogBuffer`` stands in for
``LightningModule.log`` while a sink runs: each call appends the value (a device tensor, nothing is read back) and
its micro-batch size. At the end of the sink every key goes to the real ``self.log`` at most twice, so that
Lightning's results are what K calls would have made them:

- the step value (what the logger and progress bar show for this step) is the last micro-step's value;
- the epoch aggregate (``on_epoch=True``) covers every micro-step: the first call carries the other micro-steps,
  reduced with the key's ``reduce_fx`` (for "mean", their batch-size-weighted mean with their summed batch size),
  the second the last micro-step.

The batch size of an ``on_epoch`` mean is taken from the micro-batch itself, as Lightning takes it from its batch
(Lightning's own batch in sink mode is a placeholder with no size). Calls the buffer does not reduce (a torchmetrics
``Metric``, ``enable_graph=True``, another ``reduce_fx``, a value Lightning would reject) go to the real
``self.log`` at once, as before.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

__all__ = ["SinkLogBuffer"]

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
# reduce_fx values whose K-step result the buffer can rebuild from a reduced prefix and the last value.
_REDUCTIONS: dict[Any, str] = {"mean": "mean", "avg": "mean", torch.mean: "mean", "sum": "sum", torch.sum: "sum",
                               "max": "max", torch.max: "max", "min": "min", torch.min: "min"}


@dataclass
class _Key:
    """One logged name's calls during a sink, all with the same options (Lightning refuses differing ones)."""

    options: dict[str, Any]
    reduction: str
    values: list[Tensor] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)


class SinkLogBuffer:
    """Records a LightningModule's ``self.log`` calls during one sink; ``flush`` hands them to Lightning."""

    def __init__(self, module: pl.LightningModule) -> None:
        self._module = module
        self._keys: dict[str, _Key] = {}
        self._micro_batch: Any = None
        self._micro_batch_size: int | None = None
        self._real_log: Callable[..., None] | None = None
        self._log = torch.compiler.disable(self.log)  # a graph break under graph_mode="compile", as Lightning's

    @staticmethod
    def usable(module: pl.LightningModule) -> bool:
        """Not for a module that defines its own ``log``: it would no longer be called per micro-step."""
        return not is_overridden("log", module, pl.LightningModule)

    # ------------------------------------------------------------------ around a sink
    def install(self) -> None:
        self._real_log = self._module.log
        self._module.log = self._log  # an instance attribute; ``log_dict`` calls ``self.log`` and lands here too

    def uninstall(self) -> None:
        self._module.__dict__.pop("log", None)
        self._keys.clear()
        self._micro_batch = None

    def begin_micro_step(self, batch: Any) -> None:
        self._micro_batch, self._micro_batch_size = batch, None

    # ------------------------------------------------------------------ the stand-in for self.log
    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        call = _LOG_SIGNATURE.bind(self._module, name, value, *args, **kwargs)
        call.apply_defaults()
        options = dict(call.arguments)
        del options["self"], options["name"], options["value"]
        batch_size = options.pop("batch_size")  # may differ per call (a last, smaller micro-batch), as in Lightning
        reduction = _REDUCTIONS.get(options["reduce_fx"])
        tensor = _as_scalar_tensor(value, self._module.device)
        if reduction is None or tensor is None or options["enable_graph"] or "/dataloader_idx_" in name:
            self._real_log(name, value, *args, **kwargs)  # Lightning handles it (or raises its own error)
            return
        # Lightning's defaults inside training_step: on_step=True, on_epoch=False
        options["on_step"] = True if options["on_step"] is None else options["on_step"]
        options["on_epoch"] = False if options["on_epoch"] is None else options["on_epoch"]
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = _Key(options, reduction)
        elif key.options != options:
            raise ValueError(
                f"self.log({name!r}, ...) was called with different arguments in one sink: {key.options} and then"
                f" {options}. Log each name with the same arguments on every step."
            )
        key.values.append(tensor)
        key.batch_sizes.append(self._batch_size(batch_size, options))

    def _batch_size(self, given: int | None, options: dict[str, Any]) -> int:
        if given is not None:
            return int(given)
        if not (options["on_epoch"] and _REDUCTIONS[options["reduce_fx"]] == "mean"):
            return 1  # unused by Lightning: only an epoch mean is weighted
        if self._micro_batch_size is None:
            self._micro_batch_size = extract_batch_size(self._micro_batch)
        return self._micro_batch_size

    # ------------------------------------------------------------------ at the sink's end
    def flush(self) -> None:
        """Hand every recorded key to the real ``self.log``: the reduced earlier steps, then the last step."""
        for name, key in self._keys.items():
            values = torch.stack([_to_log_dtype(value) for value in key.values])
            if key.options["on_epoch"] and len(values) > 1:
                earlier, earlier_size = _reduce(values[:-1], key.batch_sizes[:-1], key.reduction)
                self._real_log(name, earlier, batch_size=earlier_size, **key.options)
            self._real_log(name, values[-1], batch_size=key.batch_sizes[-1], **key.options)
        self._keys.clear()


def _as_scalar_tensor(value: Any, device: torch.device) -> Tensor | None:
    """The value as a one-element tensor on the module's device, or None when it is not one."""
    if isinstance(value, Tensor):
        return value.detach() if value.numel() == 1 else None
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return torch.tensor(value, dtype=torch.get_default_dtype(), device=device)  # as Lightning converts numbers
    return None


def _to_log_dtype(value: Tensor) -> Tensor:
    """Lightning keeps logged values in float32 or float64 (it converts lower precisions and integers)."""
    value = value.reshape(())
    return value if value.dtype in (torch.float32, torch.float64) else value.to(torch.get_default_dtype())


def _reduce(values: Tensor, batch_sizes: list[int], reduction: str) -> tuple[Tensor, int]:
    """One value (and batch size) that Lightning's accumulation turns into the same result as the given steps."""
    if reduction == "mean":
        total = sum(batch_sizes)
        if len(set(batch_sizes)) == 1:
            return values.mean(), total
        # Python-number weights: a weight tensor would be a host-to-device copy, which waits for the device
        return torch.stack([value * size for value, size in zip(values, batch_sizes)]).sum() / total, total
    if reduction == "sum":
        return values.sum(), 1
    return (values.max() if reduction == "max" else values.min()), 1
