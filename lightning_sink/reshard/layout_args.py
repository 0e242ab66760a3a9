"""The layout arguments of the transform API, MindSpore-style: a strategy file path, a :class:`Layout`, or None."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_sink.layout.io import load_layout
from lightning_sink.layout.schema import Layout

__all__ = ["LayoutArg", "target_layout", "source_layout_path"]

LayoutArg = str | os.PathLike | Layout | None


def target_layout(value: LayoutArg, name: str) -> Layout:
    """The target layout ``value`` gives (``name``: the argument, for the error when it is missing)."""
    if isinstance(value, Layout):
        return value
    if value is None:
        raise ValueError(
            f"{name} is required for the target (a layout file such as the one `lightning-sink layout` writes)"
        )
    return load_layout(value)


def source_layout_path(value: LayoutArg) -> Path | None:
    """The source layout file ``value`` names; None lets the source give its own."""
    if isinstance(value, Layout):
        raise TypeError("src_strategy_file must be a path (or None to use the checkpoint's own layout), not a Layout")
    return None if value is None else Path(value)
