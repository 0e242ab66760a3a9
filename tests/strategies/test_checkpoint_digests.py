"""A flipped byte in a saved tensor is refused on resume, naming the file and the tensor, before anything is restored
or overwritten: the sink strategies' ``.ckpt`` files carry a SHA-256 per tensor, the model-parallel strategy's DCP
folders their ``SAVE_DIGESTS.json``. Stock checkpoints, which carry neither, resume as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemReader

from lightning_sink import SinkDDPStrategy, SinkStrategy
from tests.distributed import run_nodes
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer
from tests.strategies import model_parallel_worker as mp_worker
from tests.strategies.mp_models import TPClassifier

DATASET = make_dataset(num_samples=40)  # 10 batches of 4


def flip_a_byte_of(path: Path, tensor: torch.Tensor) -> None:
    """Flip one byte inside ``tensor``'s stored bytes (found by its content: random weights occur once)."""
    data = bytearray(path.read_bytes())
    raw = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    start = data.find(raw)
    assert start >= 0 and data.find(raw, start + 1) < 0, "the tensor's bytes occur once in the file"
    data[start + len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def fit(strategy, model=None, ckpt_path=None, callbacks=(), epochs=1, **trainer_kwargs):
    if strategy is not None:
        trainer_kwargs["strategy"] = strategy
    if callbacks:
        trainer_kwargs["enable_checkpointing"] = True
    trainer = quiet_trainer(max_epochs=epochs, callbacks=list(callbacks), **trainer_kwargs)
    trainer.fit(model or TinyClassifier(optimizer="adamw", lr=0.01), loader(DATASET, 4), ckpt_path=ckpt_path)
    return trainer


def every_file(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.fixture
def sink_checkpoint(tmp_path):
    trainer = fit(SinkStrategy(accumulation_steps=2))
    path = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_the_checkpoint_records_a_digest_of_every_tensor(sink_checkpoint):
    checkpoint = torch.load(sink_checkpoint, weights_only=True)
    recorded = checkpoint["lightning_sink"]["tensor_digests"]["sha256"]
    assert "state_dict['net.0.weight']" in recorded
    assert "optimizer_states[0]['state'][0]['exp_avg']" in recorded
    assert len(recorded) == count_tensors(checkpoint)  # every tensor of the file, the lightning_sink state's too


def count_tensors(node):
    if isinstance(node, torch.Tensor):
        return 1
    values = node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else ()
    return sum(count_tensors(value) for value in values)


@pytest.mark.parametrize(
    ("where", "named"),
    [
        (lambda c: c["state_dict"]["net.0.weight"], r"state_dict\['net.0.weight'\]"),
        (
            lambda c: c["optimizer_states"][0]["state"][0]["exp_avg"],
            r"optimizer_states\[0\]\['state'\]\[0\]\['exp_avg'\]",
        ),
    ],
)
def test_a_flipped_byte_in_a_tensor_is_refused_naming_the_file_and_the_tensor(sink_checkpoint, where, named):
    flip_a_byte_of(sink_checkpoint, where(torch.load(sink_checkpoint, weights_only=True)))
    with pytest.raises(ValueError, match=rf"saved.ckpt: tensor {named} is damaged: its bytes differ from the SHA-256"):
        fit(SinkStrategy(accumulation_steps=2), ckpt_path=sink_checkpoint)


def test_model_checkpoint_does_not_get_to_overwrite_good_files(tmp_path):
    # A run saving after every update; its step-2 checkpoint is then damaged and resumed from, with the same callback.
    folder = tmp_path / "checkpoints"

    def saver():
        return ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, save_last=True)

    fit(SinkStrategy(accumulation_steps=2), callbacks=[saver()])
    damaged = folder / "epoch=0-step=2.ckpt"
    flip_a_byte_of(damaged, torch.load(damaged, weights_only=True)["state_dict"]["net.0.weight"])
    before = every_file(folder)
    assert len(before) == 6  # steps 1..5 and last.ckpt
    with pytest.raises(ValueError, match=r"epoch=0-step=2.ckpt: tensor state_dict\['net.0.weight'\] is damaged"):
        fit(SinkStrategy(accumulation_steps=2), callbacks=[saver()], ckpt_path=damaged)
    assert every_file(folder) == before


def test_sink_ddp_refuses_a_flipped_byte_too(tmp_path):
    trainer = fit(SinkDDPStrategy(accumulation_steps=2), devices=1)
    path = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(path)
    flip_a_byte_of(path, torch.load(path, weights_only=True)["state_dict"]["net.2.bias"])
    with pytest.raises(ValueError, match=r"saved.ckpt: tensor state_dict\['net.2.bias'\] is damaged"):
        fit(SinkDDPStrategy(accumulation_steps=2), devices=1, ckpt_path=path)


def edit(path, change):
    checkpoint = torch.load(path, weights_only=True)
    change(checkpoint)
    torch.save(checkpoint, path)


def test_a_tensor_removed_or_added_is_refused(sink_checkpoint, tmp_path):
    original = sink_checkpoint.read_bytes()
    edit(sink_checkpoint, lambda c: c["state_dict"].pop("net.2.bias"))
    with pytest.raises(
        ValueError, match=r"saved.ckpt: tensor state_dict\['net.2.bias'\] the checkpoint was saved with is"
    ):
        fit(SinkStrategy(accumulation_steps=2), ckpt_path=sink_checkpoint)
    sink_checkpoint.write_bytes(original)
    edit(sink_checkpoint, lambda c: c["state_dict"].update(extra=torch.ones(2)))
    with pytest.raises(
        ValueError, match=r"saved.ckpt: tensor state_dict\['extra'\] is not one the checkpoint was saved"
    ):
        fit(SinkStrategy(accumulation_steps=2), ckpt_path=sink_checkpoint)


def test_a_malformed_digest_record_is_refused(sink_checkpoint):
    edit(sink_checkpoint, lambda c: c["lightning_sink"].update(tensor_digests={"sha256": [1]}))
    with pytest.raises(
        ValueError, match=r"saved.ckpt: the checkpoint's 'lightning_sink' state is not valid: tensor_dig"
    ):
        fit(SinkStrategy(accumulation_steps=2), ckpt_path=sink_checkpoint)


def test_a_checkpoint_loaded_and_saved_again_unchanged_resumes(sink_checkpoint):
    edit(sink_checkpoint, lambda c: None)  # the harness the edits above go through refuses nothing by itself
    assert fit(SinkStrategy(accumulation_steps=2), ckpt_path=sink_checkpoint, epochs=2).global_step == 10


def test_stock_checkpoints_and_opted_out_ones_resume_as_before(tmp_path):
    stock = fit(None, accumulate_grad_batches=2)
    stock.save_checkpoint(tmp_path / "stock.ckpt")
    assert fit(SinkStrategy(accumulation_steps=2), ckpt_path=tmp_path / "stock.ckpt", epochs=2).global_step == 10

    unrecorded = fit(SinkStrategy(accumulation_steps=2, checkpoint_digests=False))
    unrecorded.save_checkpoint(tmp_path / "unrecorded.ckpt")
    assert "tensor_digests" not in torch.load(tmp_path / "unrecorded.ckpt", weights_only=True)["lightning_sink"]
    assert fit(SinkStrategy(accumulation_steps=2), ckpt_path=tmp_path / "unrecorded.ckpt", epochs=2).global_step == 10


def test_checkpoint_digests_wants_a_bool():
    with pytest.raises(TypeError, match=r"checkpoint_digests='no' is not valid: pass True or False"):
        SinkStrategy(checkpoint_digests="no")


def fit_model_parallel(tmp_path, model, ckpt_path=None):
    """One process (a 1 x 1 mesh, gloo): the model-parallel strategy's own DCP folder saves and loads."""
    from lightning_sink import SinkModelParallelStrategy

    strategy = SinkModelParallelStrategy(
        data_parallel_size=1, tensor_parallel_size=1, process_group_backend="gloo", accumulation_steps=3
    )
    trainer = quiet_trainer(
        strategy=strategy, devices=1, max_epochs=1, limit_train_batches=6, default_root_dir=tmp_path
    )
    samples = mp_worker.SAMPLES
    trainer.fit(model, mp_worker.loader(make_dataset(num_samples=samples), mp_worker.MICRO_BATCH), ckpt_path=ckpt_path)
    return trainer


def test_a_flipped_byte_in_a_model_parallel_dcp_shard_is_refused_before_loading(tmp_path):
    trainer = fit_model_parallel(tmp_path, TPClassifier(optimizer="adamw", lr=0.01))
    folder = tmp_path / "ckpt"
    trainer.save_checkpoint(folder)
    # where DCP's own reader says the first layer's weight lies
    metadata = FileSystemReader(folder).read_metadata()
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == "state_dict.net.0.weight")
    shard = folder / info.relative_path
    good = shard.read_bytes()
    data = bytearray(good)
    data[info.offset + info.length // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    resumed = TPClassifier(optimizer="adamw", lr=0.01, seed=3)
    before = [p.detach().clone() for p in resumed.parameters()]  # (sharded by the fit, as DTensors)
    named = rf"file .*{shard.name}' does not belong to this save: tensor 'state_dict.net.0.weight' \(chunk at offsets"
    with pytest.raises(ValueError, match=rf"checkpoint folder .*: {named} \[0, 0\], bytes {info.offset}-"):
        fit_model_parallel(tmp_path / "resumed", resumed, ckpt_path=folder)
    assert all(torch.equal(p.detach().full_tensor(), b) for p, b in zip(resumed.parameters(), before))  # nothing loaded

    shard.write_bytes(good)  # the control: the same folder, undamaged, resumes
    assert fit_model_parallel(tmp_path / "resumed", TPClassifier(optimizer="adamw", lr=0.01), ckpt_path=folder)


def test_a_dcp_folder_without_save_digests_loads_as_before(tmp_path):
    # (as stock Lightning's and DCP's own folders: nothing to check them against)
    trainer = fit_model_parallel(tmp_path, TPClassifier(optimizer="adamw", lr=0.01))
    trainer.save_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "SAVE_DIGESTS.json").unlink()
    resumed = fit_model_parallel(
        tmp_path / "resumed", TPClassifier(optimizer="adamw", lr=0.01), ckpt_path=tmp_path / "ckpt"
    )
    assert resumed.global_step == trainer.global_step


# ---------------------------------------------------------------------------------------------------- two ranks
@pytest.fixture(scope="module")
def two_rank_resumes(tmp_path_factory) -> Path:
    """One launch of 2 ranks: a save, a clean resume, a resume with a flipped byte in a file only rank 1 checks, and
    one where rank 1 cannot read its files (see save_digests_worker.py)."""
    root = tmp_path_factory.mktemp("two_ranks")
    out = root / "out"
    out.mkdir()
    run_nodes("tests.strategies.save_digests_worker", out, nodes=1, devices=2, root=root, timeout=480)
    return out


def rank_records(out: Path, case: str) -> list[dict]:
    return [json.loads((out / f"{case}.rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_each_rank_checks_only_its_share_of_the_files(two_rank_resumes):
    clean = rank_records(two_rank_resumes, "clean")
    assert [record["error"] for record in clean] == [None, None]
    folder = {path.name for path in (two_rank_resumes / "ckpt").iterdir()}
    checked = {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"}
    assert checked <= folder
    shares = [record["opened"] for record in clean]
    assert all(len(share) == len(set(share)) for share in shares)  # no file read twice
    assert not set(shares[0]) & set(shares[1])  # disjoint
    assert set(shares[0]) | set(shares[1]) == checked  # and together every file the load reads
    assert all(any(name.endswith(".distcp") for name in share) for share in shares)  # one storage file each


@pytest.mark.slow
def test_a_flipped_byte_only_rank_1_checks_is_refused_on_both_ranks_naming_file_and_tensor(two_rank_resumes):
    flipped = json.loads((two_rank_resumes / "flipped.json").read_text())
    records = rank_records(two_rank_resumes, "flipped")
    assert records[0]["error"] == records[1]["error"]  # the same one line on every rank
    error = records[0]["error"]
    assert "\n" not in error
    assert error.startswith("ValueError: checkpoint folder ")
    assert f"{flipped['file']}' does not belong to this save: tensor '{flipped['tensor']}'" in error
    assert f"(chunk at offsets {flipped['offsets']}, bytes " in error
    assert flipped["file"] not in records[0]["opened"]  # rank 0 did not read it: rank 1's verdict reached it
    assert flipped["file"] in records[1]["opened"]
    assert all(record["seconds"] < 60 for record in records)  # (a hang would wait for the process-group timeout)


@pytest.mark.slow
def test_a_rank_that_cannot_read_its_share_fails_every_rank(two_rank_resumes):
    records = rank_records(two_rank_resumes, "unreadable")
    assert records[0]["error"] == records[1]["error"]
    error = records[0]["error"]
    assert "\n" not in error
    assert "rank 1 could not check its share of the files: [Errno 13] Permission denied" in error
    assert ".distcp" in error
    assert all(record["seconds"] < 60 for record in records)


def test_a_checkpoint_edited_on_purpose_names_the_opt_out_and_loads_with_it(sink_checkpoint):
    """Weights averaged into a copy of a checkpoint (a user's edit, not damage): refused, in a line naming
    ``checkpoint_digests=False``, with which it loads as stock loads it."""
    edit(sink_checkpoint, lambda c: c["state_dict"]["net.2.bias"].mul_(0.5))
    with pytest.raises(ValueError, match=r"is damaged: .* edited on purpose .* checkpoint_digests=False"):
        fit(SinkStrategy(accumulation_steps=2), ckpt_path=sink_checkpoint)
    fit(SinkStrategy(accumulation_steps=2, checkpoint_digests=False), ckpt_path=sink_checkpoint)
