"""``build_step_programs``: its arguments checked (a wrong one raises ``ValueError``; a module or optimizer the
programs cannot run is ``Unavailable``), the ``StepPrograms`` assembled, the length of a call decided where the
caller left it to the build, and every program compiled (and on CUDA captured) before the first call; a failure to
compile is ``Unavailable`` too, nothing of the run changed."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_sink.compiled.autocast_region import AutocastRegion
from lightning_sink.compiled.call_length import default_micro_steps, longest_call
from lightning_sink.compiled.device_dataset import DeviceDataset, SinkIndices
from lightning_sink.compiled.optimizer_rules import OptimizerRule, optimizer_rule
from lightning_sink.compiled.rank_sum import RankSum
from lightning_sink.compiled.step_programs import StepPrograms
from lightning_sink.compiled.support import Unavailable, unsupported_reason
from lightning_sink.compiled.window_update import WindowUpdate
from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale, LossScaler

__all__ = ["build_step_programs"]

_CLIP_ALGORITHMS = ("norm", "value")


def build_step_programs(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: Any,
    *,
    loss_scale: DynamicLossScale | FixedLossScale | LossScaler | None = None,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str = "norm",
    backend: str = "inductor",
    cuda_graph: bool = False,
    data: tuple[DeviceDataset, SinkIndices] | None = None,
    micro_steps_per_call: int | None = 1,
    accumulation_steps: int = 1,
    autocast: AutocastRegion | None = None,
    rank_sum: RankSum | None = None,
) -> StepPrograms | Unavailable:
    """Compile ``module``'s ``training_step`` with ``optimizer`` into the accumulate and update programs.

    Args:
        module: a module with ``training_step(batch, batch_idx)`` returning the loss (or a dict with ``"loss"``);
            ``batch_idx`` arrives as a 0-dim tensor counting micro-batches. Its parameters and buffers must already
            be on the training device.
        optimizer: ``SGD``, ``Adam`` or ``AdamW`` over the module's parameters.
        example_batch: a batch as ``training_step`` will get it (same shapes, on the device); used to compile.
        loss_scale: a loss-scale setting (a ``LossScaler`` is used as is: the programs write its tensors), or None.
        gradient_clip_val: clip the window's gradient (after unscaling) to this norm or value; None: no clipping.
        gradient_clip_algorithm: ``"norm"`` (2-norm over all parameters, as ``clip_grad_norm_``) or ``"value"``.
        backend: ``torch.compile``'s backend (``"inductor"``; ``"aot_eager"`` compiles faster and generates no code).
        cuda_graph: also capture both programs as CUDA graphs (the module must be on a CUDA device).
        data: a staged dataset and the sink-indices buffer its batches are gathered from; then ``example_batch``
            is None and ``accumulate()`` / ``update()`` take no batch (load each sink's indices first).
        micro_steps_per_call: above 1, also build ``run_several``: that many micro-steps in one call, a loop over
            its windows (whole windows of ``accumulation_steps``; a multiple of it). ``None``: decided from the
            step's size (``call_length.default_micro_steps``, and with staged data ``call_length.longest_call`` as
            a second, longer call; one per call under ``RankSum(all_reduce=...)``), the reason in
            ``programs.call_note``.
        accumulation_steps: the window length ``run_several`` assumes.
        autocast: mixed precision: each forward runs in this autocast region (the backward outside it, the
            window's sum in fp32); None: the module's own dtypes.
        rank_sum: under DDP, how the update program sums the window across the processes (``RankSum``); every
            rank builds its programs with the same one. None: one process.

    Returns: the programs, or ``Unavailable`` with the one-line reason (then run the eager step instead).
    """
    _check_settings(gradient_clip_val, gradient_clip_algorithm, autocast)
    reason = unsupported_reason(module, optimizer)
    if reason is not None:
        return Unavailable(reason)
    params: list[Tensor] = [param for param in module.parameters() if param.requires_grad]
    rule = optimizer_rule(optimizer, params)
    if isinstance(rule, str):
        return Unavailable(rule)
    device = params[0].device
    if isinstance(loss_scale, (DynamicLossScale, FixedLossScale)):
        loss_scale = LossScaler(loss_scale).to(device)
    clip = None if gradient_clip_val is None else (gradient_clip_algorithm, float(gradient_clip_val))
    calls = _checked_call_length(micro_steps_per_call, accumulation_steps, rank_sum)
    _check_placement(cuda_graph, rank_sum, data, example_batch, device, calls)
    several = (calls, accumulation_steps) if calls > 1 else None
    programs = StepPrograms(module, WindowUpdate(rule, loss_scale, clip, rank_sum), backend, data, several, autocast)
    try:
        if data is not None:  # an example to compile with: the first row of the buffer (all zeros: sample 0)
            data[1].cursor.zero_()
        if micro_steps_per_call is None and (rank_sum is None or rank_sum.all_reduce is None):
            _choose_call_length(programs, example_batch, accumulation_steps, data)
            _compile_or_one_per_call(programs, example_batch)
        else:
            programs.compile(example_batch)
        if cuda_graph:
            programs.capture(example_batch)
    except Exception as error:  # a graph break, an unsupported operation, a backend failure: all say no program
        return _refusal(error, rule, programs)
    return programs


def _check_settings(
    gradient_clip_val: float | None, gradient_clip_algorithm: str, autocast: AutocastRegion | None
) -> None:
    """The clipping and mixed-precision arguments, checked before anything else is looked at."""
    if gradient_clip_algorithm not in _CLIP_ALGORITHMS:
        raise ValueError(
            f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not valid: pass one of {_CLIP_ALGORITHMS}"
        )
    if gradient_clip_val is not None and (
        isinstance(gradient_clip_val, bool) or not isinstance(gradient_clip_val, (int, float)) or gradient_clip_val <= 0
    ):
        raise ValueError(f"gradient_clip_val={gradient_clip_val!r} is not valid: pass a number > 0 or None")
    if autocast is not None and not isinstance(autocast, AutocastRegion):
        raise ValueError(f"autocast={autocast!r} is not valid: pass an AutocastRegion(device_type, dtype) or None")


def _checked_call_length(micro_steps_per_call: int | None, accumulation_steps: int, rank_sum: RankSum | None) -> int:
    """The micro-steps per call the programs are built with (1 where the build decides it: it may unroll them
    later, from the step's size), after checking it against the window length and the route of the rank sum."""
    chosen = micro_steps_per_call is None  # the length decided from the step's size, after the build
    calls = 1 if micro_steps_per_call is None else micro_steps_per_call
    for name, value in (("micro_steps_per_call", calls), ("accumulation_steps", accumulation_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not valid: pass an int >= 1")
    if not chosen and calls % accumulation_steps:
        raise ValueError(
            f"micro_steps_per_call={calls} is not a multiple of accumulation_steps="
            f"{accumulation_steps}: a call runs whole windows"
        )
    if calls > 1 and rank_sum is not None and rank_sum.all_reduce is not None:
        raise ValueError(
            "micro_steps_per_call > 1 needs the sum across processes inside the program: pass"
            " RankSum(group=...), not RankSum(all_reduce=...)"
        )
    return calls


def _check_placement(
    cuda_graph: bool,
    rank_sum: RankSum | None,
    data: tuple[DeviceDataset, SinkIndices] | None,
    example_batch: Any,
    device: torch.device,
    calls: int,
) -> None:
    """Where the programs run and where their batches come from: CUDA graphs on one CUDA device, a staged
    dataset's indices buffer long enough for a call, and either staged data or an example batch."""
    if cuda_graph and rank_sum is not None:
        raise ValueError("cuda_graph=True is for one process: the CUDA-graph programs do not sum across processes")
    if data is not None and data[1].capacity < calls:
        raise ValueError(f"micro_steps_per_call={calls} exceeds the sink indices' capacity={data[1].capacity}")
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the module on a CUDA device; its parameters are on {device}")
    if data is not None and example_batch is not None:
        raise ValueError("with data=(dataset, indices) the programs gather their own batches: pass example_batch=None")


def _choose_call_length(
    programs: StepPrograms,
    example_batch: Any,
    accumulation_steps: int,
    data: tuple[DeviceDataset, SinkIndices] | None,
) -> None:
    """``micro_steps_per_call=None``: the call's length from the step's FLOPs (``call_length.py``), the reason in
    ``programs.call_note``; more than one micro-step unrolls ``run_several`` before the programs compile."""
    capacity = data[1].capacity if data is not None else None
    flops, draws = programs.micro_step_size(example_batch)
    device_type = programs.params[0].device.type
    ordered = draws if programs.draws_as_eager else 0
    count, programs.call_note = default_micro_steps(flops, accumulation_steps, device_type, capacity, ordered)
    longest = longest_call(count, accumulation_steps, capacity)
    if longest is not None:
        programs.unroll(longest, accumulation_steps, shorter=count)
        programs.call_note += f", and {longest} per call for a whole staged sink"
    elif count > 1:
        programs.unroll(count, accumulation_steps)


def _compile_or_one_per_call(programs: StepPrograms, example_batch: Any) -> None:
    """Compile the programs with the calls of several the build chose; where the loop does not build (an operation
    torch's ``scan`` cannot hold, such as a random draw that must equal eager's), without them: the step still
    runs compiled, one micro-step per call, and ``call_note`` says why."""
    try:
        programs.compile(example_batch)
    except Exception as error:
        if programs.several is None or not programs.one_per_call_compiled:
            raise  # (the step itself did not build: no program at all)
        programs.drop_several(
            f"one micro-step per call (the loop over windows did not build: {type(error).__name__}:"
            f" {_first_line(error)[:160]})"
        )
        programs.compile(example_batch)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def _refusal(error: Exception, rule: OptimizerRule, programs: StepPrograms) -> Unavailable:
    """Why the programs did not build, in one line, the optimizer left as it was."""
    rule.discard_created()
    refused = programs.metric_calls.refusal_in(error)
    if refused is not None:
        return Unavailable(refused)
    first_line = _first_line(error)
    return Unavailable(
        f"training_step did not compile to one graph ({type(error).__name__}: {first_line[:200]}); make it"
        " traceable or use graph_mode='eager'"
    )
