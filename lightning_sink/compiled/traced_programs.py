"""The step programs' bodies, as ``torch.compile`` traces them: every tensor they read or write comes in through
``state`` (the parameters, buffers, optimizer state, hyperparameters, window buffers and loss-scale state), and
whatever they change they write back into it in place.

- ``accumulate_program``: a micro-batch's gradients added into the window's fp32 buffers;
- ``update_program``: the window's last micro-batch, the sum (across processes too, under ``RankSum(group=...)``)
  and the window's update (``WindowUpdate``);
- ``update_sum_program`` / ``update_apply_program``: the same update in two parts for ``RankSum(all_reduce=...)``,
  the eager all-reduce of the flat bucket between them;
- ``several_program``: whole windows of micro-steps unrolled into one program.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_sink._torch_compat import traced_all_reduce_sum
from lightning_sink.compiled.rank_sum import flatten_bucket, unflatten_bucket
from lightning_sink.compiled.step_gradients import StepGradients
from lightning_sink.compiled.window_update import WindowUpdate

__all__ = ["TracedPrograms"]


class TracedPrograms:
    """The programs of one module and optimizer, before compiling (``StepPrograms`` compiles each method)."""

    def __init__(self, gradients: StepGradients, update: WindowUpdate, several: tuple[int, int] | None) -> None:
        self.gradients, self.update = gradients, update
        # several micro-steps per call: (micro-steps per call, accumulation steps), the call ending on an update
        self.several = several

    def accumulate_program(self, state: dict[str, Any], batch: Any) -> tuple[Tensor, tuple, dict]:
        grads, loss, values, options = self.gradients.of(state, batch)
        for buffer, grad in zip(state["window"], grads):
            buffer.add_(grad.to(buffer.dtype))
        state["micro_steps"].add_(1)
        return loss, values, options

    def update_program(self, state: dict[str, Any], batch: Any) -> tuple[Tensor, tuple, dict, Tensor | None]:
        sums, loss, values, options = self._window_sums(state, batch)
        rank_sum = self.update.rank_sum
        if rank_sum is not None:  # (traced route: the eager one runs the two parts below instead)
            sums = unflatten_bucket(traced_all_reduce_sum(flatten_bucket(sums), rank_sum.group), sums)
        return loss, values, options, self.update.apply(state, sums)

    def update_sum_program(self, state: dict[str, Any], batch: Any) -> tuple[Tensor, tuple, dict, Tensor]:
        """The eager route's first part: the last micro-batch and the window's sum, as one flat bucket."""
        sums, loss, values, options = self._window_sums(state, batch)
        return loss, values, options, flatten_bucket(sums)

    def update_apply_program(self, state: dict[str, Any], flat: Tensor) -> Tensor | None:
        """The eager route's second part, on the bucket summed over the ranks: the rest of the update."""
        return self.update.apply(state, unflatten_bucket(flat, state["window"]))

    def _window_sums(self, state: dict[str, Any], batch: Any) -> tuple[list[Tensor], Tensor, tuple, dict]:
        """The window's last micro-batch, added to its sum (in new tensors: the buffers are reset after the update)."""
        grads, loss, values, options = self.gradients.of(state, batch)
        sums = [buffer + grad.to(buffer.dtype) for buffer, grad in zip(state["window"], grads)]
        return sums, loss, values, options

    def several_program(self, state: dict[str, Any], batches: list[Any]) -> list[tuple]:
        """``len(batches)`` micro-steps unrolled into one program: an update at each window's last micro-batch."""
        assert self.several is not None  # built with micro_steps_per_call
        accumulation = self.several[1]
        outputs: list[tuple[Any, ...]] = []
        scaler = state["scaler"]
        names = self.update.rule.names
        for position, batch in enumerate(batches):
            if (position + 1) % accumulation == 0:
                window = position // accumulation
                hyper = [dict(zip(names, table[window].unbind())) for table in state["hyper_table"]]
                result: tuple[Any, ...] = self.update_program({**state, "hyper": hyper}, batch)
                if scaler is not None:
                    result = (*result, scaler["scale"].clone(), scaler["skipped"].clone())
                outputs.append(result)
            else:
                outputs.append(self.accumulate_program(state, batch))
        return outputs
