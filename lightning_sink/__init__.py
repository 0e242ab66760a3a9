"""lightning-sink: MindSpore's training-loop ideas as PyTorch Lightning plugins.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="sink")``,
``Trainer(strategy="sink_ddp")`` and ``Trainer(strategy="sink_model_parallel")`` work and LightningCLI configs can
name them by ``class_path``. The names below load on first use, and the registration waits until Lightning is
loaded (see _registration.py): the resharding tools, which need no Lightning, start without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_sink._registration import register_when_lightning_loads

if TYPE_CHECKING:
    from lightning_sink.accumulation import GradientAccumulator
    from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale
    from lightning_sink.precision import LossScalePrecision
    from lightning_sink.strategies import SinkDDPStrategy, SinkModelParallelStrategy, SinkStrategy

__all__ = [
    "SinkStrategy",
    "SinkDDPStrategy",
    "SinkModelParallelStrategy",
    "LossScalePrecision",
    "DynamicLossScale",
    "FixedLossScale",
    "GradientAccumulator",
    "__version__",
]
__version__ = "0.1.0"

_HOMES = {
    "SinkStrategy": "lightning_sink.strategies",
    "SinkDDPStrategy": "lightning_sink.strategies",
    "SinkModelParallelStrategy": "lightning_sink.strategies",
    "LossScalePrecision": "lightning_sink.precision",
    "DynamicLossScale": "lightning_sink.loss_scale",
    "FixedLossScale": "lightning_sink.loss_scale",
    "GradientAccumulator": "lightning_sink.accumulation",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'lightning_sink' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


register_when_lightning_loads()
