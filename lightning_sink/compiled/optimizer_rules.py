"""A user's ``torch.optim`` optimizer, its update written functionally so it can live inside a compiled program.

The optimizer stays the owner of its state: the rule reads the very tensors in ``optimizer.state`` (creating them as
the optimizer's own first step would, zeros and a zero step count) and writes its results back into them in place,
so ``optimizer.state_dict()``, checkpoints, resume and LR schedulers see what an eager run shows them. Learning
rates and the other hyperparameters a scheduler may move enter as 0-dim tensors, refreshed from ``param_groups``
before each update, so a step scheduler changes values, never the compiled program.

Supported: ``SGD`` (momentum, Nesterov, weight decay, maximize; dampening 0), ``Adam`` and ``AdamW`` (weight decay,
amsgrad, maximize), exactly those classes (a subclass may change ``step``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_sink._torch_compat import note_optimizer_step

__all__ = ["OptimizerRule", "optimizer_rule"]

# Hyperparameters entering as tensors (they may be scheduled) and flags fixed at build time (a change is a new
# program), per optimizer class.
_SGD_SCHEDULED = ("lr", "momentum", "weight_decay")
_ADAM_SCHEDULED = ("lr", "beta1", "beta2", "eps", "weight_decay")


@dataclass
class _Group:
    """One ``param_groups`` entry: which of the program's parameters it holds and its hyperparameter tensors."""

    index: int  # in optimizer.param_groups
    members: list[int]  # positions in the program's parameter list
    scheduled: dict[str, Tensor]  # name -> 0-dim float64 tensor on the device
    flags: dict[str, object]  # fixed at build time
    last_values: dict[str, object]  # what the tensors were last set from (a refresh writes only on change)


class OptimizerRule:
    """The functional update of one supported optimizer over the program's trainable parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[Tensor], kind: str) -> None:
        self.optimizer, self.params, self.kind = optimizer, params, kind
        position = {id(param): i for i, param in enumerate(params)}
        self.groups: list[_Group] = []
        for index, group in enumerate(optimizer.param_groups):
            members = [position[id(param)] for param in group["params"] if id(param) in position]
            flags = {name: group.get(name, False) for name in ("nesterov", "maximize", "amsgrad", "dampening")}
            if kind == "adamw" or group.get("decoupled_weight_decay", False):
                flags["decoupled"] = True
            self.groups.append(_Group(index, members, {}, flags, {}))
        device = params[0].device if params else torch.device("cpu")
        self.names = _SGD_SCHEDULED if kind == "sgd" else _ADAM_SCHEDULED  # the scheduled hyperparameters, in order
        self._read_values = _sgd_values if kind == "sgd" else _adam_values  # (read before every update of a call)
        for rule_group in self.groups:
            rule_group.scheduled = {name: torch.zeros((), dtype=torch.float64, device=device) for name in self.names}
        self.group_of = {i: group for group in self.groups for i in group.members}
        self.created: list[Tensor] = []  # parameters whose optimizer state this rule created (see discard_created)
        self.state = [self._state_for(i) for i in range(len(params))]
        self._stepped_noted = False  # (``note_stepped``)
        self.refresh()

    # -- host side, before each update ------------------------------------------------------------------------

    def refresh(self) -> None:
        """Copy the current hyperparameters from ``param_groups`` into their tensors (only those that changed), and
        take back any state tensor the optimizer replaced (``load_state_dict`` does) by copying it into the
        program's own, which keeps the addresses a compiled or captured program reads."""
        for i, state in enumerate(self.state):
            own = self.optimizer.state[self.params[i]]
            for name, tensor in state.items():
                if own.get(name) is not tensor:
                    tensor.copy_(own[name])
                    own[name] = tensor
        for group in self.groups:
            settings = self.optimizer.param_groups[group.index]
            for name, tensor in group.scheduled.items():
                value = _setting(settings, name)
                if isinstance(value, Tensor):
                    tensor.copy_(value, non_blocking=True)  # a tensor lr (allowed by torch.optim) stays on device
                elif group.last_values.get(name) != value:
                    tensor.fill_(float(value))
                    group.last_values[name] = value

    def note_stepped(self) -> None:
        """Tell the LR schedulers that the optimizer stepped (``note_optimizer_step``), as its own ``step`` would: a
        program's update does not call it. Once is enough: the flag stays set, and a scheduler reads it at its own
        first step alone."""
        if not self._stepped_noted:
            note_optimizer_step(self.optimizer)
            self._stepped_noted = True

    def current_values(self) -> list[list[float]]:
        """The scheduled hyperparameters as ``param_groups`` hold them now: per group, one float per name of
        ``names`` (a row of the table that gives each update of a call of several its own values)."""
        groups, read = self.optimizer.param_groups, self._read_values
        return [read(groups[group.index]) for group in self.groups]

    def changed_flags(self) -> str | None:
        """The first build-time flag a ``param_groups`` entry no longer has (the program no longer applies)."""
        for group in self.groups:
            settings = self.optimizer.param_groups[group.index]
            for name in ("nesterov", "maximize", "amsgrad", "dampening"):
                value, now = group.flags[name], settings.get(name, False)
                if now != value:
                    return f"param_groups[{group.index}][{name!r}] changed from {value!r} to {now!r}"
        return None

    def lost_state(self) -> str | None:
        """Which parameter's optimizer state no longer holds what the programs update (``optimizer.state`` cleared or
        an entry dropped, as a warm restart does), or None."""
        for i, state in enumerate(self.state):
            own = self.optimizer.state.get(self.params[i], {})
            missing = [name for name in state if name not in own]
            if missing:
                return f"the optimizer's state of parameter {i} lost {', '.join(missing)} (optimizer.state cleared)"
        return None

    def _state_for(self, i: int) -> dict[str, Tensor]:
        """The optimizer's own state tensors of parameter ``i``, created as its first step would create them."""
        param, group = self.params[i], self.group_of.get(i)
        if group is None:  # a trainable parameter the optimizer does not hold: it never moves
            return {}
        if param not in self.optimizer.state:
            self.created.append(param)
        state = self.optimizer.state[param]
        if self.kind == "sgd":
            settings = self.optimizer.param_groups[group.index]
            if settings["momentum"] != 0 and state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                # torch's first step copies the gradient into the buffer; with dampening 0 (required) a zero
                # buffer times momentum plus the gradient is the same value, so no first-step flag is needed
            return {"momentum_buffer": state["momentum_buffer"]} if "momentum_buffer" in state else {}
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.flags["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if state["step"].device != param.device:
            # the program keeps the count on the parameter's device (no host read of it); torch.optim reads a
            # device-resident step as it does for capturable=True
            state["step"] = state["step"].to(param.device)
        return dict(state)

    # -- inside the compiled update program ----------------------------------------------------------------------

    def discard_created(self) -> None:
        """Remove the state this rule created (programs that were not built leave the optimizer as it was)."""
        for param in self.created:
            self.optimizer.state.pop(param, None)
        self.created.clear()

    def tensors(self) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
        """The state tensors per parameter and the hyperparameter tensors per group: the arguments of ``apply``."""
        return self.state, [group.scheduled for group in self.groups]

    def apply(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        states: list[dict[str, Tensor]],
        hyper: list[dict[str, Tensor]],
        skip: Tensor | None,
    ) -> None:
        """Update every parameter from its (unscaled, clipped) gradient; where ``skip`` is true nothing moves."""
        for group, scheduled in zip(self.groups, hyper):
            if self.kind == "sgd":
                for i in group.members:
                    self._sgd(scheduled, group.flags, params[i], grads[i], states[i], skip)
                continue
            corrections = _bias_corrections([states[i]["step"] for i in group.members], scheduled)
            for column, i in enumerate(group.members):
                values = {**scheduled, "bias_corrections": corrections[:, column]}
                self._adam(values, group.flags, params[i], grads[i], states[i], skip)

    @staticmethod
    def _write(target: Tensor, value: Tensor, skip: Tensor | None) -> None:
        target.copy_(value if skip is None else torch.where(skip, target, value))

    def _sgd(
        self,
        h: dict[str, Tensor],
        flags: dict,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        skip: Tensor | None,
    ) -> None:
        grad = -grad if flags["maximize"] else grad
        grad = grad + h["weight_decay"].to(grad.dtype) * param
        if "momentum_buffer" in state:
            buf = state["momentum_buffer"]
            new_buf = buf * h["momentum"].to(buf.dtype) + grad
            self._write(buf, new_buf, skip)
            grad = grad + h["momentum"].to(grad.dtype) * new_buf if flags["nesterov"] else new_buf
        self._write(param, param - h["lr"].to(param.dtype) * grad, skip)

    def _adam(
        self,
        h: dict[str, Tensor],
        flags: dict,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        skip: Tensor | None,
    ) -> None:
        """Adam's or AdamW's update of one parameter; ``h``: its group's scheduled values and its two bias
        corrections (``"bias_corrections"``, a column of ``_bias_corrections``)."""
        grad = -grad if flags["maximize"] else grad
        lr, beta1, beta2 = h["lr"], h["beta1"], h["beta2"]
        step = state["step"] + 1
        new_param = param
        if flags.get("decoupled"):
            new_param = param * (1 - lr * h["weight_decay"]).to(param.dtype)
        else:
            grad = grad + h["weight_decay"].to(grad.dtype) * param
        exp_avg = state["exp_avg"].lerp(grad, (1 - beta1).to(grad.dtype))
        exp_avg_sq = state["exp_avg_sq"] * beta2.to(grad.dtype) + (1 - beta2).to(grad.dtype) * grad * grad
        bias_correction1, bias_correction2 = h["bias_corrections"].unbind()
        bias_correction2_sqrt = torch.sqrt(bias_correction2)
        step_size = (lr / bias_correction1).to(param.dtype)
        second = exp_avg_sq
        if flags["amsgrad"]:
            second = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
            self._write(state["max_exp_avg_sq"], second, skip)
        denom = second.sqrt() / bias_correction2_sqrt.to(param.dtype) + h["eps"].to(param.dtype)
        new_param = new_param - step_size * exp_avg / denom
        self._write(state["exp_avg"], exp_avg, skip)
        self._write(state["exp_avg_sq"], exp_avg_sq, skip)
        self._write(state["step"], step, skip)
        self._write(param, new_param, skip)


def _bias_corrections(steps: list[Tensor], hyper: dict[str, Tensor]) -> Tensor:
    """Adam's bias corrections ``1 - beta ** (step + 1)`` of one group's parameters, for ``beta1`` (row 0) and
    ``beta2`` (row 1), one column per parameter, in float64 as torch.optim computes them from a Python float step.

    Written as ``exp((step + 1) * log(beta))``, equal to the power within float64 rounding (far below the float32
    of the update), for where Inductor places it on a CPU: a small value holding a logarithm or an exponential that
    several kernels read is computed once into a buffer of its own, whereas a plain power was computed again inside
    every parameter's elementwise loop, once per vector of elements (a C library call the C++ compiler may not move
    out of the loop), which made it a large share of the whole update."""
    counts = torch.stack(steps).to(torch.float64) + 1
    betas = torch.stack([hyper["beta1"], hyper["beta2"]]).to(torch.float64)
    return 1 - torch.exp(counts[None, :] * torch.log(betas)[:, None])


def _sgd_values(settings: dict) -> list[float]:
    """``_SGD_SCHEDULED``'s values in a ``param_groups`` entry."""
    return [float(settings["lr"]), float(settings["momentum"]), float(settings["weight_decay"])]


def _adam_values(settings: dict) -> list[float]:
    """``_ADAM_SCHEDULED``'s values in a ``param_groups`` entry."""
    beta1, beta2 = settings["betas"]
    return [float(settings["lr"]), float(beta1), float(beta2), float(settings["eps"]), float(settings["weight_decay"])]


def _setting(settings: dict, name: str) -> Any:
    """A scheduled hyperparameter's value in a ``param_groups`` entry (Adam's betas are two of them)."""
    return settings["betas"][0 if name == "beta1" else 1] if name.startswith("beta") else settings[name]


def optimizer_rule(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> OptimizerRule | str:
    """The functional rule of ``optimizer`` over ``params`` (its trainable parameters), or why there is none."""
    kinds = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
    kind = kinds.get(type(optimizer))
    if kind is None:
        return (
            f"the optimizer {type(optimizer).__qualname__} has no compiled update rule (supported: SGD, Adam, AdamW"
            " exactly, not subclasses): use one of those or graph_mode='eager'"
        )
    owned = {id(param) for group in optimizer.param_groups for param in group["params"]}
    if not any(id(param) in owned for param in params):
        return "the optimizer holds none of the module's trainable parameters"
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if param.is_complex() or param.is_sparse:
                return f"param_groups[{index}] holds a complex or sparse parameter, which the compiled rule does not handle"
        if kind == "sgd" and group.get("dampening", 0) != 0:
            return (
                f"SGD(dampening={group['dampening']!r}) in param_groups[{index}]: the compiled rule needs dampening=0"
            )
        for name in ("lr", "momentum", "weight_decay", "eps"):
            value = group.get(name, 0.0)
            if not isinstance(value, Tensor) and not math.isfinite(float(value)):
                return f"param_groups[{index}][{name!r}]={value!r} is not a finite number"
    return OptimizerRule(optimizer, params, kind)
