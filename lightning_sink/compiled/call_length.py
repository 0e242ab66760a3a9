"""How many micro-steps one compiled call runs when the user does not say (``micro_steps_per_call=None``).

Each call of a compiled program pays an entry cost on the host (TorchDynamo's guard checks over the state, the
log recorder, the hyperparameter refresh, the call into the generated code) that does not depend on the step. For
a small step that cost is a large share of the time, and unrolling several micro-steps into one program pays it
once for all of them; for a large step it is lost in the step's own work, and unrolling only makes the build longer
(an unrolled program is as many steps long as it holds). So the rule reads the step's size, counted once at the
build as the FLOPs of its matrix multiplies and convolutions (forward and backward, ``FlopCounterMode`` on one eager
run over copies of the state):

- below ``SMALL_STEP_FLOPS``, whole windows up to ``UNROLLED_MICRO_STEPS`` micro-steps per call (at least one
  window, so a window longer than that is one call, up to ``MAX_UNROLLED_MICRO_STEPS``: the loop's body holds one
  window unrolled);
- otherwise one micro-step per call.

The threshold sits between the two models ``benchmarks/loop_sinking.py`` measures on a CPU: the tiny MLP (about
0.65 MFLOP a micro-step, where eight micro-steps per call ran several times faster than one) and LeNet-5 at batch 32
(about 72 MFLOP, where four per call ran no faster than one and built longer).

A call of several is one loop over its windows (``TracedPrograms.several_program``: torch's ``scan``, whose body,
one window, is built once), so a longer call costs no longer a build. With staged data a small step therefore also
gets a call as long as the sink (``longest_call``: the sink's staged micro-batches, up to ``LONGEST_CALL``), so a
whole sink is one call where its segment allows; the host loop runs each segment's calls longest first, then calls
of the short length, then one micro-step per call for what is left (a pass's end inside a sink, a validation
point). Each length is one compiled graph of the same program; neither grows with ``sink_size`` beyond that. On a GPU, a CUDA graph's replay costs little per
call and several per call has not been measured there yet: one per call.
"""

from __future__ import annotations

__all__ = [
    "SMALL_STEP_FLOPS",
    "UNROLLED_MICRO_STEPS",
    "MAX_UNROLLED_MICRO_STEPS",
    "LONGEST_CALL",
    "default_micro_steps",
    "longest_call",
]

SMALL_STEP_FLOPS = 8e6
UNROLLED_MICRO_STEPS = 8
MAX_UNROLLED_MICRO_STEPS = 16
LONGEST_CALL = 1024


def default_micro_steps(
    step_flops: float, accumulation_steps: int, device_type: str, capacity: int | None = None
) -> tuple[int, str]:
    """Micro-steps per call for a micro-step of ``step_flops`` in windows of ``accumulation_steps`` on
    ``device_type`` (``capacity``: the most micro-steps a call may gather from the staged data), with the reason in
    words for the fit's line about its programs."""
    size = f"a micro-step of {step_flops / 1e6:.2g} MFLOP"
    if device_type != "cpu":
        return 1, f"one micro-step per call on {device_type} (several per call are measured on CPUs only)"
    if step_flops >= SMALL_STEP_FLOPS:
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
    return count, f"{count} micro-steps per call, one loop over its windows ({size}: small, so calls are made fewer)"


def longest_call(count: int, accumulation_steps: int, capacity: int | None) -> int | None:
    """Beside calls of ``count`` micro-steps, a longer call for the rest of a sink: the staged sink's whole windows
    (``capacity`` micro-batches), up to ``LONGEST_CALL``; None where there is none longer (the loader path, whose
    sink length the build does not know, or a sink no longer than ``count``)."""
    if count <= 1 or capacity is None:
        return None
    longest = min(capacity, LONGEST_CALL) // accumulation_steps * accumulation_steps
    return longest if longest > count else None
