"""lightning-sink callbacks: MindSpore's monitoring callbacks for Lightning (top-level package per the design card).

This package may import ``lightning_sink``; ``lightning_sink`` never imports it.
"""

from callbacks.loss_monitor import LossMonitor, NonFiniteLossError
from callbacks.loss_scale_monitor import LossScaleMonitor
from callbacks.reshard_checkpoint import ReshardCheckpoint
from callbacks.time_monitor import TimeMonitor

__all__ = ["LossMonitor", "NonFiniteLossError", "TimeMonitor", "LossScaleMonitor", "ReshardCheckpoint"]
