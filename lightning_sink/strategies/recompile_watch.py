"""Graph-mode guidance: a ``training_step`` that makes TorchDynamo recompile at every step is named in one warning.

Under ``graph_mode="compile"`` (and ``"cuda_graph"``) TorchDynamo compiles ``training_step`` for the Python values it
read (it guards on them): a list on ``self`` that grows at each step (``self.rec_losses.append(loss)`` guards
``len(self.rec_losses)``), an int attribute that changes (a step counter). Every step then fails a guard and
compiles the function anew, until TorchDynamo's recompile limit (8 versions), after which it runs the function
eagerly for the rest of the process and says so only in a log line: the run is slow, and nothing tells the user why.

``RecompileWatch`` counts each function's recompiles over the first sinks of a fit (at least twice the limit in
micro-batches, so that such a step reaches it) from TorchDynamo's own records, read at sink ends only (nothing per
micro-batch), and warns once when one function was recompiled at least half the limit's times. A clean step
recompiles a few times at most: TorchDynamo's automatic dynamic shapes settle a changing tensor size or Python int
argument (``batch_idx``) in one recompile each.
"""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_warn

from lightning_sink import _torch_compat

__all__ = ["RecompileWatch"]


class RecompileWatch:
    """Watches one fit's first sinks for a step that TorchDynamo recompiles again and again."""

    def __init__(self, sink_size: int, graph_mode: str) -> None:
        self._graph_mode = graph_mode
        self._limit = _torch_compat.recompile_limit()
        self._threshold = max(2, self._limit // 2)
        self._sinks = 1 if sink_size == -1 else -(-2 * self._limit // sink_size)  # ceil(2 * limit / sink_size)
        self._sinks_left = self._sinks
        # versions compiled before this fit (the same class trained earlier in the process shares the function)
        self._before = {function.code: function.versions for function in _torch_compat.recompiled_functions()}

    def sink_ended(self) -> None:
        if not self._sinks_left:
            return
        self._sinks_left -= 1
        worst, recompiles = None, 0
        for function in _torch_compat.recompiled_functions():
            new = function.versions - self._before.get(function.code, 1)
            if new > recompiles:
                worst, recompiles = function, new
        if worst is None or recompiles < self._threshold:
            return
        self._sinks_left = 0  # one warning per fit
        code, sinks = worst.code, self._sinks - self._sinks_left
        rank_zero_warn(
            f"graph_mode={self._graph_mode!r}: TorchDynamo recompiled {_torch_compat.user_function_name(code)}"
            f" ({code.co_filename}:{code.co_firstlineno}) {recompiles} times in the first"
            f" {'sink' if sinks == 1 else f'{sinks} sinks'} of this fit; the last guard that failed:"
            f" {worst.last_guard_failure}. Something the compiled step reads from Python changes at every step;"
            f" after {self._limit} versions TorchDynamo stops compiling it and runs it eagerly for the rest of the"
            " run. Usual causes: a list or dict on self that grows in training_step (self.losses.append(loss)) or"
            " its len(), a Python int attribute that changes per step (a step counter). Fix: keep such"
            " bookkeeping out of the compiled step: move it into a method decorated with @torch.compiler.disable"
            " (it runs eagerly, as self.log does), keep a running value in a tensor updated in place, or log it"
            " with self.log. See docs/sink_mode.md, 'Graph modes'."
        )
