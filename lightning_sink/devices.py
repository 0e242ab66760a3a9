"""Whether a device exists on this machine, for the arguments that name one (a strategy's ``device``, a precision
plugin's autocast device): refused at construction, naming the value and what this machine has, instead of a raw
torch error once the fit has started."""

from __future__ import annotations

import torch

__all__ = ["missing_device_reason", "available_device_types"]

# Device types that are not a place to train: torch knows them (``torch.device("meta")``), but no accelerator runs there.
_NOT_TRAINING_DEVICES = ("meta",)


def _count(device_type: str) -> int:
    """Devices of ``device_type`` on this machine (CPU: one). Counting does not initialize CUDA."""
    if device_type == "cpu":
        return 1
    if device_type == "mps":
        return 1 if torch.backends.mps.is_available() else 0
    module = getattr(torch, device_type, None)  # torch.cuda, torch.xpu, ... (a backend's own module)
    is_available = getattr(module, "is_available", None)
    device_count = getattr(module, "device_count", None)
    if not (callable(is_available) and callable(device_count)) or not is_available():
        return 0
    return int(device_count())


def available_device_types() -> list[str]:
    """The device types with at least one device on this machine (``cpu`` always), for error messages."""
    return [name for name in ("cpu", "cuda", "mps", "xpu") if _count(name) > 0]


def missing_device_reason(device: torch.device) -> str | None:
    """``None`` when ``device`` exists on this machine; otherwise why not, in words."""
    if device.type in _NOT_TRAINING_DEVICES:
        return f"{device.type!r} is not a device to train on"
    count = _count(device.type)
    if count == 0:
        return f"this machine has no {device.type!r} device"
    if device.index is not None and device.index >= count:
        return f"this machine has {count} {device.type!r} device(s), numbered from 0"
    return None
