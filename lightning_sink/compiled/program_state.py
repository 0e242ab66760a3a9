"""The state the step programs keep on the device besides the module's and the optimizer's own tensors: the open
window (``ProgramWindow``) and the hyperparameter table of a call of several (``HyperTable``, and ``several_call``, a
call's input); and ``clone_tree``, the copies of such state (and of a batch) the programs are compiled and captured
on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy
import torch
from torch import Tensor

from lightning_sink._torch_compat import tree_map
from lightning_sink.compiled.optimizer_rules import OptimizerRule

__all__ = ["HyperTable", "ProgramWindow", "clone_tree", "several_call"]


@dataclass
class ProgramWindow:
    """The open window: the fp32 gradient sum per trainable parameter and how many micro-steps it holds."""

    buffers: list[Tensor]
    micro_steps: Tensor  # 0-dim float32 on the device

    def reset(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()
        self.micro_steps.zero_()


class HyperTable:
    """Each update of a call of several reads its own row of hyperparameters (one row per window, one table per
    param group, columns ``rule.names``), so an interval="step" scheduler stepped between them is in the call."""

    def __init__(self, rule: OptimizerRule) -> None:
        self.rule = rule
        self.tables: list[Tensor] = []  # the programs' state holds this very list
        self._rows: list[list[list[float]]] | None = None  # what the table was last filled with

    def size(self, windows: int) -> None:
        """One row per window of a call of several (none without), one table per param group: resized in place, as
        the state holds the list."""
        device = self.rule.params[0].device
        self.tables[:] = [
            torch.zeros((windows, len(self.rule.names)), dtype=torch.float64, device=device) for _ in self.rule.groups
        ]

    def fill(self, rows: list[list[list[float]]] | None, windows: int) -> None:
        """Write the hyperparameters of a call's ``windows`` windows into the table's first rows, which the call
        reads (only when they changed); ``None``: every window the current ``param_groups``."""
        rows = rows if rows is not None else [self.rule.current_values()] * windows
        if len(rows) != windows:
            raise ValueError(f"run_several takes hyperparameters for its {windows} updates; got {len(rows)}")
        if rows == self._rows:
            return
        # (a shorter call reads the first rows; numpy reads nested lists of floats faster than torch does)
        for index, table in enumerate(self.tables):
            table[:windows].copy_(torch.from_numpy(numpy.array([row[index] for row in rows], dtype=numpy.float64)))
        self._rows = rows


def clone_tree(tree: Any) -> Any:
    """A copy of ``tree`` with every tensor in it cloned (dicts, lists and tuples copied, anything else shared)."""
    if isinstance(tree, Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: clone_tree(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone_tree(value) for value in tree)
    return tree


def stackable(batches: list[Any]) -> bool:
    """Whether ``several_call`` can stack ``batches``: the same structure, with tensors of one shape and dtype at
    each place (a loader that pads each batch to its longest sequence gives batches it cannot)."""

    def shapes(batch: Any) -> Any:
        return tree_map(lambda leaf: (leaf.shape, leaf.dtype) if isinstance(leaf, Tensor) else None, batch)

    first = shapes(batches[0])
    return all(shapes(batch) == first for batch in batches[1:])


def several_call(tables: list[Tensor], windows: int, accumulation: int, batches: list[Any] | None) -> dict[str, Any]:
    """``several_program``'s input for a call of ``windows`` windows of ``accumulation`` micro-steps: its batches
    stacked per leaf of the batch as [windows, accumulation, ...] (None: gathered from the staged data) and the first
    ``windows`` rows of the hyperparameter ``tables``."""
    if batches is not None:
        batches = tree_map(lambda *leaves: torch.stack(leaves).unflatten(0, (windows, accumulation)), *batches)
    return {"batches": batches, "hyper": [table[:windows] for table in tables]}
