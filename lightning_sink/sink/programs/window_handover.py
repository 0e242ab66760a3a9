"""An open window between sinks, under the compiled programs: during a sink the programs hold its fp32 sum in their
own device buffers (``ProgramWindow``); between sinks the window's store holds it, which the checkpoint saves and
the eager pair continues from. The sum moves only here: into the programs at a sink's start, back into the store at
its end (so a resume mid-window, or a window that runs on across sinks, continues exactly), and around a micro-batch
the eager pair trains (``sink/programs/partial_batch.py``)."""

from __future__ import annotations

from torch import Tensor

from lightning_sink.accumulation import GradientAccumulator
from lightning_sink.compiled import StepPrograms
from lightning_sink.window.state import Window

__all__ = ["WindowHandover"]


class WindowHandover:
    """Moves the open window's sum between ``window``'s store and ``programs``' buffers."""

    def __init__(self, programs: StepPrograms, window: Window) -> None:
        self.programs = programs
        self.window = window

    def into_programs(self) -> None:
        """At a sink's start: the open window's sum, from the store (where a resume or the last sink left it); an
        empty window's copy emptied (the eager pair may have closed the window the programs had begun)."""
        store = self.window.store
        if not store.micro_steps:
            self.programs.window.reset()
            return
        # the programs add whole losses' gradients: a sum of divided ones (the eager pair's, a checkpoint's) is
        # rescaled first
        self.window.divide_losses_by(1)
        for view, buffer in self._pairs():
            buffer.copy_(view)
        self.programs.window.micro_steps.fill_(float(store.micro_steps))

    def into_store(self) -> None:
        """At a sink's end: an open window's sum into the store, which the checkpoint saves."""
        store = self.window.store
        if not store.micro_steps:
            return
        for view, buffer in self._pairs():
            view.copy_(buffer)
        if isinstance(store, GradientAccumulator):
            store.attach()  # (the eager pair's next backward adds to it, as after a resume)

    def _pairs(self) -> list[tuple[Tensor, Tensor]]:
        """Pairs (the store's view of a parameter's sum, the programs' buffer of it)."""
        store = self.window.store  # (read each time: the engine replaces it when the trainable parameters change)
        if not isinstance(store, GradientAccumulator):
            return []  # windows of one micro-step: never open at a sink's end
        programs = self.programs
        buffers = {id(param): buffer for param, buffer in zip(programs.params, programs.window.buffers)}
        return [(view, buffers[id(param)]) for param, view in zip(store.params, store.views)]
