"""How many micro-steps one compiled call runs when the user does not say (``micro_steps_per_call=None``).

Each call of a compiled program pays an entry cost on the host (TorchDynamo's guard checks over the state,
AOTAutograd's wrappers, the log recorder, the hyperparameter refresh, the call into the generated code) that does
not depend on the step. A call of several micro-steps is one loop over its windows (``TracedPrograms.several_program``:
torch's ``scan``, whose body, one window, is traced and built once), so it pays that cost once for all of them and
its build does not grow with its length: it costs one more graph to build (the loop, beside the one-micro-step
programs that run what a loop cannot: a pass's end inside a sink, a validation point) and, while it runs, a second
copy of the state it carries. So the rule reads the step's size, counted once at the build as the FLOPs of its
matrix multiplies and convolutions (forward and backward, ``FlopCounterMode`` on one eager run over copies of the
state):

- below ``LOOP_STEP_FLOPS``, whole windows up to ``UNROLLED_MICRO_STEPS`` micro-steps per call (at least one
  window, so a window longer than that is one call, up to ``MAX_UNROLLED_MICRO_STEPS``: the loop's body holds one
  window unrolled);
- otherwise one micro-step per call: the entry cost is lost in the step's own work, and the loop's second copy of
  a large model's state is not;
- a loop that does not build leaves the same one-micro-step programs (``program_build.py``), at the cost of the
  failed try.

Random draws that must be eager's (dropout under Inductor on a CPU, ``fallback_random``) run in the loop as well:
Inductor keeps them in eager's order with an operation (``control_deps``) that torch's lowering of the loop could
not trace until ``_torch_compat.let_loops_order_random_draws`` gave it the rule.

Measured on a CPU (benchmarks/README.md): for the tiny MLP (about 0.65 MFLOP a micro-step) a call of 8 ran several
times faster than one micro-step per call; for LeNet-5 at batch 32 (about 72 MFLOP), whose convolutions dominate its
step, the loop still ran 1.15x (calls of 8 from the loader) and 1.24x (a whole staged sink) one micro-step per call,
so the threshold sits well above both: at a billion FLOPs a step takes tens of milliseconds on a CPU core, where
a call's entry (under a millisecond) is a few percent.

A step therefore also gets a call as long as the sink (``longest_call``): with staged data the sink's staged
micro-batches, from a loader the sink's batches read and stacked within ``LOADER_CALL_BYTES`` and the device-data
budget (``loader_call``), up to ``LONGEST_CALL``, so a whole sink is one call where its segment allows; the host loop
runs each segment's calls longest first, then calls of the short length, then one micro-step per call for what is
left. One graph of the loop serves every call of two windows or more, whatever their number (the number of windows is
a size the graph leaves open; a call of one window is a graph of its own), so a segment's rest of two windows or
more is one call of its own length (``StepPrograms.any_shorter_call``): a schedule point, ``max_steps`` or a pass's
end leaves at most one window to the one-micro-step programs, which a fit then often never builds. For programs
built without running (a sum across processes traced in), and off the CPU, each length is a graph of its own.
Neither grows with ``sink_size``. On a GPU, a CUDA graph's replay costs little per call, and a loop of several
captured as one graph has not run there yet (benchmarks/README.md): one per call.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_sink._torch_compat import tree_map

__all__ = [
    "LOOP_STEP_FLOPS",
    "UNROLLED_MICRO_STEPS",
    "MAX_UNROLLED_MICRO_STEPS",
    "LONGEST_CALL",
    "default_micro_steps",
    "longest_call",
    "loader_call",
    "LOADER_CALL_BYTES",
]

LOOP_STEP_FLOPS = 1e9
UNROLLED_MICRO_STEPS = 8
MAX_UNROLLED_MICRO_STEPS = 16
LONGEST_CALL = 1024
# From a loader a call's micro-batches are read, then stacked for the loop: a call longer than the default's holds
# at most this many bytes of batches, so that a long call never costs memory that matters (the tiny MLP's sink of
# 500 batches is 4 MiB, LeNet-5's 200 batches 26 MiB).
LOADER_CALL_BYTES = 2**26


def default_micro_steps(
    step_flops: float,
    accumulation_steps: int,
    device_type: str,
    capacity: int | None = None,
) -> tuple[int, str]:
    """Micro-steps per call for a micro-step of ``step_flops`` in windows of ``accumulation_steps`` on
    ``device_type`` (``capacity``: the most micro-steps a call may gather from the staged data), with the reason
    in words for the fit's line about its programs."""
    size = f"a micro-step of {step_flops / 1e6:.2g} MFLOP"
    if device_type != "cpu":
        return 1, f"one micro-step per call on {device_type} (several per call are measured on CPUs only)"
    if step_flops >= LOOP_STEP_FLOPS:
        return 1, f"one micro-step per call ({size}: a call's entry cost is a small share of it)"
    count = max(1, UNROLLED_MICRO_STEPS // accumulation_steps) * accumulation_steps
    if count > MAX_UNROLLED_MICRO_STEPS:
        return (
            1,
            f"one micro-step per call ({size}, but windows of {accumulation_steps} are too long for a loop's body)",
        )
    if capacity is not None:
        count = min(count, capacity // accumulation_steps * accumulation_steps)
    if count <= 1:
        return 1, f"one micro-step per call ({size}, but a sink stages fewer micro-batches than a window of several)"
    return count, f"{count} micro-steps per call, one loop over its windows ({size}: calls are made fewer)"


def longest_call(count: int, accumulation_steps: int, capacity: int | None) -> int | None:
    """Beside calls of ``count`` micro-steps, a longer call for the rest of a sink: the sink's whole windows
    (``capacity`` micro-batches: the staged sink's, or ``loader_call``'s from a loader), up to ``LONGEST_CALL``;
    None where there is none longer (no capacity, or one no longer than ``count``)."""
    if count <= 1 or capacity is None:
        return None
    longest = min(capacity, LONGEST_CALL) // accumulation_steps * accumulation_steps
    return longest if longest > count else None


def loader_call(example_batch: Any, sink_micro_batches: int | None, budget: int) -> int | None:
    """From a loader, the most micro-batches like ``example_batch`` one call may stack: the sink's
    (``sink_micro_batches``; None: unknown, no longer call), as long as their bytes stay within
    ``LOADER_CALL_BYTES`` and the device-data ``budget``: a call holds its batches twice while it runs (as read, and
    stacked for the loop)."""
    if sink_micro_batches is None:
        return None
    sizes: list[int] = []
    tree_map(lambda leaf: sizes.append(leaf.nbytes) if isinstance(leaf, torch.Tensor) else None, example_batch)
    return min(sink_micro_batches, min(budget, LOADER_CALL_BYTES) // max(1, sum(sizes)))
