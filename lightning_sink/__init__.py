"""lightning-sink: MindSpore's training-loop ideas as PyTorch Lightning plugins.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="sink")``,
``Trainer(strategy="sink_ddp")`` and ``Trainer(strategy="sink_model_parallel")`` work and LightningCLI configs can
name them by ``class_path``.
"""

from lightning.pytorch.strategies import StrategyRegistry

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


def _register_strategies() -> None:
    for strategy in (SinkStrategy, SinkDDPStrategy, SinkModelParallelStrategy):
        if strategy.strategy_name not in StrategyRegistry:
            strategy.register_strategies(StrategyRegistry)


_register_strategies()
