"""lightning-sink for the standalone ``pytorch_lightning`` package: the same names as ``lightning_sink``, built on
``pytorch_lightning``'s classes.

    import pytorch_lightning as pl
    from lightning_sink.pytorch_lightning import DynamicLossScale, LossScalePrecision, SinkStrategy
    from lightning_sink.pytorch_lightning.callbacks import LossMonitor

``import lightning_sink`` alone already makes ``pl.Trainer(strategy="sink")`` (and the other registered names) work
on a ``pytorch_lightning.Trainer``. The classes here are the package's own source compiled a second time with
``lightning.pytorch`` read as ``pytorch_lightning`` (see ``lightning_sink/_namespace_mirror.py`` and
docs/pytorch_lightning.md); the classes that do not touch Lightning (``DynamicLossScale``, ``FixedLossScale``,
``GradientAccumulator``) are the very same objects in both namespaces.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from lightning_sink import _HOMES
from lightning_sink import __all__ as _ROOT_NAMES
from lightning_sink import __version__ as __version__  # re-exported (named in __all__)
from lightning_sink import _namespace_mirror as mirror

if importlib.util.find_spec("pytorch_lightning") is None:
    raise ImportError(
        "lightning_sink.pytorch_lightning needs the pytorch_lightning package (pip install pytorch-lightning);"
        " with the lightning package, import from lightning_sink"
    )

mirror.install()

__all__ = list(_ROOT_NAMES)  # the same names as lightning_sink, on pytorch_lightning's classes


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(mirror.import_resolved(_HOMES[name].removeprefix("lightning_sink.")), name)
    elif importlib.util.find_spec(f"lightning_sink.{name}") is not None:
        value = mirror.import_resolved(name)  # a submodule, e.g. `from lightning_sink.pytorch_lightning import _x`
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
