"""SinkModelParallelStrategy on 4 gloo processes (data_parallel=2 x tensor_parallel=2) against a single-process
plain PyTorch loop over the global batch, on the unsharded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_launched
from tests.helpers import ddp_reference_windows, make_dataset, make_optimizer, quiet_trainer, relative_error
from tests.strategies import model_parallel_worker as worker
from tests.strategies.mp_models import TPClassifier, flat


def launch(out_dir: Path, *scenarios: str, expect_returncode: int = 0) -> None:
    """Lightning's own launcher re-runs the command for ranks 1..3."""
    run_launched("tests.strategies.model_parallel_worker", out_dir, *scenarios, expect_returncode=expect_returncode)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One launch runs the scenarios that finish normally, one after the other, to pay the start-up once."""
    out_dir = tmp_path_factory.mktemp("model_parallel")
    launch(out_dir, "train", "loss_scale", "sink")
    return out_dir


def reference_windows() -> list[list[int]]:
    # Lightning gives each data-parallel rank a DistributedSampler over dp ranks; the tensor-parallel ranks of one
    # data-parallel rank see the same batches.
    return ddp_reference_windows(worker.SAMPLES, worker.MICRO_BATCH, worker.STEPS, worker.EPOCHS, "scale", worker.DP)


def reference_params(
    windows: list[list[int]], skip: set[int] = frozenset(), step_lr_gamma: float | None = 0.95
) -> tuple[torch.Tensor, list[float]]:
    """A plain PyTorch loop on the unsharded model: one AdamW step per window on the mean loss of its samples."""
    model = TPClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=step_lr_gamma)
    optimizer = make_optimizer("adamw", model.parameters(), 0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, step_lr_gamma) if step_lr_gamma else None
    x, y = make_dataset(num_samples=worker.SAMPLES).tensors
    lrs = []
    for index, window in enumerate(windows):
        if index in skip:
            continue
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[window]), y[window]).backward()
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]), lrs


@pytest.mark.slow
def test_equals_the_global_batch_reference_and_reduces_once_per_window(runs):
    result = torch.load(runs / "train.pt")
    windows = reference_windows()
    expected, lrs = reference_params(windows)
    assert result["global_step"] == len(windows) == 4
    assert result["lrs"] == pytest.approx(lrs, rel=1e-12)
    assert relative_error(flat(result["params"]), expected) <= 1e-5
    # The parameters really are sharded: Linear(8,16) column-wise over tp=2 then rows over dp=2, and so on.
    assert result["local_shapes"] == {
        "net.0.weight": (4, 8),
        "net.0.bias": (4,),
        "net.2.weight": (2, 8),
        "net.2.bias": (2,),
    }
    # Communication: no gradient reduction in accumulate batches; in each update batch one reduce-scatter per FSDP
    # parameter group (each gradient is reduced exactly once per window), and no all-reduce.
    per_batch = result["per_batch"]
    assert [batch["updates"] for batch in per_batch] == [0, 0, 1] * 4
    groups = TPClassifier.FSDP_GROUPS_WITH_PARAMETERS
    assert [batch["reduce_scatter_single"] + batch["reduce_scatter_tensor"] for batch in per_batch] == [
        groups * batch["updates"] for batch in per_batch
    ]
    assert all(batch["all_reduce"] == 0 for batch in per_batch)


@pytest.mark.slow
def test_loss_scale_overflow_on_one_rank_skips_the_window_everywhere(runs):
    result = torch.load(runs / "loss_scale.pt")
    assert (result["scale"], result["skipped"]) == (2.0**9, 1)
    windows = reference_windows()
    expected, _ = reference_params(windows, skip={1}, step_lr_gamma=None)
    assert result["global_step"] == len(windows)
    assert relative_error(flat(result["params"]), expected) <= 1e-5
    # The overflow flag is the only all-reduce: one per window, in its update batch.
    assert [batch["all_reduce"] for batch in result["per_batch"]] == [batch["updates"] for batch in result["per_batch"]]


@pytest.mark.slow
def test_sinks_equal_the_continuous_global_batch_reference(runs):
    from torch.utils.data import DistributedSampler

    result = torch.load(runs / "sink.pt")
    sink, epochs = 5, worker.EPOCHS
    streams = []
    for rank in range(worker.DP):  # each dp rank traverses its sampler continuously, the epoch advancing per pass
        micro, data_pass = [], 0
        while len(micro) < sink * epochs:
            sampler = DistributedSampler(range(worker.SAMPLES), worker.DP, rank, shuffle=True, seed=0)
            sampler.set_epoch(data_pass)
            order = list(sampler)
            micro += [order[i : i + worker.MICRO_BATCH] for i in range(0, len(order), worker.MICRO_BATCH)]
            data_pass += 1
        streams.append(micro[: sink * epochs])
    global_micro = [sum(parts, []) for parts in zip(*streams)]
    steps = worker.STEPS
    windows = [sum(global_micro[i : i + steps], []) for i in range(0, len(global_micro) - steps + 1, steps)]
    expected, lrs = reference_params(windows)
    assert result["global_step"] == len(windows) == 3
    assert result["lrs"] == pytest.approx(lrs, rel=1e-12)
    assert relative_error(flat(result["params"]), expected) <= 1e-5


def load_with_dcp(path: Path, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DCP's own loader, in this single process (no process group), into tensors of the global shapes."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {name: torch.empty_like(value) for name, value in params.items()}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["state_dict"]


@pytest.mark.slow
def test_resume_from_the_dcp_checkpoint_is_bit_identical(runs):
    result = torch.load(runs / "train.pt")
    assert result["resumed_global_step"] == result["global_step"]
    for name, value in result["params"].items():
        assert torch.equal(result["resumed"][name], value), name
    # The checkpoint (after window 1) is a DCP folder with Lightning's meta.pt and the layout file beside it.
    ckpt = runs / "ckpt"
    saved = load_with_dcp(ckpt, result["at_checkpoint"])
    for name, value in result["at_checkpoint"].items():
        assert torch.equal(saved[name], value), name
    assert torch.load(ckpt / "meta.pt", weights_only=False)["global_step"] == 1
    assert not any(path.name.startswith(".ckpt.") for path in runs.iterdir())  # staging committed, nothing left


@pytest.mark.slow
def test_resume_inside_a_window_is_bit_identical(runs):
    result = torch.load(runs / "train.pt")
    assert result["resumed_inside_window_global_step"] == result["global_step"]
    for name, value in result["params"].items():
        assert torch.equal(result["resumed_inside_window"][name], value), name
    window = torch.load(runs / "mid" / "meta.pt", weights_only=False)["lightning_sink"]["window"]
    assert window["micro_steps"] == 2
    # Every rank's own partial sums (one per parameter, this rank's tensor-parallel part, unreduced over dp).
    assert len(window["buffers"]) == 4
    assert [tuple(t.shape) for t in window["buffers"][0]] == [(8, 8), (8,), (4, 8), (4,)]
    assert not torch.equal(window["buffers"][0][0], window["buffers"][2][0])  # dp ranks saw different data


@pytest.mark.slow
def test_layout_file_describes_the_dcp_checkpoint(runs):
    from lightning_sink.layout import load_layout, read_dcp_metadata

    layout = load_layout(runs / "ckpt" / "layout.json")  # validates: chunks tile every tensor, ranks in range
    assert (layout.world_size, layout.mesh.shape, layout.mesh.dim_names) == (
        4,
        (2, 2),
        ("data_parallel", "tensor_parallel"),
    )
    assert layout.mesh.ranks == ((0, 1), (2, 3))
    metadata = read_dcp_metadata(runs / "ckpt")
    tensor_keys = {key for key, value in metadata.state_dict_metadata.items() if hasattr(value, "chunks")}
    assert set(layout.tensors) == tensor_keys  # DCP's own flattened names, parameters and optimizer state
    for key, tensor in layout.tensors.items():
        assert tensor.global_shape == tuple(metadata.state_dict_metadata[key].size), key
    # net.0.weight (16 x 8): column-wise TP splits its rows in two, FSDP splits each half again over dp; the
    # strided placement FSDP2 + TP produce puts tp rank 1's rows 8..15 after tp rank 0's 0..7.
    weight = layout.tensors["state_dict.net.0.weight"]
    assert weight.placements == ("_StridedShard(0,sf=2)", "Shard(0)")
    assert {chunk.rank: chunk.offsets for chunk in weight.chunks} == {0: (0, 0), 1: (8, 0), 2: (4, 0), 3: (12, 0)}
    assert layout.tensors["state_dict.net.2.weight"].placements == ("Shard(0)", "Shard(1)")
    assert layout.tensors["optimizer_0.state.net.0.weight.exp_avg"].role == "optimizer_state"


@pytest.mark.slow
def test_model_checkpoint_writes_complete_dcp_folders_after_updates(runs):
    from lightning_sink.layout import load_layout

    folder = runs / "model_checkpoint"
    names = sorted(path.name for path in folder.iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]  # every 2 updates, at window boundaries
    for name in names:
        assert {".metadata", "meta.pt", "layout.json"} <= {path.name for path in (folder / name).iterdir()}
        assert load_layout(folder / name) == load_layout(runs / "ckpt")  # same mesh and sharding every time


@pytest.mark.slow
def test_a_crash_while_saving_leaves_the_previous_checkpoint_intact(tmp_path):
    # Every rank is killed (os._exit) after writing its shard files of the second save, before DCP's .metadata.
    launch(tmp_path, "crash", expect_returncode=17)
    first = torch.load(tmp_path / "crash.pt")
    ckpt = tmp_path / "ckpt"
    saved = load_with_dcp(ckpt, first["params"])
    for name, value in first["params"].items():
        assert torch.equal(saved[name], value), name  # the first checkpoint, byte for byte
    assert torch.load(ckpt / "meta.pt", weights_only=False)["global_step"] == first["global_step"] == 1
    assert (ckpt / "layout.json").is_file()
    staging = tmp_path / ".ckpt.staging"  # the half-written save, under a name that says so
    assert sorted(path.name for path in staging.iterdir()) == [f"__{rank}_0.distcp" for rank in range(4)]
    assert not (tmp_path / ".ckpt.previous").exists()


@pytest.mark.slow
def test_inferred_layout_equals_the_layout_a_real_run_writes(runs, tmp_path):
    from lightning_sink.cli import main
    from lightning_sink.layout import load_layout
    from lightning_sink.layout_inference import infer_layout

    written = load_layout(runs / "ckpt" / "layout.json")
    init_args = {"optimizer": "adamw", "lr": 0.01, "step_lr_gamma": 0.95}
    assert infer_layout(TPClassifier, worker.DP, worker.TP, init_args=init_args) == written
    # `lightning-sink layout`, with the class path, writes the same file.
    assert (
        main(
            [
                "layout",
                "--model",
                "tests.strategies.mp_models.TPClassifier",
                "--init-args",
                json.dumps(init_args),
                "--data-parallel-size",
                "2",
                "--tensor-parallel-size",
                "2",
                "--output",
                str(tmp_path / "p.json"),
            ]
        )
        == 0
    )
    assert load_layout(tmp_path / "p.json") == written


def test_registered_name_and_argument_errors():
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_sink import SinkModelParallelStrategy

    trainer = quiet_trainer(strategy="sink_model_parallel", devices=4)
    assert type(trainer.strategy) is SinkModelParallelStrategy
    assert "sink_model_parallel" in StrategyRegistry
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        SinkModelParallelStrategy(data_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2.5"):
        SinkModelParallelStrategy(tensor_parallel_size=2.5)
    with pytest.raises(ValueError, match="accumulation_steps=0"):
        SinkModelParallelStrategy(accumulation_steps=0)


def fit_in_process(model, tmp_path: Path, callbacks=(), ckpt_path=None, **strategy_kwargs):
    """One process (a 1 x 1 mesh, gloo): the same code paths without a launch, for the cases that need no peers."""
    from lightning_sink import SinkModelParallelStrategy

    strategy = SinkModelParallelStrategy(
        data_parallel_size=1, tensor_parallel_size=1, process_group_backend="gloo", **strategy_kwargs
    )
    trainer = quiet_trainer(
        strategy=strategy,
        devices=1,
        max_epochs=2,
        callbacks=list(callbacks),
        limit_train_batches=5,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, worker.loader(make_dataset(num_samples=worker.SAMPLES), worker.MICRO_BATCH), ckpt_path=ckpt_path)
    return trainer


def test_resume_inside_a_window_is_bit_identical_on_one_rank(tmp_path):
    saver = worker.SaveAfterBatch(tmp_path / "ckpt", at_batch=6)  # micro-step 2 of epoch 1's first window
    uninterrupted = TPClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.9)
    first = fit_in_process(uninterrupted, tmp_path, callbacks=[saver], accumulation_steps=3)
    assert torch.load(tmp_path / "ckpt" / "meta.pt", weights_only=False)["lightning_sink"]["window"]["micro_steps"] == 2
    resumed = TPClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.9, seed=3)
    second = fit_in_process(resumed, tmp_path, accumulation_steps=3, ckpt_path=tmp_path / "ckpt")
    assert second.global_step == first.global_step == 4
    for (name, expected), actual in zip(uninterrupted.named_parameters(), resumed.parameters()):
        assert torch.equal(actual.full_tensor(), expected.full_tensor()), name


def test_drop_discards_the_partial_window_of_each_epoch(tmp_path):
    from torch.utils.data import DistributedSampler

    # limit_train_batches=5 with windows of 3: micro-batches 3 and 4 of each epoch form a partial window, dropped.
    model = TPClassifier(optimizer="adamw", lr=0.01)
    trainer = fit_in_process(model, tmp_path, accumulation_steps=3, partial_window="drop")
    windows = []
    for epoch in range(2):
        sampler = DistributedSampler(range(worker.SAMPLES), num_replicas=1, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = list(sampler)
        windows.append(order[: 3 * worker.MICRO_BATCH])
    expected, _ = reference_params(windows, step_lr_gamma=None)
    assert trainer.global_step == 2
    params = torch.cat([p.detach().full_tensor().reshape(-1).double() for p in model.parameters()])
    assert relative_error(params, expected) <= 1e-5


class CliTPClassifier(TPClassifier):
    def train_dataloader(self):
        return worker.loader(make_dataset(num_samples=32), 4)


def test_lightning_cli_class_path_config(tmp_path):
    import yaml
    from lightning.pytorch.cli import LightningCLI

    from lightning_sink import SinkModelParallelStrategy

    config = {
        "trainer": {
            "strategy": {
                "class_path": "lightning_sink.SinkModelParallelStrategy",
                "init_args": {
                    "data_parallel_size": 1,
                    "tensor_parallel_size": 1,
                    "accumulation_steps": 4,
                    "process_group_backend": "gloo",
                },
            },
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 1,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
        }
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(CliTPClassifier, args=["fit", "--config", str(path)], save_config_callback=None)
    assert isinstance(cli.trainer.strategy, SinkModelParallelStrategy)
    assert cli.trainer.strategy.accumulation_steps == 4
    assert cli.trainer.global_step == 8 // 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nccl)")
def test_cuda_nccl_single_device_equals_the_reference(tmp_path):
    from torch.utils.data import DistributedSampler

    from lightning_sink import SinkModelParallelStrategy

    torch.backends.cuda.matmul.allow_tf32 = False
    model = TPClassifier(optimizer="adamw", lr=0.01)
    strategy = SinkModelParallelStrategy(
        data_parallel_size=1, tensor_parallel_size=1, accumulation_steps=3, process_group_backend="nccl"
    )
    trainer = quiet_trainer(strategy=strategy, accelerator="cuda", devices=1, max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(model, worker.loader(make_dataset(num_samples=worker.SAMPLES), worker.MICRO_BATCH))
    trainer.save_checkpoint(tmp_path / "ckpt")
    order = list(DistributedSampler(range(worker.SAMPLES), num_replicas=1, rank=0, shuffle=True, seed=0))
    windows = [order[i : i + 3 * worker.MICRO_BATCH] for i in range(0, worker.SAMPLES, 3 * worker.MICRO_BATCH)]
    expected, _ = reference_params(windows, step_lr_gamma=None)
    params = torch.cat([p.detach().full_tensor().reshape(-1).double().cpu() for p in model.parameters()])
    assert trainer.global_step == len(windows) == 4
    assert relative_error(params, expected) <= 1e-5
    assert (tmp_path / "ckpt" / "layout.json").is_file()
