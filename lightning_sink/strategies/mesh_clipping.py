"""Gradient clipping for a model whose parameters live on different device meshes (FSDP2 + tensor parallel).

With FSDP2 + TP a tensor-parallel layer's parameters are DTensors on the 2-D ``(data_parallel, tensor_parallel)``
mesh, while a layer that is only fully sharded (a norm, an embedding left unsplit) has its parameters on the 1-D
data-parallel mesh. ``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which DTensor refuses across
meshes ("All operands in aten.stack.default must have the same mesh"), and ``clip_grad_value_`` groups them into
one foreach call the same way. Lightning's precision plugins call exactly those two functions.

``MeshClipping`` replaces them, for the strategy's precision plugin, with clipping on the local shards:

- by norm: each rank sums the squares of its local shards, each divided by how many ranks hold the same values
  (the placements that replicate it on its mesh, times the copies of that mesh in the world), so that one
  ``all_reduce`` over the world gives the squared global norm over all parameters - what a single process
  holding the full model computes. Every rank then scales its shards by the same coefficient (``clip_grad_norm_``'s
  rule: ``max_norm / (norm + 1e-6)``, at most 1);
- by value: each local shard is clamped; values do not depend on other ranks, so nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["MeshClipping", "clip_grad_norm_across_meshes", "clip_grad_value_local"]


def _local(grad: Tensor) -> Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _copies(grad: Tensor, world_size: int) -> int:
    """How many ranks of the world hold the same values as this rank's local part of ``grad``."""
    if not isinstance(grad, DTensor):
        return world_size  # a plain tensor: every rank holds all of it
    mesh = grad.device_mesh
    copies = world_size // mesh.size()  # a sub-mesh (e.g. data parallel) exists once per other mesh coordinate
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(
                f"gradient clipping needs reduced gradients, but one is a partial sum on mesh {mesh} (placements"
                f" {grad.placements}): reduce it (redistribute to Shard or Replicate) before the optimizer step"
            )
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


@torch.no_grad()
def clip_grad_norm_across_meshes(parameters: Iterable[Tensor], max_norm: float, world_size: int) -> Tensor:
    """Scale every gradient so that their global 2-norm is at most ``max_norm``; return that norm (before scaling).
    One ``all_reduce`` when ``world_size > 1``; call on every rank."""
    grads = [param.grad for param in parameters if param.grad is not None]
    if not grads:
        return torch.zeros(())
    locals_ = [_local(grad) for grad in grads]
    device = locals_[0].device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grad, local in zip(grads, locals_):
        squares += local.float().square().sum() / _copies(grad, world_size)
    if world_size > 1:
        dist.all_reduce(squares)
    total = squares.sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for local in locals_:
        local.mul_(coefficient.to(local.dtype))
    return total


@torch.no_grad()
def clip_grad_value_local(parameters: Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient to ``[-clip_value, clip_value]``, shard by shard."""
    for param in parameters:
        if param.grad is not None:
            _local(param.grad).clamp_(-clip_value, clip_value)


class MeshClipping:
    """Routes a Lightning precision plugin's ``clip_grad_by_norm`` / ``clip_grad_by_value`` (what
    ``gradient_clip_val`` and ``LightningModule.clip_gradients`` end in) to the functions above, for one fit.

    The plugin's own methods are shadowed by attributes of the plugin instance and restored by ``remove``: the
    plugin stays the one Lightning and the user configured (its type, its loss scale), only its clipping moves.
    """

    def __init__(self, plugin: Any, world_size: int) -> None:
        self.plugin, self.world_size = plugin, world_size
        plugin.clip_grad_by_norm = self.clip_grad_by_norm
        plugin.clip_grad_by_value = self.clip_grad_by_value

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm_across_meshes(self.plugin.main_params(optimizer), float(clip_val), self.world_size)

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_value_local(self.plugin.main_params(optimizer), float(clip_val))

    def remove(self) -> None:
        for name in ("clip_grad_by_norm", "clip_grad_by_value"):
            self.plugin.__dict__.pop(name, None)
