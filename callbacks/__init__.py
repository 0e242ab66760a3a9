"""Top-level alias of :mod:`lightning_sink.callbacks` (the canonical import, which nothing in a user's project shadows).

This package imports ``lightning_sink``; ``lightning_sink`` never imports it.
"""

from lightning_sink.callbacks import LossMonitor, LossScaleMonitor, NonFiniteLossError, ReshardCheckpoint, TimeMonitor

__all__ = ["LossMonitor", "NonFiniteLossError", "TimeMonitor", "LossScaleMonitor", "ReshardCheckpoint"]
