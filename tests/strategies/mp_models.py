"""LightningModules that shard themselves in ``configure_model``: FSDP2 over data parallel, TP over the other dim."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.helpers import InjectingClassifier, TinyClassifier


def shard_mlp(module: TinyClassifier) -> None:
    """``net = Linear(8, 16), Tanh, Linear(16, 4)``: column-wise then row-wise over the tensor-parallel ranks (the
    hidden layer is split, the logits are replicated), then each Linear and the MLP fully sharded over data parallel."""
    mesh = module.device_mesh
    parallelize_module(module.net, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (module.net[0], module.net[2]):
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(module.net, mesh=mesh["data_parallel"])


class TPClassifier(TinyClassifier):
    """``TinyClassifier`` (same initial weights for a seed), sharded: 2 FSDP parameter groups (the two Linears)."""

    FSDP_GROUPS_WITH_PARAMETERS = 2

    def configure_model(self) -> None:
        shard_mlp(self)


class MixedMeshClassifier(TinyClassifier):
    """``TinyClassifier`` with a ``LayerNorm`` over its logits; the MLP sharded like ``TPClassifier`` (parameters on the
    2-D mesh), the norm only fully sharded (parameters on the 1-D data-parallel mesh), as a language model's norms
    and embeddings often are. Unsharded, it is the single-process reference."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.net(x))

    def configure_model(self) -> None:
        shard_mlp(self)
        fully_shard(self.norm, mesh=self.device_mesh["data_parallel"])


class InjectingTPClassifier(InjectingClassifier):
    """``InjectingClassifier`` (inf loss at chosen micro-batches, on one rank), sharded like ``TPClassifier``."""

    def configure_model(self) -> None:
        shard_mlp(self)


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its global value (a collective: call on every rank)."""
    return {
        name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
        for name, param in module.named_parameters()
    }


def flat(params: dict[str, Any]) -> torch.Tensor:
    return torch.cat([value.reshape(-1).double() for value in params.values()])
