"""Lightning strategies that run lightning-sink's step programs.

The names load on first use: the sink package (``lightning_sink.sink``) imports the engine from here, and a package
``__init__`` that imported the strategies at once would import the sink loop half-initialised when a sink module is
imported first. The imports are statements (not strings) so that the ``pytorch_lightning`` mirror renames them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_sink.strategies.ddp import SinkDDPStrategy
    from lightning_sink.strategies.model_parallel import SinkModelParallelStrategy
    from lightning_sink.strategies.single import SinkStrategy

__all__ = ["SinkStrategy", "SinkDDPStrategy", "SinkModelParallelStrategy"]


def __getattr__(name: str) -> Any:
    value: Any
    if name == "SinkStrategy":
        from lightning_sink.strategies.single import SinkStrategy as value
    elif name == "SinkDDPStrategy":
        from lightning_sink.strategies.ddp import SinkDDPStrategy as value
    elif name == "SinkModelParallelStrategy":
        from lightning_sink.strategies.model_parallel import SinkModelParallelStrategy as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
