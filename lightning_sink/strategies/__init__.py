"""Lightning strategies that run lightning-sink's step programs."""

from lightning_sink.strategies.ddp import SinkDDPStrategy
from lightning_sink.strategies.model_parallel import SinkModelParallelStrategy
from lightning_sink.strategies.single import SinkStrategy

__all__ = ["SinkStrategy", "SinkDDPStrategy", "SinkModelParallelStrategy"]
