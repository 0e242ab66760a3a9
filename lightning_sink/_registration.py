"""The strategies' names in Lightning's strategy registry, registered once Lightning itself is loaded.

``import lightning_sink`` must make ``Trainer(strategy="sink")`` work, whichever of the two packages a script
imports first, without importing Lightning itself: the ``lightning-sink reshard`` and ``verify`` commands need no
Lightning, and importing it (with torchmetrics) costs them seconds of start-up and hundreds of MiB. So:

- the names are registered with a factory that imports the strategy class when Lightning builds a strategy by name;
  registering imports nothing of this package, so it can happen in the middle of any import (a script's first
  Lightning import may come from inside ``lightning_sink.precision``, whose names the strategies need);
- when Lightning is not loaded yet, a finder on ``sys.meta_path`` waits for ``lightning.pytorch`` to be imported and
  registers right after that package has run; it finds nothing itself and removes itself once it has nothing left
  to wait for.

Both Lightning namespaces are served the same way: ``lightning.pytorch``'s registry gets the factories of
``lightning_sink.strategies``, and the standalone ``pytorch_lightning`` package's registry, when that package is
imported, those of ``lightning_sink.pytorch_lightning.strategies`` (the same classes built on its bases; see
_namespace_mirror.py). Nothing here imports ``pytorch_lightning``: a machine without it never notices.

A name that is not registered but close to one of these ("sinkk") gets Lightning's own refusal with "did you mean"
added: the registry's list of names, which the Trainer asks whether it holds the name, answers for a close miss by
raising that error (``suggest_close_names``).

``STRATEGY_NAMES`` repeats what the classes' own ``register_strategies`` say; a test keeps the two equal.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.abc
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = [
    "NAMESPACES",
    "STRATEGY_NAMES",
    "register_strategies",
    "register_when_lightning_loads",
    "suggest_close_names",
]

# Lightning's trainer package -> the package of this project's strategies built on its classes.
NAMESPACES = {
    "lightning.pytorch": "lightning_sink.strategies",
    "pytorch_lightning": "lightning_sink.pytorch_lightning.strategies",
}

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


def _factory(strategies_package: str, class_name: str) -> Callable[..., Any]:
    # The strategies are imported by name (importlib), so that this module imports nothing Lightning-bound and is
    # one module for both namespaces.
    def build(**init_params: Any) -> Any:
        return getattr(importlib.import_module(strategies_package), class_name)(**init_params)

    build.__qualname__ = build.__name__ = f"{strategies_package}.{class_name}"
    return build


class _NamesWithSuggestion(list):
    """The registry's list of names, as the Trainer gets it; asked whether it holds a name that is missing but close
    to one of this package's, it raises Lightning's refusal with the close name. Asked about a strategy object of
    this package built on the other Lightning namespace, it raises a refusal that names the right import (the
    Trainer asks before it checks the object's class, and would otherwise say only "invalid strategy")."""

    trainer_package = "lightning.pytorch"

    def __contains__(self, name: object) -> bool:
        held = list(self)
        if not isinstance(name, str):
            _refuse_the_other_namespace(name, self.trainer_package)
        if name in held or not isinstance(name, str):
            return name in held
        close = difflib.get_close_matches(name, [n for n in STRATEGY_NAMES if n in held], n=1, cutoff=0.75)
        if close:
            raise ValueError(
                f"You selected an invalid strategy name: `strategy={name!r}`. Did you mean {close[0]!r}?"
                f" Registered names: {', '.join(sorted(self))}."
            )
        return False


def _refuse_the_other_namespace(strategy: object, trainer_package: str) -> None:
    """A sink strategy of ``lightning_sink`` handed to ``pytorch_lightning.Trainer`` (or the reverse): one line saying
    which import this Trainer takes."""
    cls = type(strategy)
    if not cls.__module__.startswith("lightning_sink.") or cls.__name__ not in {
        c for c, _, _ in STRATEGY_NAMES.values()
    }:
        return
    if isinstance(strategy, importlib.import_module(f"{trainer_package}.strategies").Strategy):
        return
    wanted = "lightning_sink.pytorch_lightning" if trainer_package == "pytorch_lightning" else "lightning_sink"
    given = (
        "lightning_sink.pytorch_lightning"
        if cls.__module__.startswith(NAMESPACES["pytorch_lightning"])
        else ("lightning_sink")
    )
    other = "pytorch_lightning" if trainer_package == "lightning.pytorch" else "lightning.pytorch"
    raise ValueError(
        f"strategy={cls.__name__}(...) from `{given}` is built on {other}, but this Trainer is {trainer_package}'s:"
        f" use `from {wanted} import {cls.__name__}` (or the name, strategy={_name_of(cls.__name__)!r})."
    )


def _name_of(class_name: str) -> str:
    return next(name for name, (cls, _, _) in STRATEGY_NAMES.items() if cls == class_name)


def suggest_close_names(registry: Any, trainer_package: str = "lightning.pytorch") -> None:
    """Make ``registry.available_strategies()`` (Lightning's source of the names a Trainer accepts) answer a close
    miss of this package's names with "did you mean"."""
    if getattr(registry.available_strategies, "suggests_close_names", False):
        return

    def available_strategies() -> list:
        names = _NamesWithSuggestion(registry.keys())
        names.trainer_package = trainer_package
        return names

    available_strategies.__dict__["suggests_close_names"] = True  # a mark on the function: installed once
    registry.available_strategies = available_strategies  # on this one registry object, shadowing its method


def register_strategies(trainer_package: str = "lightning.pytorch") -> None:
    """Add ``STRATEGY_NAMES`` to the registry of ``trainer_package`` (a key of ``NAMESPACES``), building the strategies
    of that namespace; names already there are left as they are."""
    registry = importlib.import_module(f"{trainer_package}.strategies").StrategyRegistry
    strategies_package = NAMESPACES[trainer_package]
    for name, (class_name, description, init_params) in STRATEGY_NAMES.items():
        if name not in registry:
            registry.register(name, _factory(strategies_package, class_name), description=description, **init_params)
    suggest_close_names(registry, trainer_package)


def register_when_lightning_loads() -> None:
    """Register in each namespace now if its package is loaded, else as soon as it is."""
    waiting = set()
    for trainer_package in NAMESPACES:
        if trainer_package in sys.modules:
            register_strategies(trainer_package)
        else:
            waiting.add(trainer_package)
    if waiting and not any(isinstance(finder, _AfterLightningLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightningLoads(waiting))


class _AfterLightningLoads(importlib.abc.MetaPathFinder):
    """Asks the other finders for a Lightning trainer package's spec and makes its loader register the strategy names
    after running the package."""

    def __init__(self, waiting: set[str]) -> None:
        self.waiting = waiting

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.waiting:
            return None
        self.waiting.discard(fullname)
        if not self.waiting:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run_package = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run_package(module)
                register_strategies(fullname)

            vars(spec.loader)["exec_module"] = exec_module  # this spec's own loader object, made for this import
        return spec
