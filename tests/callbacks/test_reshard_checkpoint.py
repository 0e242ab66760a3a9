"""``ReshardCheckpoint`` on a one-device run (in this process): the full state becomes a one-rank DCP folder with
the model-parallel structure and is resharded to 2 tensor-parallel shards; failures leave nothing at ``dst_dir``.

(The multi-rank path - 4 training ranks to a 1 x 2 layout, then loaded by ``Trainer.fit`` - is tested in
``tests/strategies/test_resharded_load.py``.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_sink import SinkStrategy
from lightning_sink.callbacks import ReshardCheckpoint
from lightning_sink.layout import MeshLayout, layout_on_mesh, load_layout, save_layout
from lightning_sink.layout_inference import infer_layout
from lightning_sink.reshard import load_resharded_checkpoint, unpickle_carried, verify_checkpoint
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer
from tests.strategies.mp_models import TPClassifier

INIT_ARGS = {"optimizer": "adamw", "lr": 0.01}


def train_one_device(callback: ReshardCheckpoint) -> tuple[TinyClassifier, torch.optim.Optimizer, object]:
    model = TinyClassifier(**INIT_ARGS)
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=2), devices=1, max_epochs=2, callbacks=[callback])
    trainer.fit(model, loader(make_dataset(num_samples=24), 4))
    return model, trainer.optimizers[0], trainer


@pytest.fixture
def target_layout(tmp_path: Path) -> Path:
    return save_layout(infer_layout(TPClassifier, 1, 2, init_args=INIT_ARGS), tmp_path / "tp2.json")


def test_one_device_run_is_resharded_to_two_tensor_parallel_shards(tmp_path: Path, target_layout: Path, capfd):
    callback = ReshardCheckpoint(target_layout, tmp_path / "tp2", ckpt_prefix="ckpt_")
    model, optimizer, trainer = train_one_device(callback)
    assert re.search(r"resharding tp2\.source -> tp2: 100%", capfd.readouterr().err)  # the progress bar, finished
    source = tmp_path / "tp2.source"  # the default src_dir: beside dst_dir
    assert (source / ".metadata").is_file() and (source / "layout.json").is_file() and (source / "meta.pt").is_file()
    assert load_layout(source).world_size == 1
    verify_checkpoint(tmp_path / "tp2")
    assert [r.rank for r in callback.report.ranks] == [0, 1]
    # The reference: the trained module's own parameters and AdamW's per-parameter state, by parameter name.
    expected = {f"state_dict.{name}": p.detach() for name, p in model.named_parameters()}
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            expected[f"optimizer_0.state.{name}.{key}"] = value
    layout = load_layout(target_layout)
    assert set(layout.tensors) == set(expected)
    for rank in range(2):
        checkpoint = load_resharded_checkpoint(tmp_path / "tp2" / f"rank_{rank}" / f"ckpt_{rank}.pt")
        for fqn, shard in checkpoint["tensors"].items():
            (chunk,) = layout.tensors[fqn].chunks_of_rank(rank)
            assert torch.equal(
                shard, expected[fqn][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            ), fqn
        # Column-wise first layer: each rank holds half of its rows (and of its moments).
        assert checkpoint["tensors"]["state_dict.net.0.weight"].shape == (8, 8)
        meta = unpickle_carried(checkpoint["extra_files"]["meta.pt"], weights_only=False)
        assert meta["global_step"] == trainer.global_step == 6 and "state_dict" not in meta
        assert meta["lightning_sink"]["window"]["micro_steps"] == 0


def test_a_target_layout_that_does_not_fit_raises_and_leaves_nothing(tmp_path: Path, target_layout: Path):
    data = json.loads(target_layout.read_text())
    tensor = data["tensors"]["state_dict.net.0.weight"]
    tensor["global_shape"] = [32, 8]  # another model: twice the hidden units
    for chunk in tensor["chunks"]:
        chunk["sizes"] = [16, 8]
        chunk["offsets"] = [16 * int(chunk["offsets"][0] > 0), 0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    load_layout(bad)  # a valid layout in itself: the mismatch is with the checkpoint
    with pytest.raises(ValueError, match=r"state_dict\.net\.0\.weight"):
        train_one_device(ReshardCheckpoint(bad, tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))  # no staging or partial folder either
    assert (tmp_path / "out.source" / ".metadata").is_file()  # the saved source checkpoint is complete and stays


def test_a_missing_target_layout_fails_before_training(tmp_path: Path):
    model = TinyClassifier(**INIT_ARGS)
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        quiet_trainer(
            devices=1, max_epochs=1, callbacks=[ReshardCheckpoint(tmp_path / "nowhere.json", tmp_path / "o")]
        ).fit(model, loader(make_dataset(num_samples=8), 4))
    assert not model.seen_lrs  # no optimizer step ran


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"workers": 0}, ValueError, "workers=0"),
        ({"workers": True}, ValueError, "workers=True"),
        ({"ckpt_prefix": "a/b"}, ValueError, "ckpt_prefix='a/b'"),
        ({"ckpt_prefix": ""}, ValueError, "ckpt_prefix=''"),
        ({"overwrite": "yes"}, TypeError, "overwrite='yes'"),
        ({"dst_dir": 3}, TypeError, "dst_dir=3"),
        ({"source": "zip"}, ValueError, r"source='zip' is not one of \['dcp', 'ckpt'\]"),
        ({"source": None}, ValueError, r"source=None is not one of"),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, kwargs, error, match):
    arguments = {"dst_strategy_file": tmp_path / "t.json", "dst_dir": tmp_path / "out", **kwargs}
    with pytest.raises(error, match=match):
        ReshardCheckpoint(**arguments)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ckpt_prefix": ".."}, r"ckpt_prefix='\.\.' must be a plain file-name prefix"),
        ({"ckpt_prefix": "."}, r"ckpt_prefix='\.' must be a plain file-name prefix"),
        ({"dst_dir": ""}, r"dst_dir='' is empty"),
        ({"dst_dir": "."}, r"dst_dir='\.' is the working folder"),
        ({"dst_strategy_file": ""}, r"dst_strategy_file='' is empty"),
    ],
)
def test_arguments_that_would_fail_only_at_fit_end_are_refused_at_construction(tmp_path: Path, kwargs, match):
    arguments = {"dst_strategy_file": tmp_path / "t.json", "dst_dir": tmp_path / "out", **kwargs}
    with pytest.raises(ValueError, match=match):
        ReshardCheckpoint(**arguments)


def test_source_inside_destination_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="must not be or contain one another"):
        ReshardCheckpoint(tmp_path / "t.json", tmp_path / "out", src_dir=tmp_path / "out" / "src")


def test_model_parallel_without_distributed_checkpoints_is_refused(tmp_path: Path, target_layout: Path):
    callback = ReshardCheckpoint(target_layout, tmp_path / "out")
    trainer = quiet_trainer(strategy=ModelParallelStrategy(save_distributed_checkpoint=False), devices=1)
    with pytest.raises(ValueError, match="save_distributed_checkpoint=True"):
        callback.setup(trainer, TPClassifier(), "fit")


def test_a_ckpt_source_on_a_model_parallel_run_is_refused(tmp_path: Path, target_layout: Path):
    callback = ReshardCheckpoint(target_layout, tmp_path / "out", source="ckpt")
    trainer = quiet_trainer(strategy=ModelParallelStrategy(save_distributed_checkpoint=True), devices=1)
    with pytest.raises(ValueError, match=r"source='ckpt'\) is for one-device runs"):
        callback.setup(trainer, TPClassifier(), "fit")


def module_state(model: TinyClassifier, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The trained module's parameters and AdamW's per-parameter state, under a model-parallel checkpoint's names."""
    expected = {f"state_dict.{name}": p.detach() for name, p in model.named_parameters()}
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            expected[f"optimizer_0.state.{name}.{key}"] = value
    return expected


def assert_shards_are_slices(dst: Path, layout_file: Path, expected: dict[str, torch.Tensor]) -> None:
    """Each rank file, read by the package's loader, holds the layout's slice of each tensor, bit for bit."""
    layout = load_layout(layout_file)
    assert set(layout.tensors) == set(expected)
    for rank in range(layout.world_size):
        shards = load_resharded_checkpoint(dst / f"rank_{rank}" / f"checkpoint_{rank}.pt")["tensors"]
        assert set(shards) == {fqn for fqn, t in layout.tensors.items() if t.chunks_of_rank(rank)}
        for fqn, shard in shards.items():
            (chunk,) = layout.tensors[fqn].chunks_of_rank(rank)
            part = expected[fqn][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            assert shard.dtype == part.dtype and shard.shape == part.shape, fqn
            assert torch.equal(shard.reshape(-1).view(torch.uint8), part.reshape(-1).view(torch.uint8)), fqn


def test_a_one_device_run_can_keep_lightnings_own_ckpt_as_the_source(tmp_path: Path, target_layout: Path):
    """source="ckpt" on stock Lightning's one-device strategy: the kept source is ``last.ckpt``, converted as the
    CLI converts a one-device file, to 2 tensor-parallel ranks and to 3 uneven row ranks; every shard is the trained
    module's tensor bit for bit, and stock Lightning resumes from the file."""
    rows3 = save_layout(
        layout_on_mesh(
            load_layout(target_layout),
            MeshLayout.one_dimensional(3),
            lambda fqn, tensor: ["Shard(0)"] if tensor.global_shape else ["Replicate()"],
        ),
        tmp_path / "rows3.json",
    )
    to_tp2 = ReshardCheckpoint(target_layout, tmp_path / "tp2", source="ckpt")
    to_rows3 = ReshardCheckpoint(rows3, tmp_path / "rows3", source="ckpt")
    model = TinyClassifier(**INIT_ARGS)
    trainer = quiet_trainer(devices=1, max_epochs=2, callbacks=[to_tp2, to_rows3])
    trainer.fit(model, loader(make_dataset(num_samples=24), 4))
    expected = module_state(model, trainer.optimizers[0])
    for callback, layout_file in ((to_tp2, target_layout), (to_rows3, rows3)):
        kept = callback.src_dir / "last.ckpt"
        assert kept.is_file() and not (callback.src_dir / ".metadata").exists()
        verify_checkpoint(callback.dst_dir)
        assert_shards_are_slices(callback.dst_dir, layout_file, expected)
    meta = load_resharded_checkpoint(tmp_path / "rows3" / "rank_2" / "checkpoint_2.pt")["extra_files"]["meta.pt"]
    assert unpickle_carried(meta, weights_only=False)["global_step"] == trainer.global_step == 12
    resumed = TinyClassifier(**{**INIT_ARGS, "seed": 1})  # other initial weights: the file must bring them back
    resume = quiet_trainer(devices=1, max_epochs=3)
    resume.fit(resumed, loader(make_dataset(num_samples=24), 4), ckpt_path=to_tp2.src_dir / "last.ckpt")
    assert resume.global_step == 18 and resumed.seen_lrs  # one more epoch of 6 steps, after the restored 12


class FrozenFirstLayer(TinyClassifier):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.net[2].parameters(), lr=self.lr)


def test_a_ckpt_source_whose_optimizer_state_cannot_be_named_is_refused_before_training(
    tmp_path: Path, target_layout: Path
):
    """The first layer frozen: position 0 of the optimizer is the module's 3rd parameter, which a .ckpt cannot say."""
    model = FrozenFirstLayer(**INIT_ARGS)
    trainer = quiet_trainer(
        devices=1, max_epochs=1, callbacks=[ReshardCheckpoint(target_layout, tmp_path / "out", source="ckpt")]
    )
    with pytest.raises(ValueError, match=r"optimizer 0 holds 2 parameters, at position 0 'net.2.weight', where the"):
        trainer.fit(model, loader(make_dataset(num_samples=8), 4))
    assert not model.seen_lrs and not (tmp_path / "out.source").exists()


@pytest.mark.slow
def test_workers_convert_in_separate_processes_to_the_same_files(tmp_path: Path, target_layout: Path):
    in_process = ReshardCheckpoint(target_layout, tmp_path / "a", src_dir=tmp_path / "src_a")
    in_workers = ReshardCheckpoint(target_layout, tmp_path / "b", src_dir=tmp_path / "src_b", workers=2)
    train_one_device(in_process)
    train_one_device(in_workers)  # the same seed and data: the same final state
    assert [r.rank for r in in_workers.report.ranks] == [0, 1]
    for rank in range(2):
        a = load_resharded_checkpoint(tmp_path / "a" / f"rank_{rank}" / f"checkpoint_{rank}.pt")
        b = load_resharded_checkpoint(tmp_path / "b" / f"rank_{rank}" / f"checkpoint_{rank}.pt")
        assert a["tensors"].keys() == b["tensors"].keys()
        assert all(torch.equal(a["tensors"][fqn], b["tensors"][fqn]) for fqn in a["tensors"])


@pytest.mark.parametrize("source", ["dcp", "ckpt"])
def test_a_src_dir_holding_other_files_is_refused_at_construction(tmp_path: Path, source):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match=r"src_dir='.*mine' holds 'notes.txt', which is not a file of"):
        ReshardCheckpoint(tmp_path / "t.json", tmp_path / "out", src_dir=mine, source=source)
    assert (mine / "notes.txt").read_text() == "the user's"


def test_files_added_to_src_dir_during_training_are_not_replaced(tmp_path: Path, target_layout: Path):
    src = tmp_path / "src"
    callback = ReshardCheckpoint(target_layout, tmp_path / "out", src_dir=src)

    class AddsAFile(Callback):
        def on_train_start(self, trainer, pl_module):
            src.mkdir()
            (src / "notes.txt").write_text("the user's")

    model = TinyClassifier(**INIT_ARGS)
    trainer = quiet_trainer(strategy=SinkStrategy(), max_epochs=1, callbacks=[AddsAFile(), callback])
    with pytest.raises(ValueError, match=r"src_dir='.*src' holds 'notes.txt'"):
        trainer.fit(model, loader(make_dataset(num_samples=8), 4))
    assert [p.name for p in src.iterdir()] == ["notes.txt"] and not (tmp_path / "out").exists()


def test_a_previous_save_in_src_dir_is_replaced(tmp_path: Path, target_layout: Path):
    for _ in range(2):  # the second run replaces the first one's src_dir and (overwrite) dst_dir
        callback = ReshardCheckpoint(target_layout, tmp_path / "out", src_dir=tmp_path / "src", overwrite=True)
        train_one_device(callback)
        assert (tmp_path / "src" / "SAVE_DIGESTS.json").is_file()
        verify_checkpoint(tmp_path / "out")


def test_a_dst_dir_holding_other_files_is_refused_at_construction(tmp_path: Path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match=r"dst_dir='.*out' holds files that are not a previous output"):
        ReshardCheckpoint(tmp_path / "t.json", tmp_path / "out", overwrite=True)


@pytest.mark.parametrize(
    ("src_dir", "match"),
    [(".", "is the working folder"), ("~", "is the home folder"), ("/", "and dst_dir=.* must not be or contain")],
)
def test_src_dir_never_the_working_home_or_root_folder(tmp_path: Path, src_dir, match):
    with pytest.raises(ValueError, match=rf"src_dir='.*' {match}"):
        ReshardCheckpoint(tmp_path / "t.json", tmp_path / "out", src_dir=Path(src_dir).expanduser())
