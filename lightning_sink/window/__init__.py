"""One accumulation window: where its gradient sum lives (store), how ranks combine it (reducer), and the update
that ends it (``finish_window``). The strategies only choose a store and a reducer."""

from lightning_sink.window.finish import WindowGradient, finish_window, ready_window_gradient
from lightning_sink.window.protocols import GradientStore, Reducer
from lightning_sink.window.reducers import (
    FlatAllReduce,
    NoReduction,
    OverflowFlagAllReduce,
)
from lightning_sink.window.stores import NoGradients

__all__ = [
    "GradientStore",
    "Reducer",
    "NoGradients",
    "NoReduction",
    "FlatAllReduce",
    "OverflowFlagAllReduce",
    "WindowGradient",
    "finish_window",
    "ready_window_gradient",
]
