"""Predict the layout file of a ``SinkModelParallelStrategy`` run without launching its processes.

MindSpore's ``infer_train_layout``: "compile" the network for the target parallel configuration and read off the
strategy, without training. Here the LightningModule is built on the meta device (no memory), its own
``configure_model`` shards it on a device mesh of the target shape under a fake process group (no peers, no
communication), its optimizer takes one step on zero meta gradients so that its state exists as after training,
and the layout is computed from the state dict DCP would be handed - the same function the strategy uses when it
saves. One rank's view is enough: every rank's chunk follows from the mesh and the placements.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer

from lightning_sink import _lightning_compat as compat
from lightning_sink.checkpoint_format.dcp_folder import checkpoint_layout
from lightning_sink.cli_parser import OneLineErrorParser
from lightning_sink.layout import Layout, save_layout
from lightning_sink.layout_arguments import configure_parser

__all__ = ["infer_layout", "run", "main"]

MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")  # Lightning's ModelParallelStrategy names them so


def _resolve(module: str | Callable[..., pl.LightningModule]) -> Callable[..., pl.LightningModule]:
    if not isinstance(module, str):
        return module
    module_path, _, name = module.rpartition(".")
    try:
        factory = getattr(importlib.import_module(module_path), name, None) if module_path else None
    except ImportError as error:
        raise ValueError(f"module={module!r}: cannot import {module_path!r} ({error}).") from error
    if module_path and factory is None:
        raise ValueError(f"module={module!r}: {module_path!r} has no attribute {name!r}.")
    if factory is None:
        raise ValueError(f"module={module!r} is not valid: pass a class path like 'package.module.MyLightningModule'.")
    return factory


def _validate_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not valid: pass an int >= 1.")
    return value


def _single_optimizer(configured: Any) -> Optimizer:
    """The optimizer of what ``configure_optimizers`` returned (the forms Lightning accepts, one optimizer)."""
    if isinstance(configured, Mapping):
        configured = configured.get("optimizer")
    if isinstance(configured, (list, tuple)) and configured:
        first = configured[0]
        configured = first if not isinstance(first, Mapping) else first.get("optimizer")
        if isinstance(configured, (list, tuple)) and len(configured) == 1:
            configured = configured[0]
    if not isinstance(configured, Optimizer):
        raise ValueError(
            f"configure_optimizers returned {type(configured).__name__}; infer_layout needs exactly one optimizer"
            " (SinkModelParallelStrategy supports one). Pass with_optimizer=False for the parameters only."
        )
    return configured


def _configured_optimizer(module: pl.LightningModule, label: str) -> tuple[Optimizer | None, str | None]:
    """The module's optimizer, or None and why it was left out: a ``configure_optimizers`` that reads the Trainer
    (its steps, its loaders) cannot run here, where there is none; the parameters' layout is still right."""
    try:
        configured = module.configure_optimizers()
    except RuntimeError as error:
        if "not attached to a `Trainer`" not in str(error):
            raise
        return None, (
            f"optimizer state left out: {label}.configure_optimizers needs a Trainer (it reads self.trainer, and"
            " none runs here); the layout holds the parameters only (--no-optimizer leaves it out without trying)"
        )
    return _single_optimizer(configured), None


def _state_to_save(module: pl.LightningModule, with_optimizer: bool, label: str) -> tuple[dict[str, Any], str | None]:
    """What ``SinkModelParallelStrategy.save_checkpoint`` hands to DCP: ``state_dict`` and ``optimizer_0``; and why
    the optimizer state was left out, when it was not asked to be."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=False)  # (the real save also offloads to CPU: no layout change)
    state: dict[str, Any] = {"state_dict": get_model_state_dict(module, options=options)}
    optimizer, left_out = _configured_optimizer(module, label) if with_optimizer else (None, None)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        optimizer.step()  # on meta tensors: creates the state (exp_avg, step, ...) with its real placements
        state["optimizer_0"] = get_optimizer_state_dict(module, optimizer, options=options)
    return state, left_out


def _shard(module: pl.LightningModule, mesh: Any, label: str) -> None:
    """The module's own ``configure_model``; for a module without one (a one-device model), what its minimal one
    would be: FSDP2's ``fully_shard`` over the data-parallel ranks (each parameter's rows split evenly)."""
    if is_overridden("configure_model", module):
        module.configure_model()
        return
    if mesh["tensor_parallel"].size() > 1:
        raise TypeError(
            f"module={label} does not override configure_model, so there is no tensor-parallel plan for"
            " tensor_parallel_size > 1: write configure_model (parallelize_module on self.device_mesh), or pass"
            " tensor_parallel_size=1 for the default, fully_shard over the data-parallel ranks."
        )
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh["data_parallel"])


def _infer(
    module: str | Callable[..., pl.LightningModule],
    data_parallel_size: int,
    tensor_parallel_size: int,
    init_args: Mapping[str, Any] | None,
    with_optimizer: bool,
) -> tuple[Layout, str | None]:
    """``infer_layout``'s work; also says why the optimizer state was left out (None: it was not)."""
    world_size = _validate_size("data_parallel_size", data_parallel_size) * _validate_size(
        "tensor_parallel_size", tensor_parallel_size
    )
    factory = _resolve(module)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("infer_layout runs its own fake process group; call it outside a distributed run.")
    from torch.distributed.device_mesh import init_device_mesh

    _fake_process_group(world_size)
    try:
        mesh = init_device_mesh("cpu", (data_parallel_size, tensor_parallel_size), mesh_dim_names=MESH_DIM_NAMES)
        with torch.device("meta"):
            lightning_module = _users_code("building it", module, lambda: factory(**dict(init_args or {})))
        if not isinstance(lightning_module, pl.LightningModule):
            raise TypeError(f"module={module!r} built a {type(lightning_module).__name__}, not a LightningModule.")
        compat.set_module_device_mesh(lightning_module, mesh)
        _users_code("sharding it", module, lambda: _shard(lightning_module, mesh, repr(module)))
        label = module if isinstance(module, str) else getattr(module, "__qualname__", repr(module))
        state, left_out = _users_code(
            "its optimizer", module, lambda: _state_to_save(lightning_module, with_optimizer, label)
        )
        return checkpoint_layout(state, world_size), left_out
    finally:
        dist.destroy_process_group()


def _users_code(what: str, module: object, call: Callable[[], Any]) -> Any:
    """Run the module's own code; an error in it becomes one line naming the module and the stage (a ValueError
    or TypeError as it was; anything else, e.g. a RuntimeError in ``__init__``, as a ValueError)."""
    try:
        return call()
    except (ValueError, TypeError):
        raise
    except Exception as error:  # the user's module may raise anything; the CLI reports it on one line
        raise ValueError(f"module={module!r}: {what} raised {type(error).__name__}: {error}") from error


def _fake_process_group(world_size: int) -> None:
    from lightning_sink._torch_compat import init_fake_process_group

    init_fake_process_group(world_size)  # collectives return at once, no peers


def infer_layout(
    module: str | Callable[..., pl.LightningModule],
    data_parallel_size: int,
    tensor_parallel_size: int,
    *,
    init_args: Mapping[str, Any] | None = None,
    with_optimizer: bool = True,
) -> Layout:
    """The layout file a ``SinkModelParallelStrategy(data_parallel_size, tensor_parallel_size)`` run would write.

    Args:
        module: the LightningModule class (or a class path ``"pkg.mod.Class"``, or a factory); it is built with
            ``init_args`` on the meta device and sharded by its own ``configure_model``.
        data_parallel_size, tensor_parallel_size: the target mesh (world size = their product).
        init_args: keyword arguments for ``module``.
        with_optimizer: include the optimizer state (from ``configure_optimizers``).

    Runs in this process only; it must not already be part of a process group. A module without
    ``configure_model`` is sharded as its minimal one would: ``fully_shard`` over the data-parallel ranks (a
    one-device model's layout for resharding its checkpoint). A ``configure_optimizers`` that needs a Trainer
    leaves the optimizer state out, with a warning saying so.
    """
    layout, left_out = _infer(module, data_parallel_size, tensor_parallel_size, init_args, with_optimizer)
    if left_out is not None:
        warnings.warn(left_out, stacklevel=2)
    return layout


def run(args: argparse.Namespace) -> int:
    """Predict and write the layout file; bad input raises ``ValueError``/``TypeError`` before anything is written."""
    try:
        init_args = json.loads(args.init_args)
    except json.JSONDecodeError as error:
        raise ValueError(f"--init-args {args.init_args!r} is not JSON: {error}") from error
    if not isinstance(init_args, dict):
        raise ValueError(f"--init-args {args.init_args!r} must be a JSON object of keyword arguments")
    layout, left_out = _infer(
        args.model, args.data_parallel_size, args.tensor_parallel_size, init_args, not args.no_optimizer
    )
    if left_out is not None:
        print(f"note: {left_out}", file=sys.stderr)
    save_layout(layout, args.output)
    print(f"wrote {args.output}: {len(layout.tensors)} tensors on a {'x'.join(map(str, layout.mesh.shape))} mesh")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-sink layout``: write the predicted layout file for a target mesh."""
    parser = OneLineErrorParser(
        prog="lightning-sink layout",
        description="Predict the layout (strategy) file of a SinkModelParallelStrategy run without launching it.",
    )
    configure_parser(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError) as error:
        parser.error(str(error))  # exits with status 2


if __name__ == "__main__":
    raise SystemExit(main())
