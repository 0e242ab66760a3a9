"""A data pass's partial last batch under compiled programs: trained by the eager pair, not compiled for.

A loader that keeps its last samples as a smaller batch (``drop_last=False``, the default) ends each data pass with
a batch of another shape than the programs were built for. Compiled for, it would cost a build of the one-micro-step
pair (a fit whose calls of several take every other micro-batch builds none) and a compile for its shape, often
longer than the rest of a short fit, for one micro-batch a pass. The eager pair trains it instead, with the module's
own ``training_step`` (not the forward the graph mode compiles, which would compile for its shape too), as a
``graph_mode="eager"`` sink trains every micro-batch; the compiled programs take over again at the next one.

The open window moves with it (``WindowHandover``): into the window's store before, where the eager pair adds to
it, and back into the programs' buffers after (or, where the eager update closed the window, the programs' copy
emptied). Parameters, buffers and the optimizer's state are the module's and the optimizer's own tensors, which
both paths read and write in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from lightning_sink.sink.programs.eager import PairCall, SinkUpdates, choose_programs
from lightning_sink.sink.programs.window_handover import WindowHandover
from lightning_sink.strategies.engine import StepEngine

__all__ = ["PartialBatchCall"]


class PartialBatchCall:
    """A call of one micro-batch, a data pass's partial last batch, trained by the eager pair (a ``SeveralSteps``
    of one)."""

    def __init__(self, engine: StepEngine, updates: SinkUpdates, handover: WindowHandover) -> None:
        self._engine, self._updates, self._handover = engine, updates, handover

    def length_within(self, room: int) -> int:
        return min(room, 1)

    def ready(self) -> bool:
        return True

    def run(self, batches: list[Any], batch_idx: int) -> list[Callable[[], Tensor | None]]:
        eager = choose_programs(self._engine, self._updates)
        (train,) = PairCall(eager, self._engine).run(batches, batch_idx)
        divisor = eager.update.loss_divisor
        return [lambda: self._trained_eagerly(train, divisor)]

    def _trained_eagerly(self, train: Callable[[], Tensor | None], divisor: int) -> Tensor | None:
        engine, handover = self._engine, self._handover
        window = engine.window
        handover.into_store()
        compiled_divisor = window.loss_divisor
        window.divide_losses_by(divisor)
        compiled_step = engine.swap_step_function()
        try:
            return train()
        finally:
            engine.swap_step_function(compiled_step)
            window.divide_losses_by(compiled_divisor)
            handover.into_programs()
