"""The strategies' names in Lightning's strategy registry, registered once Lightning itself is loaded.

``import lightning_sink`` must make ``Trainer(strategy="sink")`` work, whichever of the two packages a script
imports first, without importing Lightning itself: the ``lightning-sink reshard`` and ``verify`` commands need no
Lightning, and importing it (with torchmetrics) costs them seconds of start-up and hundreds of MiB. So when
Lightning is not loaded yet, a finder on ``sys.meta_path`` waits for ``lightning.pytorch`` to be imported and
registers the strategies right after that package has run; it finds nothing itself and removes itself on first use.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["register_strategies", "register_when_lightning_loads"]

_LIGHTNING = "lightning.pytorch"


def register_strategies() -> None:
    """Add ``sink``, ``sink_ddp``, ``sink_ddp_spawn`` and ``sink_model_parallel`` to Lightning's registry."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_sink.strategies import SinkDDPStrategy, SinkModelParallelStrategy, SinkStrategy

    for strategy in (SinkStrategy, SinkDDPStrategy, SinkModelParallelStrategy):
        if strategy.strategy_name not in StrategyRegistry:
            strategy.register_strategies(StrategyRegistry)


def register_when_lightning_loads() -> None:
    """Register now if Lightning is loaded, else as soon as it is."""
    if _LIGHTNING in sys.modules:
        register_strategies()
    elif not any(isinstance(finder, _AfterLightningLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightningLoads())


class _AfterLightningLoads(importlib.abc.MetaPathFinder):
    """Asks the other finders for ``lightning.pytorch``'s spec and makes its loader register the strategies after
    running the package."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _LIGHTNING:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run_package = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run_package(module)
                register_strategies()

            spec.loader.exec_module = exec_module  # this spec's own loader object, made for this import
        return spec
