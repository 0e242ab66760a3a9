"""Whether a checkpoint saved inside an accumulation window can be resumed with this run's settings.

A window's partial gradient sum only means something for the settings it was accumulated under: with another
``accumulation_steps`` the window would close after another number of micro-batches, with another ``sink_size`` or
``partial_window`` it would close at another point of the data. At a window boundary nothing is open, and the
settings may change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_sink.strategies.sink_state_check import window_micro_batches

__all__ = ["WINDOW_SETTINGS", "check_resume_settings"]

# The strategy arguments a checkpoint records next to its window (its ``lightning_sink`` state).
WINDOW_SETTINGS = ("accumulation_steps", "sink_size", "partial_window")


def check_resume_settings(saved: Mapping[str, Any], current: Mapping[str, Any], checkpoint_path: Any) -> None:
    """Raise ``ValueError`` naming both values when ``saved`` (a checkpoint's state) has an open window that
    ``current`` (this run's settings) would close differently. Settings the checkpoint did not record pass."""
    window = saved.get("window") or {}
    steps = saved.get("accumulation_steps")
    done = window_micro_batches(window, steps if isinstance(steps, int) else None)
    if done == 0:
        return
    for name in WINDOW_SETTINGS:
        if name in saved and name in current and saved[name] != current[name]:
            raise ValueError(
                f"{checkpoint_path}: the checkpoint was saved inside an accumulation window ({done} micro-steps done)"
                f" with {name}={saved[name]!r}, but this run has {name}={current[name]!r}. Resume with"
                f" {name}={saved[name]!r}, or from a checkpoint saved at a window boundary."
            )
