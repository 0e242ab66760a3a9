"""The autocast region a step program's forward runs in: mixed precision inside the compiled programs.

A mixed-precision plugin runs ``training_step`` under ``torch.autocast(device_type, dtype)`` and the backward outside
it. The programs do the same: the forward (``functional_call`` of ``training_step``) is traced by ``torch.compile``
inside ``torch.autocast`` with these settings, the gradients are taken outside it, and the window's sum stays in fp32
buffers. ``entered_by`` reads the settings from whatever context a caller's plugin enters, through torch's own
autocast state, so the programs run the plugin's autocast rather than a rebuilt copy of its rules.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

__all__ = ["AutocastRegion"]

_DTYPES = (torch.float16, torch.bfloat16)


def _autocast_runs_on(device_type: str) -> bool:
    try:
        return torch.amp.is_autocast_available(device_type)
    except RuntimeError:  # not a device type torch knows
        return False


@dataclass(frozen=True)
class AutocastRegion:
    """``torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled)`` around each program's forward."""

    device_type: str
    dtype: torch.dtype
    cache_enabled: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.device_type, str) or not _autocast_runs_on(self.device_type):
            raise ValueError(
                f"device_type={self.device_type!r} is not valid: pass a device type autocast runs on ('cpu', 'cuda')"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not valid: pass torch.float16 or torch.bfloat16")
        if not isinstance(self.cache_enabled, bool):
            raise ValueError(f"cache_enabled={self.cache_enabled!r} is not valid: pass True or False")

    @classmethod
    def entered_by(cls, context: AbstractContextManager[object], device_type: str) -> AutocastRegion | None:
        """The autocast ``context`` enters for ``device_type``, read from torch's state inside it (None: it enters
        none there). Only the autocast is read: the caller vouches that the context does nothing else."""
        with context:
            if not torch.is_autocast_enabled(device_type):
                return None
            return cls(device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled())
