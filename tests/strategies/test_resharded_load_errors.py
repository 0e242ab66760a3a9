"""What a resharded checkpoint may not carry to another mesh, and the mesh check, on real files and a real mesh.

The checkpoints come from one-device runs with ``ReshardCheckpoint`` (in this process); the device mesh is built
by ``init_device_mesh`` under torch's fake process group (no peers), as ``infer_layout`` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh

from lightning_sink import SinkModelParallelStrategy, SinkStrategy
from lightning_sink.callbacks import ReshardCheckpoint
from lightning_sink.checkpoint_format.resharded_folder import rank_file_path
from lightning_sink.checkpoint_format.resharded_load import adapt_sink_state, check_layout_matches_mesh
from lightning_sink.layout import save_layout
from lightning_sink.layout_inference import infer_layout
from lightning_sink.reshard import load_resharded_checkpoint, transform_checkpoints, unpickle_carried
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer
from tests.strategies.mp_models import TPClassifier

INIT_ARGS = {"optimizer": "adamw", "lr": 0.01}


def resharded(tmp_path: Path, name: str, strategy: SinkStrategy, batches: int, **trainer_kwargs) -> Path:
    layout = save_layout(infer_layout(TPClassifier, 1, 2, init_args=INIT_ARGS), tmp_path / "tp2.json")
    trainer = quiet_trainer(
        strategy=strategy, devices=1, callbacks=[ReshardCheckpoint(layout, tmp_path / name)], **trainer_kwargs
    )
    trainer.fit(TinyClassifier(**INIT_ARGS), loader(make_dataset(num_samples=4 * batches), 4))
    return tmp_path / name


def sink_state(folder: Path) -> dict:
    checkpoint = load_resharded_checkpoint(rank_file_path(folder, 0))
    return unpickle_carried(checkpoint["extra_files"]["meta.pt"], weights_only=False)["lightning_sink"]


def test_a_checkpoint_saved_inside_a_window_is_refused(tmp_path: Path):
    # partial_window="carry" keeps the window open across epochs: 5 batches, windows of 4 -> 1 micro-step open
    folder = resharded(tmp_path, "open", SinkStrategy(accumulation_steps=4, partial_window="carry"), 5, max_epochs=1)
    state = sink_state(folder)
    assert state["window"]["micro_steps"] == 1
    with pytest.raises(ValueError, match=r"open.*inside an accumulation window \(1 of 4 micro-steps done\)"):
        adapt_sink_state(state, folder, sink_mode=False)


def test_a_mid_pass_position_is_refused_outside_sink_mode_and_restarts_the_pass_in_sink_mode(tmp_path: Path):
    folder = resharded(tmp_path, "mid", SinkStrategy(accumulation_steps=2), 6, max_steps=1)  # 2 of 6 batches
    state = sink_state(folder)
    assert state["data"] == {"pass_index": 0, "trained_in_pass": 2} and state["window"]["micro_steps"] == 0
    with pytest.raises(ValueError, match=r"mid.*after 2 batches of a data pass"):
        adapt_sink_state(state, folder, sink_mode=False)
    adapted = adapt_sink_state(state, folder, sink_mode=True)
    assert adapted["data"] == {"pass_index": 0, "trained_in_pass": 0} and adapted["window"] is None
    assert state["data"]["trained_in_pass"] == 2  # the loaded state itself is not modified


def test_a_checkpoint_at_a_pass_boundary_keeps_its_position(tmp_path: Path):
    folder = resharded(tmp_path, "end", SinkStrategy(accumulation_steps=2), 6, max_epochs=2)
    state = sink_state(folder)
    adapted = adapt_sink_state(state, folder, sink_mode=False)
    assert adapted["data"] == state["data"] == {"pass_index": 0, "trained_in_pass": 0}
    assert adapted["window"] is None and adapted["accumulation_steps"] == 2


def test_the_files_mesh_must_be_the_runs_mesh(tmp_path: Path):
    folder = resharded(tmp_path, "end", SinkStrategy(accumulation_steps=2), 4, max_epochs=1)
    file = rank_file_path(folder, 0)
    layout = load_resharded_checkpoint(file)["layout"]
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    same = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    check_layout_matches_mesh(layout, same, 2, file)
    other = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    with pytest.raises(ValueError, match=r"rank_0/checkpoint_0\.pt") as error:
        check_layout_matches_mesh(layout, other, 2, file)
    message = str(error.value)
    assert (
        "{'data_parallel': 1, 'tensor_parallel': 2}" in message
        and "{'data_parallel': 2, 'tensor_parallel': 1}" in message
    )


def test_a_rank_beyond_the_resharded_world_is_refused(tmp_path: Path):
    folder = resharded(tmp_path, "end", SinkStrategy(accumulation_steps=2), 4, max_epochs=1)
    with pytest.raises(ValueError, match="made for 2 ranks; this run has rank 3"):
        rank_file_path(folder, 3)


class TPClassifierWithTestStep(TPClassifier):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.cross_entropy(self(x), y))


def test_a_parameters_only_conversion_serves_test_but_not_fit(tmp_path: Path):
    """In this process on a 1 x 1 mesh: Trainer.test loads the weights; Trainer.fit is refused with the reason."""
    resharded(tmp_path, "end", SinkStrategy(accumulation_steps=2), 4, max_epochs=1)
    source = tmp_path / "end.source"  # ReshardCheckpoint's one-rank DCP folder of the trained state
    weights_only = infer_layout(TPClassifier, 1, 1, init_args=INIT_ARGS, with_optimizer=False)
    assert not any(fqn.startswith("optimizer_0.") for fqn in weights_only.tensors)
    transform_checkpoints(source, tmp_path / "params_only", "checkpoint_", None, weights_only)
    data = loader(make_dataset(num_samples=8), 4)

    def trainer():
        return quiet_trainer(strategy=SinkModelParallelStrategy(1, 1, accumulation_steps=2), devices=1, max_epochs=2)

    model = TPClassifierWithTestStep(**INIT_ARGS, seed=5)
    trainer().test(model, data, ckpt_path=tmp_path / "params_only", verbose=False)
    dcp_to_torch_save(source, tmp_path / "full.pt")
    reference = torch.load(tmp_path / "full.pt", weights_only=True)["state_dict"]
    for name, param in model.named_parameters():  # reference: DCP's own offline load of the source folder
        assert torch.equal(param.full_tensor(), reference[name]), name
    with pytest.raises(ValueError, match=r"lacks state of optimizer 0 .*not to resume Trainer.fit"):
        trainer().fit(TPClassifierWithTestStep(**INIT_ARGS), data, ckpt_path=tmp_path / "params_only")
