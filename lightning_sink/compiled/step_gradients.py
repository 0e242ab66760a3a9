"""One micro-batch's forward and backward inside a step program: ``torch.func.grad_and_value`` over
``torch.func.functional_call`` of the module's ``training_step`` with the state's parameter and buffer tensors (one
graph for forward and backward; under mixed precision the forward inside the ``AutocastRegion``, the backward
outside it), what ``training_step`` logged leaving through the return value."""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value

from lightning_sink.compiled.autocast_region import AutocastRegion
from lightning_sink.compiled.device_dataset import DeviceDataset
from lightning_sink.compiled.logged_values import LoggedValues
from lightning_sink.compiled.metric_calls import MetricCalls, split_tensors

__all__ = ["StepGradients", "untrained_tensors"]


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


def untrained_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The module's tensors a program reads but does not train, by their ``functional_call`` names: the frozen
    parameters, then the buffers (the order of the state's ``"buffers"``)."""
    frozen = [(f"module.{name}", p) for name, p in module.named_parameters() if not p.requires_grad]
    return frozen + [(f"module.{name}", b) for name, b in module.named_buffers()]


class StepGradients:
    """The gradients, loss and logged values of one micro-batch, traced into the program that calls ``of``."""

    def __init__(
        self,
        module: nn.Module,
        autocast: AutocastRegion | None,
        logged: LoggedValues,
        metric_calls: MetricCalls,
        dataset: tuple[Tensor, ...],
    ) -> None:
        self.module, self._step = module, _TrainingStep(module)
        self.autocast, self.logged, self.metric_calls = autocast, logged, metric_calls
        self._dataset = dataset  # read only: never copied
        self._param_names = [f"module.{name}" for name, param in module.named_parameters() if param.requires_grad]
        self._buffer_names = [name for name, _ in untrained_tensors(module)]

    def of(self, state: dict[str, Any], batch: Any) -> tuple[list[Tensor], Tensor, tuple, dict]:
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
