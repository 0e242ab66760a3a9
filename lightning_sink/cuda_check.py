"""CUDA's availability check without the cost of a missing NVML (``CudaCheckDuringFit``).

Lightning sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` when it is imported, so that ``torch.cuda.is_available()`` asks
NVML instead of the CUDA runtime (whose check would keep a forked process from using CUDA). Where NVML's library is
not installed (a machine without an NVIDIA driver running torch's CUDA build, the usual ``pip install torch`` on
Linux), torch tries to load that library again at every call, fails, and asks the CUDA runtime after all. torch's
optimizers ask at every ``step`` and TorchDynamo at every traced operation, so on such a machine every eager update
and every operation of a compiled program's build paid a failed load of a shared library.

So for the duration of a fit a sink strategy sets the variable to ``0`` where NVML's library cannot be loaded: torch
then asks the CUDA runtime at once, the check it made anyway, and every answer stays what it was. The variable is
given back at the fit's end. Where the library loads, or the variable is not Lightning's ``1``, nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

__all__ = ["CudaCheckDuringFit", "nvml_loads"]

VARIABLE = "PYTORCH_NVML_BASED_CUDA_CHECK"
NVML_LIBRARY = "libnvidia-ml.so.1"  # the name torch.cuda loads it by


@functools.cache
def nvml_loads() -> bool:
    """Whether NVML's library can be loaded in this process (torch.cuda's NVML check loads it the same way)."""
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return False
    return True


class CudaCheckDuringFit:
    """Sets ``PYTORCH_NVML_BASED_CUDA_CHECK`` from Lightning's ``1`` to ``0`` between ``begin`` and ``end`` where NVML's
    library cannot be loaded (see the module's docstring); ``nvml_available`` answers whether it can."""

    def __init__(self, nvml_available: Callable[[], bool] = nvml_loads) -> None:
        self._nvml_available = nvml_available
        self._changed = False

    def begin(self) -> None:
        if self._changed or os.environ.get(VARIABLE) != "1" or self._nvml_available():
            return
        os.environ[VARIABLE] = "0"
        self._changed = True

    def end(self) -> None:
        """Give Lightning's setting back (unless something else changed the variable meanwhile)."""
        if self._changed and os.environ.get(VARIABLE) == "0":
            os.environ[VARIABLE] = "1"
        self._changed = False
