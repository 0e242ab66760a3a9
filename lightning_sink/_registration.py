"""The strategies' names in Lightning's strategy registry, registered once Lightning itself is loaded.

``import lightning_sink`` must make ``Trainer(strategy="sink")`` work, whichever of the two packages a script
imports first, without importing Lightning itself: the ``lightning-sink reshard`` and ``verify`` commands need no
Lightning, and importing it (with torchmetrics) costs them seconds of start-up and hundreds of MiB. So:

- the names are registered with a factory that imports the strategy class when Lightning builds a strategy by name;
  registering imports nothing of this package, so it can happen in the middle of any import (a script's first
  Lightning import may come from inside ``lightning_sink.precision``, whose names the strategies need);
- when Lightning is not loaded yet, a finder on ``sys.meta_path`` waits for ``lightning.pytorch`` to be imported and
  registers right after that package has run; it finds nothing itself and removes itself on first use.

``STRATEGY_NAMES`` repeats what the classes' own ``register_strategies`` say; a test keeps the two equal.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["STRATEGY_NAMES", "register_strategies", "register_when_lightning_loads"]

_LIGHTNING = "lightning.pytorch"

# registry name -> (class in lightning_sink.strategies, description, init params)
STRATEGY_NAMES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "sink": ("SinkStrategy", "Two-step-program gradient accumulation on one device (lightning-sink)", {}),
    "sink_ddp": ("SinkDDPStrategy", "Two-step-program gradient accumulation on DDP (lightning-sink)", {}),
    "sink_ddp_spawn": (
        "SinkDDPStrategy",
        "SinkDDPStrategy with spawned processes (lightning-sink)",
        {"start_method": "spawn"},
    ),
    "sink_model_parallel": (
        "SinkModelParallelStrategy",
        "Two-step-program gradient accumulation on FSDP2 + tensor parallelism (lightning-sink)",
        {},
    ),
}


def _factory(class_name: str) -> Callable[..., Any]:
    def build(**init_params: Any) -> Any:
        from lightning_sink import strategies

        return getattr(strategies, class_name)(**init_params)

    build.__qualname__ = build.__name__ = f"lightning_sink.strategies.{class_name}"
    return build


def register_strategies() -> None:
    """Add ``STRATEGY_NAMES`` to Lightning's registry (names already there are left as they are)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (class_name, description, init_params) in STRATEGY_NAMES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, _factory(class_name), description=description, **init_params)


def register_when_lightning_loads() -> None:
    """Register now if Lightning is loaded, else as soon as it is."""
    if _LIGHTNING in sys.modules:
        register_strategies()
    elif not any(isinstance(finder, _AfterLightningLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightningLoads())


class _AfterLightningLoads(importlib.abc.MetaPathFinder):
    """Asks the other finders for ``lightning.pytorch``'s spec and makes its loader register the strategy names
    after running the package."""

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

            vars(spec.loader)["exec_module"] = exec_module  # this spec's own loader object, made for this import
        return spec
