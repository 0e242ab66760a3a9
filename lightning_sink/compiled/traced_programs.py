"""The step programs' bodies, as ``torch.compile`` traces them: every tensor they read or write comes in through
``state`` (the parameters, buffers, optimizer state, hyperparameters, window buffers and loss-scale state), and
whatever they change they write back into it in place.

- ``accumulate_program``: a micro-batch's gradients added into the window's fp32 buffers;
- ``update_program``: the window's last micro-batch, the sum (across processes too, under ``RankSum(group=...)``)
  and the window's update (``WindowUpdate``);
- ``update_sum_program`` / ``update_apply_program``: the same update in two parts for ``RankSum(all_reduce=...)``,
  the eager all-reduce of the flat bucket between them;
- ``several_program``: whole windows of micro-steps as one loop over the windows (a program whose build does not
  grow with the call's length).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor

from lightning_sink._torch_compat import scan_loop, traced_all_reduce_sum, tree_map
from lightning_sink.compiled.flat_carry import FlatCarry
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

    def several_program(self, state: dict[str, Any], call: dict[str, Any]) -> list[tuple]:
        """Whole windows of micro-steps as one loop over the windows (torch's ``scan``: its body, one window with an
        update at its last micro-batch, is traced and built once, whatever the call's length). ``call``:
        ``"hyper"``, per param group the rows of hyperparameters of the call's windows, one row a window (their
        count, like the stacked batches' first size, is the call's windows: a size the graph may leave open, so one
        graph serves calls of any number of windows, ``CompiledPrograms``); ``"batches"``, the call's micro-batches
        stacked per leaf of the batch as [windows, accumulation, ...], or None where the programs gather each batch
        from the staged dataset themselves.
        The loop carries every state tensor the programs write but the window's (empty at each window's start and
        end), packed into one flat tensor per dtype and device (``FlatCarry``) and unpacked into copies the body
        writes in place, and the state takes the last carry back at the end. Returns, per
        position in a window, its outputs stacked over the windows (an update's with its found_inf, scale and
        skipped count under a loss scale); the host takes each micro-step's row (a graph returning every row would
        grow with the call's length)."""
        assert self.several is not None  # built with micro_steps_per_call
        accumulation = self.several[1]
        batches = call["batches"]
        staged = batches is None
        xs: dict[str, Any] = {"hyper": call["hyper"]}
        if not staged:
            xs["batches"] = batches

        carried = _carry(state)
        flat = FlatCarry(carried)

        def window(carry: list[Tensor], x: dict[str, Any]) -> tuple[list[Tensor], list[tuple]]:
            local = _with_carry(state, flat.unpack(carry))
            # the window's sum and count: every window of a call starts empty (a call starts at a window's start)
            # and its update empties it, so they live in the body alone, not in the loop's carry
            local["window"] = [buffer.new_zeros(buffer.shape) for buffer in state["window"]]
            local["micro_steps"] = state["micro_steps"].new_zeros(())
            local["hyper"] = [dict(zip(self.update.rule.names, row.unbind())) for row in x["hyper"]]
            outputs: list[tuple] = []
            for position in range(accumulation):
                batch = None if staged else tree_map(partial(_row, position), x["batches"])
                if position + 1 < accumulation:
                    loss, values, _ = self.accumulate_program(local, batch)
                    outputs.append((loss, values))
                    continue
                loss, values, _, found_inf = self.update_program(local, batch)
                scaler = local["scaler"]
                extra = () if scaler is None else (found_inf, scaler["scale"], scaler["skipped"])
                outputs.append((loss, values, *extra))
            # (copies: a loop's outputs may not alias its carry or one another)
            return flat.pack(_carry(local)), tree_map(_copy, outputs)

        last, stacked = scan_loop(window, flat.pack(carried), xs)
        for tensor, value in zip(carried, flat.views(last)):
            tensor.copy_(value)
        return stacked


# The state entries a loop over windows carries from one window to the next: what the programs write, but the
# window's sum and count (empty at every window's start and end) and the staged data's read-only rows.
_CARRIED = ("params", "buffers", "batch_index", "optimizer", "scaler", "data")


def _row(index: int, leaf: Any) -> Any:
    return leaf[index]


def _copy(leaf: Any) -> Any:
    return leaf.clone() if isinstance(leaf, Tensor) else leaf


def _carry(state: dict[str, Any]) -> list[Tensor]:
    """The loop's carry: the tensors of the entries ``_CARRIED`` names, in a fixed order (a dict's by sorted key)."""
    return [leaf for key in _CARRIED for leaf in _leaves(_carried_value(state, key))]


def _carried_value(state: dict[str, Any], key: str) -> Any:
    value = state[key]
    return value["cursor"] if key == "data" and value is not None else value


def _leaves(value: Any) -> list[Tensor]:
    if value is None:
        return []
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        return [leaf for key in sorted(value) for leaf in _leaves(value[key])]
    return [leaf for item in value for leaf in _leaves(item)]


def _with_carry(state: dict[str, Any], tensors: list[Tensor]) -> dict[str, Any]:
    """``state`` with the tensors of its carry (``_carry``) replaced by ``tensors``, in the same order."""
    supply = iter(tensors)

    def rebuilt(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, Tensor):
            return next(supply)
        if isinstance(value, dict):
            new = {key: rebuilt(value[key]) for key in sorted(value)}
            return {key: new[key] for key in value}
        return type(value)(rebuilt(item) for item in value)

    local = dict(state)
    for key in _CARRIED:
        if key == "data" and state["data"] is not None:
            local["data"] = {"rows": state["data"]["rows"], "cursor": next(supply)}
        elif key != "data":
            local[key] = rebuilt(state[key])
    return local
