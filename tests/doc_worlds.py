"""What the docs' snippets name but leave to the reader, prepared before a snippet runs as written.

- ``write_my_pkg(folder)``: the reader's package ``my_pkg`` (``models.MLP``: model_parallel.md's MLP with its width
  an argument; ``data.RandomDigits``: a data module of random 784-feature samples), importable from ``folder``.
- ``target_rank_1(hidden)``: the preamble of a snippet that runs inside rank 1 of a 2-process target run (mesh 1 x 2): torch's
  fake process group stands in for the other rank, as ``infer_layout`` does; it names ``model``, ``optimizer`` and
  ``device_mesh``.
- ``rank_shard(fqn, full, rank)``: the independent reference for a 1 x 2 target layout of that MLP, the tensor
  parallelism of its ``configure_model`` written out by hand (column-wise ``net.0``, row-wise ``net.2``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["MY_PKG_DATA", "MY_PKG_MODELS", "flat_names", "forget_my_pkg", "rank_shard", "target_rank_1", "write_my_pkg"]

MY_PKG_MODELS = """
import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def shard(net, mesh):
    \"\"\"model_parallel.md's configure_model: tensor parallel column- then row-wise, FSDP2 over data parallel.\"\"\"
    parallelize_module(net, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(net, mesh=mesh["data_parallel"])


class MLP(pl.LightningModule):  # model_parallel.md's MLP, with its width an argument
    def __init__(self, hidden: int = 512):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(784, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))

    def configure_model(self):
        if self.device_mesh is not None:  # on one device there is nothing to shard
            shard(self.net, self.device_mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
"""

MY_PKG_DATA = """
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class RandomDigits(pl.LightningDataModule):
    \"\"\"Random 784-feature samples of 10 classes, the same on every rank (seeded).\"\"\"

    def __init__(self, samples: int = 64, batch_size: int = 8):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.train_set = TensorDataset(
            torch.randn(samples, 784, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
        )
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size)
"""


def write_my_pkg(folder: Path) -> Path:
    (folder / "my_pkg").mkdir(parents=True, exist_ok=True)
    (folder / "my_pkg" / "__init__.py").write_text("")
    (folder / "my_pkg" / "models.py").write_text(MY_PKG_MODELS)
    (folder / "my_pkg" / "data.py").write_text(MY_PKG_DATA)
    return folder


def forget_my_pkg() -> None:
    """Drop the imported ``my_pkg`` modules, so that the next import reads the package from its new folder."""
    for module in [name for name in sys.modules if name == "my_pkg" or name.startswith("my_pkg.")]:
        del sys.modules[module]


def target_rank_1(hidden: int) -> str:
    return f"""
# tests/test_docs.py: rank 1 of the 2-process target run (mesh 1 x 2); the fake process group stands in for rank 0
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from my_pkg.models import MLP, shard

dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
device_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
model = MLP(hidden={hidden})
shard(model.net, device_mesh)  # what configure_model does in the run
optimizer = model.configure_optimizers()
for parameter in model.parameters():  # a step on zero gradients: the optimizer has its state (moments, step)
    parameter.grad = torch.zeros_like(parameter)
optimizer.step()
optimizer.zero_grad()
"""


def flat_names(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested checkpoint dict's leaves under dotted names (``optimizer_0.state.net.0.weight.exp_avg``)."""
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_names(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def rank_shard(fqn: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """The part of ``full`` that ``rank`` of a 1 x 2 mesh holds: ``net.0`` split by output features (weight rows,
    bias), ``net.2``'s weight by input features (columns), its bias and optimizer steps whole."""
    if ".net.0." in f".{fqn}" and full.dim() >= 1:
        return full.chunk(2, dim=0)[rank]
    if ".net.2.weight" in f".{fqn}" and full.dim() == 2:
        return full.chunk(2, dim=1)[rank]
    return full
