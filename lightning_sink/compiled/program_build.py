"""``build_step_programs``: the module, optimizer and batch checked (a module or optimizer the programs cannot run is
``Unavailable``; a placement that cannot work raises ``ValueError``, as a wrong setting does when its
``ProgramSettings`` is made; a step that depends on Python state the host changes is ``Unavailable``:
``host_dependence.py``), the ``StepPrograms`` assembled, the length of a call decided where the
caller left it to the build, and the programs compiled (and on CUDA captured) before the first call (with calls of
several their loop, the one-micro-step pair when first needed: ``StepPrograms.build_pair``); a failure to compile is
``Unavailable`` too, nothing of the run changed."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sink.compiled.call_length import default_micro_steps, longest_call
from lightning_sink.compiled.device_dataset import DeviceDataset, SinkIndices
from lightning_sink.compiled.host_dependence import host_dependence
from lightning_sink.compiled.optimizer_rules import OptimizerRule, optimizer_rule
from lightning_sink.compiled.program_settings import ProgramSettings
from lightning_sink.compiled.step_programs import StepPrograms
from lightning_sink.compiled.support import Unavailable, unsupported_reason
from lightning_sink.compiled.window_update import WindowUpdate
from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale, LossScaler

__all__ = ["ProgramSettings", "build_step_programs", "error_line"]


def build_step_programs(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: Any,
    settings: ProgramSettings | None = None,
) -> StepPrograms | Unavailable:
    """Compile ``module``'s ``training_step`` with ``optimizer`` into the accumulate and update programs.

    Args:
        module: a module with ``training_step(batch, batch_idx)`` returning the loss (or a dict with ``"loss"``);
            ``batch_idx`` arrives as a 0-dim tensor counting micro-batches. Its parameters and buffers must already
            be on the training device.
        optimizer: ``SGD``, ``Adam`` or ``AdamW`` over the module's parameters.
        example_batch: a batch as ``training_step`` will get it (same shapes, on the device); used to compile.
        settings: loss scaling, clipping, the backend, CUDA graphs, staged data, the call's length, mixed precision
            and the sum across processes (``ProgramSettings``); None: its defaults.

    Returns: the programs, or ``Unavailable`` with the one-line reason (then run the eager step instead).
    """
    settings = settings if settings is not None else ProgramSettings()
    reason = unsupported_reason(module, optimizer)
    if reason is not None:
        return Unavailable(reason)
    params: list[Tensor] = [param for param in module.parameters() if param.requires_grad]
    rule = optimizer_rule(optimizer, params)
    if isinstance(rule, str):
        return Unavailable(rule)
    device = params[0].device
    _check_placement(settings, example_batch, device)
    loss_scale = settings.loss_scale
    if isinstance(loss_scale, (DynamicLossScale, FixedLossScale)):
        loss_scale = LossScaler(loss_scale).to(device)
    update = WindowUpdate(rule, loss_scale, settings.clip, settings.rank_sum)
    several = (settings.calls, settings.accumulation_steps) if settings.calls > 1 else None
    data = settings.data
    programs = StepPrograms(module, update, settings.backend, data, several, settings.autocast)
    try:
        if data is not None:  # an example to compile with: the first row of the buffer (all zeros: sample 0)
            data[1].cursor.zero_()
        reason = host_dependence(module, partial(programs.eager_run, example_batch), settings.trainer_reads)
        if reason is not None:
            rule.discard_created()
            return Unavailable(reason, host_state=True)
        if settings.chooses_call_length:
            _choose_call_length(programs, example_batch, settings.accumulation_steps, data, settings.loader_call)
            _compile_or_one_per_call(programs, example_batch)
        else:
            programs.compile(example_batch)
        if settings.cuda_graph:
            programs.capture(example_batch)
    except Exception as error:  # a graph break, an unsupported operation, a backend failure: all say no program
        return _refusal(error, rule, programs)
    return programs


def _check_placement(settings: ProgramSettings, example_batch: Any, device: torch.device) -> None:
    """Where the programs run and where their batches come from: CUDA graphs on a CUDA device, and either staged
    data or an example batch."""
    if settings.cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the module on a CUDA device; its parameters are on {device}")
    if settings.data is not None and example_batch is not None:
        raise ValueError("with data=(dataset, indices) the programs gather their own batches: pass example_batch=None")


def _choose_call_length(
    programs: StepPrograms,
    example_batch: Any,
    accumulation_steps: int,
    data: tuple[DeviceDataset, SinkIndices] | None,
    loader_call: int | None,
) -> None:
    """``micro_steps_per_call=None``: the call's length from the step's FLOPs (``call_length.py``), the reason in
    ``programs.call_note``; more than one micro-step unrolls ``run_several`` before the programs compile. A longer
    call beside it: a whole staged sink (``data``), or from a loader up to ``loader_call`` micro-batches."""
    capacity = data[1].capacity if data is not None else None
    flops = programs.micro_step_flops(example_batch)
    device_type = programs.params[0].device.type
    count, programs.call_note = default_micro_steps(flops, accumulation_steps, device_type, capacity)
    longest = longest_call(count, accumulation_steps, capacity if data is not None else loader_call)
    if longest is not None:
        programs.unroll(longest, accumulation_steps, shorter=count)
        whole = "a whole staged sink" if data is not None else "a sink's batches from the loader"
        programs.call_note += f", and {longest} per call for {whole}"
    elif count > 1:
        programs.unroll(count, accumulation_steps)


def _compile_or_one_per_call(programs: StepPrograms, example_batch: Any) -> None:
    """Compile the programs with the calls of several the build chose (their loop alone: the one-micro-step pair
    waits for a micro-batch that needs it); where the loop does not build (an operation torch's ``scan`` cannot
    hold), the pair instead: the step still runs compiled, one micro-step per call, and ``call_note`` says why (a
    step that does not build as the pair either raises the pair's error: no program at all)."""
    try:
        programs.compile(example_batch)
    except Exception as error:
        if programs.several is None:
            raise  # (the step itself did not build: no program at all)
        programs.drop_several(f"one micro-step per call (the loop over windows did not build: {error_line(error)})")
        programs.compile(example_batch)


def error_line(error: Exception, limit: int = 240) -> str:
    """A compiler's error in one line: its first line, continued while that only introduces what follows (a loop's
    "... Got graph break/error:" before the graph break itself), and the line of the user's code it names."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    following = iter(lines[1:])
    while text.endswith(":"):
        more = next(following, None)
        if more is None:
            break
        text = f"{text} {more}"
    explained = next((line for line in lines if line.startswith("Explanation: ")), None)
    if explained is not None:  # (TorchDynamo's graph breaks say what they are on a line of their own)
        text = f"{text}: {explained.removeprefix('Explanation: ')}"
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    if "from user code:" in lines:  # the innermost frame it lists: a loop's body, not the loop's call
        start = lines.index("from user code:")
        frames = [i for i in range(start + 1, len(lines) - 1) if lines[i].startswith("File ")]
        if frames:
            text += f" (at {_short_frame(lines[frames[-1]])}: {lines[frames[-1] + 1][:120]})"
    return text


def _short_frame(frame: str) -> str:
    """``File "/a/b/c.py", line 3, in f`` as ``c.py:3 in f``."""
    parts = [part.strip() for part in frame.split(",")]
    if len(parts) != 3:
        return frame
    name = parts[0].removeprefix("File ").strip('"').rsplit("/", 1)[-1]
    return f"{name}:{parts[1].removeprefix('line ')} {parts[2]}"


def _refusal(error: Exception, rule: OptimizerRule, programs: StepPrograms) -> Unavailable:
    """Why the programs did not build, in one line, the optimizer left as it was."""
    rule.discard_created()
    refused = programs.metric_calls.refusal_in(error)
    if refused is not None:
        return Unavailable(refused)
    line = error_line(error)
    if "data-dependent" in line:  # (TorchDynamo's words for a tensor's value read on the host)
        line += (
            "; a tensor's value was used as a Python number (float(), int(), .item(), a branch on it; batch_idx is a"
            " 0-dim tensor inside the programs)"
        )
    return Unavailable(
        f"training_step did not compile to one graph ({line}); make it traceable or use graph_mode='eager'"
    )
