"""lightning-sink: MindSpore's training-loop ideas as PyTorch Lightning plugins.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="sink")`` and
``Trainer(strategy="sink_ddp")`` work and LightningCLI configs can name them by ``class_path``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_sink.accumulation import GradientAccumulator
from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale
from lightning_sink.precision import LossScalePrecision
from lightning_sink.strategies import SinkDDPStrategy, SinkStrategy

__all__ = [
    "SinkStrategy",
    "SinkDDPStrategy",
    "LossScalePrecision",
    "DynamicLossScale",
    "FixedLossScale",
    "GradientAccumulator",
    "__version__",
]
__version__ = "0.1.0"


def _register_strategies() -> None:
    for strategy in (SinkStrategy, SinkDDPStrategy):
        if strategy.strategy_name not in StrategyRegistry:
            strategy.register_strategies(StrategyRegistry)


_register_strategies()
