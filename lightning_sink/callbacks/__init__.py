"""MindSpore's monitoring callbacks for Lightning: ``LossMonitor``, ``TimeMonitor``, ``LossScaleMonitor`` and
``ReshardCheckpoint``.

The rest of ``lightning_sink`` never imports this package, so the strategies and plugins load without it.
"""

from lightning_sink.callbacks.loss_monitor import LossMonitor, NonFiniteLossError
from lightning_sink.callbacks.loss_scale_monitor import LossScaleMonitor
from lightning_sink.callbacks.reshard_checkpoint import ReshardCheckpoint
from lightning_sink.callbacks.time_monitor import TimeMonitor

__all__ = ["LossMonitor", "NonFiniteLossError", "TimeMonitor", "LossScaleMonitor", "ReshardCheckpoint"]
