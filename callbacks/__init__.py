"""lightning-sink callbacks: MindSpore's monitoring callbacks for Lightning (top-level package per the design card).

This package may import ``lightning_sink``; ``lightning_sink`` never imports it. ``ReshardCheckpoint`` (issue 7)
is not here yet: it needs the resharding engine.
"""

from callbacks.loss_monitor import LossMonitor, NonFiniteLossError
from callbacks.loss_scale_monitor import LossScaleMonitor
from callbacks.time_monitor import TimeMonitor

__all__ = ["LossMonitor", "NonFiniteLossError", "TimeMonitor", "LossScaleMonitor"]
