"""``SinkModelParallelStrategy`` loading a checkpoint folder from untrusted hands runs no code from it.

DCP's own loader reads ``.metadata`` with a plain ``pickle.load`` and non-tensor values with
``torch.load(weights_only=False)``; each test plants a pickle that would create a folder when unpickled, in one of
those places of a real DCP folder, and loads it through the strategy as ``Trainer.fit(ckpt_path=...)`` does.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_module

from lightning_sink import SinkModelParallelStrategy
from lightning_sink.layout.dcp_metadata import read_dcp_metadata


class PlantsAFolder:
    """Unpickling this calls ``os.mkdir(path)``: the stand-in for any code a crafted checkpoint could run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.fixture(autouse=True)
def one_process_group():
    """A real one-process gloo group and a 1-device mesh, so that parameters are DTensors as in a model-parallel run
    (Lightning's loader accepts only such modules)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        distribute_module(self.layer, init_device_mesh("cpu", (1,)))  # replicated DTensor parameters


def saved_folder(tmp_path: Path) -> tuple[Path, Model, torch.optim.Optimizer]:
    """A real DCP folder of a model and its Adam state, as SinkModelParallelStrategy saves one (no process group)."""
    model = Model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    folder = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            {"state_dict": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, optimizer)},
            checkpoint_id=folder,
        )
    torch.save({"epoch": 1, "global_step": 1}, folder / "meta.pt")
    return folder, model, optimizer


def strategy_for(model: Model, optimizer: torch.optim.Optimizer) -> SinkModelParallelStrategy:
    strategy = SinkModelParallelStrategy()
    strategy.connect(model)  # what the Trainer does before loading
    strategy.optimizers = [optimizer]
    return strategy


def load(strategy: SinkModelParallelStrategy, folder: Path) -> dict:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return strategy.load_checkpoint(folder)


def test_a_crafted_dcp_metadata_file_runs_no_code(tmp_path: Path):
    folder, model, optimizer = saved_folder(tmp_path)
    marker = tmp_path / "code_ran"
    (folder / ".metadata").write_bytes(pickle.dumps(PlantsAFolder(marker)))
    with pytest.raises(ValueError, match=r"ckpt/\.metadata.*refusing to load posix.mkdir"):
        load(strategy_for(model, optimizer), folder)
    assert not marker.exists()


def test_a_crafted_non_tensor_value_runs_no_code(tmp_path: Path):
    folder, _model, _optimizer = saved_folder(tmp_path)
    marker = tmp_path / "code_ran"
    metadata = read_dcp_metadata(folder)
    fqn = next(
        fqn
        for fqn, item in metadata.state_dict_metadata.items()
        if isinstance(item, BytesStorageMetadata) and fqn.startswith("optimizer_0.param_groups")
    )
    payload = io.BytesIO()
    torch.save(PlantsAFolder(marker), payload)
    data_file = folder / metadata.storage_data[MetadataIndex(fqn)].relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as handle:
        handle.write(payload.getvalue())
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo(data_file.name, offset, len(payload.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    fresh = Model()
    with pytest.raises(ValueError, match=r"ckpt' could not be loaded: UnpicklingError: Weights only load failed"):
        load(strategy_for(fresh, torch.optim.Adam(fresh.parameters())), folder)
    assert not marker.exists()


def test_an_untouched_folder_loads_with_no_weights_only_warning(tmp_path: Path):
    folder, model, optimizer = saved_folder(tmp_path)
    fresh = Model()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint = load(strategy_for(fresh, fresh_optimizer), folder)
    assert not [w for w in caught if "weights_only" in str(w.message)]
    assert checkpoint["global_step"] == 1
    assert torch.equal(fresh.layer.weight.full_tensor(), model.layer.weight.full_tensor())
    saved, loaded = optimizer.state_dict()["state"][0]["exp_avg"], fresh_optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(loaded.full_tensor(), saved.full_tensor())
