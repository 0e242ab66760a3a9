"""The two step programs of a gradient-accumulation window, each one compiled function over the whole step.

- **accumulate** (every micro-batch but a window's last): forward, backward, the gradients added into the window's
  fp32 buffers.
- **update** (a window's last micro-batch): forward and backward, the sum (across processes too, under DDP:
  ``RankSum``), division by the window's micro-step count, unscaling and the overflow check, clipping (norm or
  value), the optimizer update (or, on overflow, none: ``torch.where``, no host sync), the loss-scale update and the
  window reset.

Route: ``torch.func.grad_and_value`` over ``torch.func.functional_call`` of the module's ``training_step`` (one graph
for forward and backward; under mixed precision the forward inside the caller's ``AutocastRegion``, the backward
outside it, as a precision plugin's step runs), the optimizer's update written functionally (``optimizer_rules``), and
``torch.compile(fullgraph=True)`` over a function that takes every tensor it reads or writes as an argument: the
parameters, buffers, optimizer state, hyperparameters, window buffers and loss-scale state. Everything it changes
it writes back in place, so the module, the optimizer (``state_dict``, schedulers) and the ``LossScaler`` hold the
current values between calls.

Both programs are compiled when built, on copies of that state with an example batch (the random-number state
restored afterwards), so a ``training_step`` that cannot be one graph is refused before anything changed and the
first real call runs at full speed. One object answers ``accumulate(batch)`` / ``update(batch)`` per micro-batch,
the window's state (buffers, micro-step count) explicit in ``window``.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value
from torch.utils.flop_counter import FlopCounterMode

from lightning_sink._torch_compat import inductor_option_names, note_optimizer_step, traced_all_reduce_sum
from lightning_sink.compiled.autocast_region import AutocastRegion
from lightning_sink.compiled.call_length import default_micro_steps
from lightning_sink.compiled.cuda_graphs import CapturedProgram
from lightning_sink.compiled.device_dataset import DeviceDataset, SinkIndices
from lightning_sink.compiled.forward_compile import RANDOM_AS_EAGER
from lightning_sink.compiled.logged_values import LoggedValues
from lightning_sink.compiled.metric_calls import MetricCalls, MetricValue, join_tensors, split_tensors
from lightning_sink.compiled.optimizer_rules import OptimizerRule, optimizer_rule
from lightning_sink.compiled.scale_rule import scaler_tensors, update_scale
from lightning_sink.compiled.support import Unavailable, unsupported_reason
from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale, LossScaler
from lightning_sink.window import state as window_state

__all__ = [
    "ProgramUnavailable",
    "RankSum",
    "StepOutputs",
    "StepPrograms",
    "ProgramWindow",
    "build_step_programs",
    "inductor_options",
]

_CLIP_ALGORITHMS = ("norm", "value")
# why: ``inductor_options``; RANDOM_AS_EAGER: eager's random numbers (forward_compile.py)
_CPU_INDUCTOR_OPTIONS = {"layout_optimization": False, "cpp_wrapper": True, **RANDOM_AS_EAGER}
_PROGRAM_NUMBERS = itertools.count()


class ProgramUnavailable(RuntimeError):
    """A program stopped applying after it was built (e.g. a ``param_groups`` flag it was compiled for changed)."""


@dataclass(frozen=True)
class StepOutputs:
    """What one program call returns, on the device (reading any of it is the caller's host sync, not ours)."""

    loss: Tensor  # the micro-batch's loss as training_step returned it (unscaled, detached)
    logs: dict[str, Tensor] = field(default_factory=dict)  # self.log values of this micro-batch, by name
    found_inf: Tensor | None = None  # update with loss scaling: the window overflowed and was skipped
    # an update of several in one call (``run_several``) with loss scaling: the scale and the skipped-window count
    # right after it (the scaler's own tensors hold the call's last values by the time the caller reads them)
    scale: Tensor | None = None
    skipped: Tensor | None = None
    # the micro-batch's torchmetrics Metric calls, recorded in the program, and the logged Metrics: made and
    # resolved on the host by ``StepPrograms.host_logs`` (metric_calls.py)
    metric_calls: list[Any] = field(default_factory=list)
    references: dict[str, MetricValue] = field(default_factory=dict)


@dataclass(frozen=True)
class RankSum:
    """The window's sum across processes (DDP), in the update program: the ranks' fp32 sums as one flat bucket,
    added up over ``ranks`` ranks, then divided by ``ranks`` times the micro-steps (the mean over every rank's
    micro-batches, as DDP averages). Inf and NaN survive the sum, so every rank sees any rank's overflow and skips
    with it. Two routes:

    - ``group`` given: a functional all-reduce over that process group traced inside the update program;
    - ``all_reduce`` given: the update program compiled as two parts (the last micro-batch and the flat sum; the
      rest of the update) with this eager in-place sum of the flat bucket between them.
    """

    ranks: int
    group: Any = None
    all_reduce: Callable[[Tensor], None] | None = None

    def __post_init__(self) -> None:
        if (self.group is None) == (self.all_reduce is None):
            raise ValueError("RankSum takes exactly one of group= (traced) and all_reduce= (eager)")
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 2:
            raise ValueError(f"RankSum(ranks={self.ranks!r}) is not valid: pass an int >= 2")


@dataclass
class ProgramWindow:
    """The open window: the fp32 gradient sum per trainable parameter and how many micro-steps it holds."""

    buffers: list[Tensor]
    micro_steps: Tensor  # 0-dim float32 on the device

    def reset(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()
        self.micro_steps.zero_()


class _TrainingStep(nn.Module):
    """Calls the wrapped module's ``training_step`` as ``forward``, so ``functional_call`` can run it with the
    program's parameter and buffer tensors; returns the loss (a returned dict's ``"loss"``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        # as Lightning calls it: batch_idx only for a training_step that takes a second argument
        parameters = inspect.signature(cast(Any, module).training_step).parameters.values()
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._takes_batch_idx = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)

    def forward(self, batch: Any, batch_idx: Tensor) -> Tensor:
        step = cast(Any, self.module).training_step  # a LightningModule's, typed as Module
        output = step(batch, batch_idx) if self._takes_batch_idx else step(batch)
        return output["loss"] if isinstance(output, dict) else output


def inductor_options(device: torch.device) -> dict[str, Any] | None:
    """Inductor's settings for programs on ``device`` (None: its defaults).

    On a CPU: ``layout_optimization`` off, so the programs keep the layouts the module's tensors have, as eager does.
    Inductor otherwise lays every convolution's tensors out channels-last on a CPU; for the small convolutions of a
    net trained on a CPU oneDNN's kernels in the tensors' own layout are faster, and the conversions between the two
    layouts cost again (LeNet-5's pooling backward became a scatter into a channels-last copy), which made the
    compiled step slower than eager's.
    ``cpp_wrapper``: the generated kernels and ATen's (the convolutions, the matrix products) called from generated
    C++ instead of Python, so a program's call costs one Python call rather than one per kernel.
    ``fallback_random``: random operators (dropout) call eager's, so a program draws the numbers eager draws from
    the same seed (``forward_compile.py``). Elsewhere (CUDA)
    Inductor's defaults, with which the GPU figures of benchmarks/README.md were measured.
    """
    if device.type != "cpu":
        return None
    known = inductor_option_names()  # a setting this torch no longer has is left out, not an error at every build
    return {name: value for name, value in _CPU_INDUCTOR_OPTIONS.items() if name in known}


def _own_code(method: Any) -> Callable[..., Any]:
    """``method`` with a code object of its own: torch.compile keeps its compiled variants (and their limit) per
    code object, so each programs object gets its own instead of sharing, and filling, one cache with every other."""
    function = method.__func__
    code = function.__code__.replace(co_name=f"{function.__name__}_{next(_PROGRAM_NUMBERS)}")
    copy = types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
    return types.MethodType(copy, method.__self__)


def _clone(tree: Any) -> Any:
    if isinstance(tree, Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: _clone(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(value) for value in tree)
    return tree


def _flatten(tensors: list[Tensor]) -> Tensor:
    """One flat fp32 bucket of the window's sums (what one all-reduce adds up across the ranks)."""
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def _unflatten(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    """The bucket's pieces, shaped as ``like``'s tensors."""
    pieces = flat.split([tensor.numel() for tensor in like])
    return [piece.view(tensor.shape) for piece, tensor in zip(pieces, like)]


class StepPrograms:
    """The compiled accumulate and update programs of one module and optimizer (build with
    ``build_step_programs``)."""

    def __init__(
        self,
        module: nn.Module,
        rule: OptimizerRule,
        scaler: LossScaler | None,
        clip: tuple[str, float] | None,
        backend: str,
        data: tuple[DeviceDataset, SinkIndices] | None = None,
        several: tuple[int, int] | None = None,
        autocast: AutocastRegion | None = None,
        rank_sum: RankSum | None = None,
    ) -> None:
        self.module, self.rule, self.scaler, self.clip = module, rule, scaler, clip
        self.autocast = autocast
        self.rank_sum = rank_sum
        self.sink_indices = data[1] if data is not None else None
        self.logged = LoggedValues()
        self.metric_calls = MetricCalls(module)
        self.logged.metric_calls = self.metric_calls if self.metric_calls.metrics else None
        self._step = _TrainingStep(module)
        trainable = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
        self._param_names = [f"module.{name}" for name, _ in trainable]
        frozen = [(f"module.{name}", p) for name, p in module.named_parameters() if not p.requires_grad]
        buffers = [(f"module.{name}", b) for name, b in module.named_buffers()]
        self._buffer_names = [name for name, _ in frozen + buffers]
        self.params = rule.params
        device = self.params[0].device
        self.window = ProgramWindow(
            [torch.zeros_like(param, dtype=torch.float32) for param in self.params],
            torch.zeros((), dtype=torch.float32, device=device),
        )
        self.batch_index = torch.zeros((), dtype=torch.int64, device=device)  # training_step's batch_idx
        states, hyper = rule.tensors()
        # several micro-steps per call: (micro-steps per call, accumulation steps), the call ending on an update
        self.several = several
        # ... each update of such a call reads its own row of hyperparameters (one row per window, one table per
        # param group, columns ``rule.names``), so an interval="step" scheduler stepped between them is in the call
        self.hyper_table: list[Tensor] = []
        self._size_table()
        self.call_note = (
            ""  # why the calls are as long as they are, where the build chose it (micro_steps_per_call=None)
        )
        self._table_rows: list[list[list[float]]] | None = None  # what the table was last filled with
        self._state: dict[str, Any] = {
            "params": [param.detach() for param in self.params],
            "buffers": [tensor.detach() for _, tensor in frozen + buffers],
            "window": self.window.buffers,
            "micro_steps": self.window.micro_steps,
            "batch_index": self.batch_index,
            "scaler": scaler_tensors(scaler) if scaler is not None else None,
            "optimizer": states,
            "hyper": hyper,
            "hyper_table": self.hyper_table,
            "data": None if data is None else {"rows": data[1].rows, "cursor": data[1].cursor},
        }
        self._dataset = tuple(data[0].tensors) if data is not None else ()  # read only: never copied

        options = inductor_options(device) if backend == "inductor" else None

        def compiled(program: Callable[..., Any]) -> Callable[..., Any]:
            return torch.compile(_own_code(program), fullgraph=True, backend=backend, dynamic=False, options=options)

        self._accumulate = compiled(self._accumulate_program)
        self._update = compiled(self._update_program)
        # the eager route of the sum across processes: the update in two parts, the all-reduce between them
        self._update_sum = compiled(self._update_sum_program)
        self._update_apply = compiled(self._update_apply_program)
        self._several = compiled(self._several_program)
        self.compile_seconds: dict[str, float] = {}
        self.captured: dict[str, CapturedProgram] = {}

    # -- the programs (traced by torch.compile; every tensor they touch comes in through `state`) -------------

    def _gradients(self, state: dict[str, Any], batch: Any) -> tuple[list[Tensor], Tensor, tuple, dict]:
        param_names, buffer_names, logged, autocast = self._param_names, self._buffer_names, self.logged, self.autocast
        if batch is None:  # the staged dataset's next micro-batch, gathered on the device
            batch = DeviceDataset.gather(list(self._dataset), state["data"]["rows"], state["data"]["cursor"])
        scale = state["scaler"]["scale"] if state["scaler"] is not None else None
        metric_calls = self.metric_calls
        # what is not tensors leaves by this side channel, not through grad's output: each log call's options,
        # the logged Metrics, and the Metric calls with their tensors replaced by positions in `metric_tensors`
        side: dict[str, Any] = {"options": {}, "references": {}, "calls": []}

        def forward_loss(params: list[Tensor], buffers: list[Tensor]) -> tuple[Tensor, tuple[Tensor, tuple]]:
            values: dict[str, Tensor] = {}
            logged.values, logged.call_options, logged.references = values, side["options"], side["references"]
            calls: list[Any] = []
            metric_calls.calls = calls
            tensors = {**dict(zip(param_names, params)), **dict(zip(buffer_names, buffers))}
            if autocast is None:
                loss = functional_call(self._step, tensors, (batch, state["batch_index"]))
            else:  # the forward only: the gradients are taken outside the region, as after a plugin's step context
                with torch.autocast(autocast.device_type, dtype=autocast.dtype, cache_enabled=autocast.cache_enabled):
                    loss = functional_call(self._step, tensors, (batch, state["batch_index"]))
            # what was logged leaves through the return value: the recorder keeps nothing between calls (a value
            # kept there would be one more thing the compiled program is guarded on)
            logged.values, logged.call_options, logged.references = {}, {}, {}
            metric_calls.calls = []
            metric_tensors: list[Tensor] = []
            side["calls"] = split_tensors(calls, metric_tensors)
            scaled = loss if scale is None else loss * scale.to(loss.dtype)
            return scaled, (loss.detach(), (values, metric_tensors))

        grads, (_, (loss, values)) = grad_and_value(forward_loss, has_aux=True)(state["params"], state["buffers"])
        state["batch_index"].add_(1)
        return grads, loss, values, side

    def _accumulate_program(self, state: dict[str, Any], batch: Any) -> tuple[Tensor, tuple, dict]:
        grads, loss, values, options = self._gradients(state, batch)
        for buffer, grad in zip(state["window"], grads):
            buffer.add_(grad.to(buffer.dtype))
        state["micro_steps"].add_(1)
        return loss, values, options

    def _update_program(self, state: dict[str, Any], batch: Any) -> tuple[Tensor, tuple, dict, Tensor | None]:
        sums, loss, values, options = self._window_sums(state, batch)
        if self.rank_sum is not None:  # (traced route: the eager one runs the two parts below instead)
            sums = _unflatten(traced_all_reduce_sum(_flatten(sums), self.rank_sum.group), sums)
        return loss, values, options, self._apply_update(state, sums)

    def _update_sum_program(self, state: dict[str, Any], batch: Any) -> tuple[Tensor, tuple, dict, Tensor]:
        """The eager route's first part: the last micro-batch and the window's sum, as one flat bucket."""
        sums, loss, values, options = self._window_sums(state, batch)
        return loss, values, options, _flatten(sums)

    def _update_apply_program(self, state: dict[str, Any], flat: Tensor) -> Tensor | None:
        """The eager route's second part, on the bucket summed over the ranks: the rest of the update."""
        return self._apply_update(state, _unflatten(flat, state["window"]))

    def _window_sums(self, state: dict[str, Any], batch: Any) -> tuple[list[Tensor], Tensor, tuple, dict]:
        """The window's last micro-batch, added to its sum (in new tensors: the buffers are reset after the update)."""
        grads, loss, values, options = self._gradients(state, batch)
        sums = [buffer + grad.to(buffer.dtype) for buffer, grad in zip(state["window"], grads)]
        return sums, loss, values, options

    def _apply_update(self, state: dict[str, Any], sums: list[Tensor]) -> Tensor | None:
        """Divide, unscale, check for overflow, clip, update (or skip), update the scale, reset the window."""
        ranks = 1 if self.rank_sum is None else self.rank_sum.ranks
        # the micro-steps before this one and this one; the programs add undivided losses (loss divisor 1)
        divisor = window_state.window_mean_divisor(state["micro_steps"] + 1, ranks, 1)
        scaler = state["scaler"]
        factor = 1.0 / divisor if scaler is None else 1.0 / (scaler["scale"] * divisor)
        sums = [total * factor for total in sums]
        overflow = None
        if scaler is not None:
            overflow = torch.stack([torch.isfinite(total).all() for total in sums]).logical_not().any()
        if self.clip is not None:
            sums = self._clipped(sums)
        skip = overflow if self.scaler is not None and self._skips_overflow() else None
        grads = [total.to(param.dtype) for total, param in zip(sums, state["params"])]
        self.rule.apply(state["params"], grads, state["optimizer"], state["hyper"], skip)
        if scaler is not None:
            assert self.scaler is not None and overflow is not None  # both exist exactly when scaler does
            update_scale(self.scaler.config, scaler, overflow)
        for buffer in state["window"]:
            buffer.zero_()
        state["micro_steps"].zero_()
        return None if scaler is None else scaler["found_inf"].clone()

    def _several_program(self, state: dict[str, Any], batches: list[Any]) -> list[tuple]:
        """``len(batches)`` micro-steps unrolled into one program: an update at each window's last micro-batch."""
        assert self.several is not None  # built with micro_steps_per_call
        accumulation = self.several[1]
        outputs: list[tuple[Any, ...]] = []
        scaler = state["scaler"]
        for position, batch in enumerate(batches):
            if (position + 1) % accumulation == 0:
                window = position // accumulation
                hyper = [dict(zip(self.rule.names, table[window].unbind())) for table in state["hyper_table"]]
                result: tuple[Any, ...] = self._update_program({**state, "hyper": hyper}, batch)
                if scaler is not None:
                    result = (*result, scaler["scale"].clone(), scaler["skipped"].clone())
                outputs.append(result)
            else:
                outputs.append(self._accumulate_program(state, batch))
        return outputs

    def _skips_overflow(self) -> bool:
        assert self.scaler is not None  # asked only when the programs scale the loss
        config = self.scaler.config
        return isinstance(config, DynamicLossScale) or config.drop_overflow_update

    def _clipped(self, sums: list[Tensor]) -> list[Tensor]:
        assert self.clip is not None  # asked only when the programs clip
        algorithm, value = self.clip
        if algorithm == "value":
            return [total.clamp(-value, value) for total in sums]
        # torch.nn.utils.clip_grad_norm_'s rule: the 2-norm of the per-tensor norms, a coefficient at most 1
        total_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(total) for total in sums]))
        coefficient = torch.clamp(value / (total_norm + 1e-6), max=1.0)
        return [total * coefficient for total in sums]

    # -- host side -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        with self.logged.installed_on(self.module), self.metric_calls.installed_on():
            yield

    def _outputs(
        self,
        loss: Tensor,
        values: tuple,
        side: dict[str, Any],
        found_inf: Tensor | None = None,
        scale: Tensor | None = None,
        skipped: Tensor | None = None,
    ) -> StepOutputs:
        """One micro-batch's ``StepOutputs`` from what its program returned."""
        logs, metric_tensors = values
        self.logged.options.update(side["options"])
        calls = join_tensors(side["calls"], list(metric_tensors))
        return StepOutputs(loss, logs, found_inf, scale, skipped, calls, side["references"])

    def host_logs(self, out: StepOutputs) -> dict[str, Any]:
        """The micro-batch's ``self.log`` values as the host hands them on, in the order they were logged: its
        Metric calls made first, on the real Metrics, eagerly (``metric_calls.py``), then a logged Metric as the
        object and a logged forward result as that call's result. Call once per ``StepOutputs``, in order."""
        # (a CUDA graph's outputs are overwritten by its next replay; a Metric may keep its inputs: list states)
        results = self.metric_calls.replay(_clone(out.metric_calls) if self.captured else out.metric_calls)
        logs: dict[str, Any] = dict(out.logs)
        for name, reference in out.references.items():
            logs[name] = self.metric_calls.resolve(reference, results)
        order = [name for name in self.logged.options if name in logs]
        return {name: logs[name] for name in order + [name for name in logs if name not in order]}

    def _call(self, name: str, batch: Any) -> Any:
        captured = self.captured.get(name)
        if captured is not None:
            return captured(batch)
        with self._running():
            return (self._accumulate if name == "accumulate" else self._update)(self._state, batch)

    def accumulate(self, batch: Any = None) -> StepOutputs:
        """Run a micro-batch that does not end its window (``None``: the staged dataset's next one)."""
        loss, values, side = self._call("accumulate", batch)
        return self._outputs(loss, values, side)

    def update(self, batch: Any = None) -> StepOutputs:
        """Run a window's last micro-batch, then update (or skip, on overflow) and reset the window."""
        changed = self.rule.changed_flags()
        if changed is not None:
            raise ProgramUnavailable(f"the update program no longer applies: {changed}")
        self.rule.refresh()
        if self._sums_eagerly():
            assert self.rank_sum is not None and self.rank_sum.all_reduce is not None  # (what _sums_eagerly says)
            with self._running():
                loss, values, side, flat = self._update_sum(self._state, batch)
                self.rank_sum.all_reduce(flat)
                found_inf = self._update_apply(self._state, flat)
        else:
            loss, values, side, found_inf = self._call("update", batch)
        note_optimizer_step(self.rule.optimizer)
        return self._outputs(loss, values, side, found_inf)

    def run_several(
        self, batches: list[Any] | None = None, hyperparameters: list[list[list[float]]] | None = None
    ) -> list[StepOutputs]:
        """Run whole windows, ``micro_steps_per_call`` micro-batches (``None``: that many from the staged dataset),
        in one call. ``hyperparameters``: per window of the call, the values its update uses (per param group, one
        float per name of ``rule.names``: ``OptimizerRule.current_values`` rows); ``None``: every update uses the
        current ``param_groups``."""
        if self.several is None:
            raise ProgramUnavailable("built without micro_steps_per_call > 1: call accumulate/update instead")
        count = self.several[0]
        if batches is not None and len(batches) != count:
            raise ValueError(f"run_several takes exactly micro_steps_per_call={count} batches; got {len(batches)}")
        changed = self.rule.changed_flags()
        if changed is not None:
            raise ProgramUnavailable(f"the update program no longer applies: {changed}")
        self.rule.refresh()
        self._fill_table(hyperparameters)
        captured = self.captured.get("several")
        if captured is not None:
            results = captured(batches)
        else:
            with self._running():
                results = self._several(self._state, batches if batches is not None else [None] * count)
        note_optimizer_step(self.rule.optimizer)
        return [self._outputs(*result[:3], *(tuple(result[3:]) + (None, None, None))[:3]) for result in results]

    def _fill_table(self, rows: list[list[list[float]]] | None) -> None:
        """Write each window's hyperparameters into the table the call reads (only when they changed)."""
        assert self.several is not None
        windows = self.several[0] // self.several[1]
        rows = rows if rows is not None else [self.rule.current_values()] * windows
        if len(rows) != windows:
            raise ValueError(f"run_several takes hyperparameters for its {windows} updates; got {len(rows)}")
        if rows == self._table_rows:
            return
        for index, table in enumerate(self.hyper_table):
            table.copy_(torch.tensor([row[index] for row in rows], dtype=torch.float64))
        self._table_rows = rows

    def _size_table(self) -> None:
        """One row per window of a call of several (none without), one table per param group: resized in place, as
        the state holds the list."""
        windows = self.several[0] // self.several[1] if self.several is not None else 0
        device = self.params[0].device
        self.hyper_table[:] = [
            torch.zeros((windows, len(self.rule.names)), dtype=torch.float64, device=device) for _ in self.rule.groups
        ]

    def unroll(self, micro_steps: int, accumulation_steps: int) -> None:
        """Before ``compile``: also build ``run_several`` over ``micro_steps`` micro-steps (whole windows of
        ``accumulation_steps``)."""
        if micro_steps < 2 or micro_steps % accumulation_steps:
            raise ValueError(f"micro_steps={micro_steps} must be a multiple of accumulation_steps={accumulation_steps}")
        if self.compile_seconds:
            raise ProgramUnavailable("unroll() comes before compile(): the programs are built already")
        self.several = (micro_steps, accumulation_steps)
        self._size_table()

    def micro_step_flops(self, example_batch: Any) -> float:
        """The FLOPs of one micro-step's matrix multiplies and convolutions (forward and backward), counted by
        running the accumulate program once eagerly on copies of the state (nothing of the run changes, random
        numbers included)."""
        device = self.params[0].device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self._running(), FlopCounterMode(display=False) as counter:
            self._accumulate_program(_clone(self._state), _clone(example_batch))
        return float(counter.get_total_flops())

    def _sums_eagerly(self) -> bool:
        """Whether the update runs as two compiled parts with an eager all-reduce between them."""
        return self.rank_sum is not None and self.rank_sum.all_reduce is not None

    def _programs(self) -> list[tuple[str, Callable[..., Any], Callable[[Any], Any]]]:
        """Name, compiled program and how to make its batch argument from one example batch."""
        programs: list[tuple[str, Callable[..., Any], Callable[[Any], Any]]] = [
            ("accumulate", self._accumulate, lambda example: example),
        ]
        if self._sums_eagerly():
            size = sum(param.numel() for param in self.params)
            flat = torch.zeros(size, dtype=torch.float32, device=self.params[0].device)
            programs.append(("update_sum", self._update_sum, lambda example: example))
            programs.append(("update_apply", self._update_apply, lambda example: flat))
        else:
            programs.append(("update", self._update, lambda example: example))
        if self.several is not None:
            count = self.several[0]
            programs.append(("several", self._several, lambda example: [example] * count))
        return programs

    def compile(self, example_batch: Any) -> None:
        """Compile both programs now, on copies of the state (nothing of the run changes, random numbers
        included), timing each."""
        device = self.params[0].device
        devices = [device] if device.type == "cuda" else []
        for name, program, batch_of in self._programs():
            start = time.perf_counter()
            with torch.random.fork_rng(devices=devices), self._running():
                program(_clone(self._state), _clone(batch_of(example_batch)))
            if devices:
                torch.cuda.synchronize(device)
            self.compile_seconds[name] = time.perf_counter() - start

    def capture(self, example_batch: Any) -> None:
        """Capture both compiled programs as CUDA graphs (after ``compile``); later calls replay them."""
        device = self.params[0].device
        for name, program, batch_of in self._programs():
            start = time.perf_counter()
            with self._running():
                self.captured[name] = CapturedProgram(program, self._state, batch_of(example_batch), _clone, device)
            torch.cuda.synchronize(device)
            self.compile_seconds[f"{name}_capture"] = time.perf_counter() - start


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
        micro_steps_per_call: above 1, also build ``run_several``: that many micro-steps unrolled into one program
            (whole windows of ``accumulation_steps``; a multiple of it). ``None``: decided from the step's size
            (``call_length.default_micro_steps``; one per call under ``RankSum(all_reduce=...)``), the reason in
            ``programs.call_note``.
        accumulation_steps: the window length ``run_several`` assumes.
        autocast: mixed precision: each forward runs in this autocast region (the backward outside it, the
            window's sum in fp32); None: the module's own dtypes.
        rank_sum: under DDP, how the update program sums the window across the processes (``RankSum``); every
            rank builds its programs with the same one. None: one process.

    Returns: the programs, or ``Unavailable`` with the one-line reason (then run the eager step instead).
    """
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
    chosen = micro_steps_per_call is None  # the length decided from the step's size, below
    micro_steps_per_call = 1 if micro_steps_per_call is None else micro_steps_per_call
    for name, value in (("micro_steps_per_call", micro_steps_per_call), ("accumulation_steps", accumulation_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not valid: pass an int >= 1")
    if not chosen and micro_steps_per_call % accumulation_steps:
        raise ValueError(
            f"micro_steps_per_call={micro_steps_per_call} is not a multiple of accumulation_steps="
            f"{accumulation_steps}: a call runs whole windows"
        )
    several = (micro_steps_per_call, accumulation_steps) if micro_steps_per_call > 1 else None
    if several is not None and rank_sum is not None and rank_sum.all_reduce is not None:
        raise ValueError(
            "micro_steps_per_call > 1 needs the sum across processes inside the program: pass"
            " RankSum(group=...), not RankSum(all_reduce=...)"
        )
    if cuda_graph and rank_sum is not None:
        raise ValueError("cuda_graph=True is for one process: the CUDA-graph programs do not sum across processes")
    if data is not None and data[1].capacity < micro_steps_per_call:
        raise ValueError(
            f"micro_steps_per_call={micro_steps_per_call} exceeds the sink indices' capacity={data[1].capacity}"
        )
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the module on a CUDA device; its parameters are on {device}")
    if data is not None and example_batch is not None:
        raise ValueError("with data=(dataset, indices) the programs gather their own batches: pass example_batch=None")
    programs = StepPrograms(module, rule, loss_scale, clip, backend, data, several, autocast, rank_sum)
    try:
        if data is not None:  # an example to compile with: the first row of the buffer (all zeros: sample 0)
            data[1].cursor.zero_()
        if chosen and (rank_sum is None or rank_sum.all_reduce is None):
            capacity = data[1].capacity if data is not None else None
            flops = programs.micro_step_flops(example_batch)
            count, programs.call_note = default_micro_steps(flops, accumulation_steps, device.type, capacity)
            if count > 1:
                programs.unroll(count, accumulation_steps)
        programs.compile(example_batch)
        if cuda_graph:
            programs.capture(example_batch)
    except Exception as error:  # a graph break, an unsupported operation, a backend failure: all say no program
        rule.discard_created()
        refused = programs.metric_calls.refusal_in(error)
        if refused is not None:
            return Unavailable(refused)
        first_line = (str(error).strip().splitlines() or [""])[0]
        return Unavailable(
            f"training_step did not compile to one graph ({type(error).__name__}: {first_line[:200]}); make it"
            " traceable or use graph_mode='eager'"
        )
    return programs
