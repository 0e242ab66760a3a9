"""``Trainer.fit(ckpt_path=DST)`` from a ``transform_checkpoints`` output, with ``SinkModelParallelStrategy``.

Stage 1: 4 gloo ranks (data_parallel=2 x tensor_parallel=2), whose ``ReshardCheckpoint`` saves the final checkpoint
and reshards it to the 1 x 2 layout ``infer_layout`` predicts; the test also reshards it to 2 x 1 itself. Stage 2:
2 ranks fit from each. The reference for every loaded value is DCP's own ``dcp_to_torch_save`` of the stage-1
folder; the continuation is checked on the loss of the whole data set.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_sink.layout import save_layout
from lightning_sink.layout_inference import infer_layout
from lightning_sink.reshard import load_resharded_checkpoint, transform_checkpoints, verify_checkpoint
from tests.distributed import run_launched
from tests.strategies import resharded_load_worker as worker
from tests.strategies.mp_models import TPClassifier

INIT_ARGS = {"optimizer": "adamw", "lr": worker.LR}
MESHES = {"resumed_dp1_tp2": (1, 2), "resumed_dp2_tp1": (2, 1)}


def launch(out: Path, phase: str) -> None:
    run_launched("tests.strategies.resharded_load_worker", out, phase, timeout=400)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resharded_load")
    save_layout(infer_layout(TPClassifier, 1, 2, init_args=INIT_ARGS), out / "target_dp1_tp2.json")
    launch(out, "train")
    train_one_device(out)
    train_one_device_sink_mode(out)
    transform_checkpoints(
        out / "stage1", out / "resharded_dp2_tp1", "ckpt_", None, infer_layout(TPClassifier, 2, 1, init_args=INIT_ARGS)
    )
    launch(out, "resume")
    return out


def train_one_device_sink_mode(out: Path) -> None:
    """2 sinks of 4 batches (the pass has 12): the checkpoint lies in the middle of the first data pass."""
    from lightning_sink import SinkStrategy
    from lightning_sink.callbacks import ReshardCheckpoint
    from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer

    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=worker.STEPS, sink_size=4),
        devices=1,
        max_epochs=2,
        callbacks=[ReshardCheckpoint(out / "target_dp1_tp2.json", out / "resharded_sink")],
    )
    trainer.fit(TinyClassifier(**INIT_ARGS), loader(make_dataset(num_samples=worker.SAMPLES), worker.MICRO_BATCH))
    assert trainer.global_step == 4


def train_one_device(out: Path) -> None:
    """Stage 1 on one device (SinkStrategy, same data and windows), resharded to 1 x 2 by ReshardCheckpoint; the
    trained parameters and AdamW state, by name, are the reference for what the 2-rank run loads from it."""
    from lightning_sink import SinkStrategy
    from lightning_sink.callbacks import ReshardCheckpoint
    from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer

    model = TinyClassifier(**INIT_ARGS)
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=worker.STEPS),
        devices=1,
        max_epochs=2,
        callbacks=[ReshardCheckpoint(out / "target_dp1_tp2.json", out / "resharded_single")],
    )
    trainer.fit(model, loader(make_dataset(num_samples=worker.SAMPLES), worker.MICRO_BATCH))
    optimizer = trainer.optimizers[0]
    reference = {f"state_dict.{name}": p.detach().clone() for name, p in model.named_parameters()}
    reference.update(
        {
            f"optimizer_0.state.{name}.{key}": value.clone()
            for name, p in model.named_parameters()
            for key, value in optimizer.state[p].items()
        }
    )
    torch.save(
        {"tensors": reference, "global_step": trainer.global_step, "end_probe": worker.probe_loss(model)},
        out / "single.pt",
    )


def full_reference(runs: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(runs / "stage1", runs / "full.pt")  # DCP's own offline load of the stage-1 checkpoint
    flat, _ = flatten_state_dict(torch.load(runs / "full.pt", weights_only=True))
    return flat


def updates_per_epoch(dp: int) -> int:
    batches = worker.SAMPLES // dp // worker.MICRO_BATCH  # each data-parallel rank's share of the samples
    return -(-batches // worker.STEPS)  # windows of STEPS; a last partial window also updates ("scale")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
def test_loaded_parameters_and_adam_state_are_dcps_full_values(runs: Path, name: str):
    full = full_reference(runs)
    result = torch.load(runs / f"{name}.pt", weights_only=True)
    assert result["params"].keys() == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    for param, value in result["params"].items():
        assert torch.equal(value, full[f"state_dict.{param}"]), param
    assert len(result["optimizer"]) == 3 * len(result["params"])  # exp_avg, exp_avg_sq, step of each
    for key, value in result["optimizer"].items():
        assert torch.equal(value, full[f"optimizer_0.state.{key}"]), key
    assert result["lr"] == full["optimizer_0.param_groups.0.lr"] == worker.LR


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
def test_training_continues_from_stage_one(runs: Path, name: str):
    stage1 = torch.load(runs / "stage1.pt", weights_only=True)
    result = torch.load(runs / f"{name}.pt", weights_only=True)
    dp, _ = MESHES[name]
    assert stage1["end_global_step"] == 2 * updates_per_epoch(2)
    assert (result["start_global_step"], result["start_epoch"]) == (stage1["end_global_step"], 2)
    assert result["end_global_step"] == stage1["end_global_step"] + 2 * updates_per_epoch(dp)
    # The first loss of the fine-tuning is the last of stage 1 (same parameters; TP changes the summation order).
    assert result["start_probe"] == pytest.approx(stage1["end_probe"], rel=1e-5)
    assert stage1["epoch_probes"][-1] == pytest.approx(stage1["end_probe"], rel=1e-6)
    probes = [result["start_probe"], *result["epoch_probes"]]
    assert all(later < earlier for earlier, later in zip(probes, probes[1:])), probes


@pytest.mark.slow
def test_reshard_checkpoint_output_is_verified_slices_of_the_full_tensors(runs: Path):
    """ReshardCheckpoint's output (4 training ranks -> the 1 x 2 layout): complete, and every shard a slice."""
    verify_checkpoint(runs / "resharded_dp1_tp2")
    layout = infer_layout(TPClassifier, 1, 2, init_args=INIT_ARGS)
    full = full_reference(runs)
    for rank in range(2):
        checkpoint = load_resharded_checkpoint(runs / "resharded_dp1_tp2" / f"rank_{rank}" / f"ckpt_{rank}.pt")
        assert checkpoint["layout"] == layout
        assert set(checkpoint["tensors"]) == set(layout.tensors)
        for fqn, shard in checkpoint["tensors"].items():
            (chunk,) = layout.tensors[fqn].chunks_of_rank(rank)
            expected = full[fqn][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            assert torch.equal(shard, expected), (rank, fqn)
        assert checkpoint["extra_files"]["meta.pt"] == (runs / "stage1" / "meta.pt").read_bytes()
    stage1 = torch.load(runs / "stage1.pt", weights_only=True)
    assert stage1["bytes_written"] == sum(
        (runs / "resharded_dp1_tp2" / f"rank_{r}" / f"ckpt_{r}.pt").stat().st_size for r in range(2)
    )


@pytest.mark.slow
def test_a_one_device_run_continues_on_two_tensor_parallel_ranks(runs: Path):
    single = torch.load(runs / "single.pt", weights_only=True)
    result = torch.load(runs / "resumed_single.pt", weights_only=True)
    for param, value in result["params"].items():
        assert torch.equal(value, single["tensors"][f"state_dict.{param}"]), param
    for key, value in result["optimizer"].items():
        assert torch.equal(value, single["tensors"][f"optimizer_0.state.{key}"]), key
    assert result["start_global_step"] == single["global_step"] == 2 * updates_per_epoch(1)
    assert result["start_probe"] == pytest.approx(single["end_probe"], rel=1e-5)
    assert result["epoch_probes"][-1] < result["start_probe"]


@pytest.mark.slow
def test_sink_mode_restarts_the_interrupted_data_pass(runs: Path):
    """The source stopped after 8 of the pass's 12 batches; on the new mesh the pass is read again from its start."""
    from torch.utils.data import DistributedSampler

    from tests.helpers import make_dataset

    result = torch.load(runs / "resumed_sink.pt", weights_only=True)
    assert (result["start_global_step"], result["end_global_step"]) == (4, 4 + 2)  # one sink: 4 batches, 2 windows
    dataset = make_dataset(num_samples=worker.SAMPLES)
    # Lightning gives a distributed run's training loader a DistributedSampler(shuffle=True, seed=0); the sink
    # stream sets its epoch to the pass index, 0 here. The restarted pass starts at that order's beginning.
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    order = list(sampler)
    assert torch.equal(result["seen"], dataset.tensors[0][order[: 4 * worker.MICRO_BATCH], 0])


@pytest.mark.slow
def test_a_failed_conversion_raises_the_reason_and_leaves_no_destination(tmp_path: Path):
    layout = infer_layout(TPClassifier, 1, 2, init_args=INIT_ARGS)
    data = json.loads(layout.to_json())
    for chunk in data["tensors"]["state_dict.net.2.weight"]["chunks"]:  # another model: 8 classes, not 4
        chunk["sizes"] = [8, *chunk["sizes"][1:]]
    data["tensors"]["state_dict.net.2.weight"]["global_shape"][0] = 8
    (tmp_path / "bad_layout.json").write_text(json.dumps(data))
    launch(tmp_path, "fail")
    failure = torch.load(tmp_path / "fail_0.pt", weights_only=True)
    assert failure["type"] == "ValueError" and "state_dict.net.2.weight" in failure["message"], failure
    if (tmp_path / "fail_1.pt").exists():  # rank 1, unless the launcher killed it first: the same reason
        other = torch.load(tmp_path / "fail_1.pt", weights_only=True)
        assert other["type"] == "RuntimeError" and "failed on global rank 0" in other["message"], other
        assert "state_dict.net.2.weight" in other["message"]
    assert not (tmp_path / "bad_dst").exists() and not list(tmp_path.glob(".bad_dst*"))
    assert (tmp_path / "bad_src" / ".metadata").is_file()  # the saved source checkpoint is complete
