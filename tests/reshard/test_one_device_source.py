"""One-device sources: a Lightning ``.ckpt`` from a real one-device fit (and a plain ``torch.save`` state dict with a
layout) converts to N ranks exactly as the equivalent DCP checkpoint does, read without running code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from callbacks import ReshardCheckpoint
from lightning_sink import SinkStrategy
from lightning_sink.cli import main
from lightning_sink.layout import MeshLayout, layout_on_mesh, load_layout, save_layout
from lightning_sink.layout_inference import infer_layout
from lightning_sink.reshard import (
    load_resharded_checkpoint,
    transform_checkpoint_by_rank,
    transform_checkpoints,
    unpickle_carried,
    verify_checkpoint,
)
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer
from tests.reshard.conftest import rows
from tests.strategies.mp_models import TPClassifier

pytestmark = pytest.mark.slow

INIT_ARGS = {"optimizer": "adamw", "lr": 0.01}


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory) -> dict[str, Path]:
    """A real one-device fit: its Lightning checkpoint, and (through ReshardCheckpoint) the equivalent one-rank
    DCP checkpoint of the same final state."""
    folder = tmp_path_factory.mktemp("one_device")
    tp2 = save_layout(infer_layout(TPClassifier, 1, 2, init_args=INIT_ARGS), folder / "tp2.json")
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=2),
        devices=1,
        max_epochs=2,
        callbacks=[ReshardCheckpoint(tp2, folder / "via_callback")],
    )
    trainer.fit(TinyClassifier(**INIT_ARGS), loader(make_dataset(num_samples=24), 4))
    trainer.save_checkpoint(folder / "last.ckpt")
    return {"ckpt": folder / "last.ckpt", "dcp": folder / "via_callback.source", "tp2": tp2}


def targets(run: dict[str, Path], tmp_path: Path) -> dict[int, Path]:
    three = layout_on_mesh(load_layout(run["dcp"]), MeshLayout.one_dimensional(3), rows)
    return {2: run["tp2"], 3: save_layout(three, tmp_path / "rows3.json")}


def assert_same_conversion(mine: Path, reference: Path, world_size: int) -> None:
    for rank in range(world_size):
        a = load_resharded_checkpoint(mine / f"rank_{rank}" / f"ckpt_{rank}.pt")
        b = load_resharded_checkpoint(reference / f"rank_{rank}" / f"ckpt_{rank}.pt")
        assert a["layout"] == b["layout"] and set(a["tensors"]) == set(b["tensors"])
        for fqn, shard in a["tensors"].items():
            expected = b["tensors"][fqn]
            assert shard.dtype == expected.dtype and shard.shape == expected.shape, fqn
            assert torch.equal(shard.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), (
                fqn
            )  # bit for bit
        assert a["non_tensor_state"] == b["non_tensor_state"] and a["paths"] == b["paths"]
        assert same(unpickle_carried(a["extra_files"]["meta.pt"]), unpickle_carried(b["extra_files"]["meta.pt"]))


def same(a: object, b: object) -> bool:
    """Equality of nested checkpoint metadata that holds tensors (the random generators' states)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_lightning_ckpt_converts_like_the_equivalent_dcp_checkpoint(one_device_run, tmp_path: Path, world_size: int):
    layout_file = targets(one_device_run, tmp_path)[world_size]
    report = transform_checkpoints(one_device_run["ckpt"], tmp_path / "from_ckpt", "ckpt_", None, layout_file)
    transform_checkpoints(one_device_run["dcp"], tmp_path / "from_dcp", "ckpt_", None, layout_file)
    assert verify_checkpoint(tmp_path / "from_ckpt").world_size == world_size
    assert_same_conversion(tmp_path / "from_ckpt", tmp_path / "from_dcp", world_size)
    # Against DCP's own loader of the DCP checkpoint: every shard is the slice of the full tensor.
    dcp_to_torch_save(one_device_run["dcp"], tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    layout = load_layout(layout_file)
    for rank in range(world_size):
        checkpoint = load_resharded_checkpoint(tmp_path / "from_ckpt" / f"rank_{rank}" / f"ckpt_{rank}.pt")
        for fqn, shard in checkpoint["tensors"].items():
            value = full
            for key in checkpoint["paths"][fqn]:  # DCP's nested keys, e.g. optimizer_0 / state / net.0.weight / exp_avg
                value = value[key]
            (chunk,) = layout.tensors[fqn].chunks_of_rank(rank)
            assert torch.equal(shard, value[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]), fqn
    stats = report.stats
    assert stats.payload_bytes_read == stats.bytes_needed and stats.records_crc_checked > 0


def test_one_target_rank_and_the_cli_take_the_ckpt_file(one_device_run, tmp_path: Path, capsys):
    layout_file = targets(one_device_run, tmp_path)[3]
    transform_checkpoints(one_device_run["dcp"], tmp_path / "from_dcp", "ckpt_", None, layout_file)
    transform_checkpoint_by_rank(1, {0: one_device_run["ckpt"]}, tmp_path / "r1.pt", None, layout_file)
    mine = load_resharded_checkpoint(tmp_path / "r1.pt")["tensors"]
    reference = load_resharded_checkpoint(tmp_path / "from_dcp" / "rank_1" / "ckpt_1.pt")["tensors"]
    assert set(mine) == set(reference) and all(torch.equal(mine[k], reference[k]) for k in mine)
    common = [
        "reshard",
        "--src-checkpoints-dir",
        str(one_device_run["ckpt"]),
        "--dst-strategy-file",
        str(layout_file),
        "--no-progress",
    ]
    assert main([*common, "--rank-id", "2", "--list-ranks"]) == 0
    assert json.loads(capsys.readouterr().out) == [0]
    assert main([*common, "--dst-checkpoints-dir", str(tmp_path / "cli"), "--ckpt-prefix", "ckpt_"]) == 0
    assert_same_conversion(tmp_path / "cli", tmp_path / "from_dcp", 3)


def test_a_plain_state_dict_file_with_a_layout_converts_like_the_dcp_checkpoint(one_device_run, tmp_path: Path):
    dcp_to_torch_save(one_device_run["dcp"], tmp_path / "full.pt")
    nested = torch.load(tmp_path / "full.pt", weights_only=True)
    plain = {f"state_dict.{name}": tensor for name, tensor in nested["state_dict"].items()}
    torch.save(plain, tmp_path / "weights.pt")
    source_layout = load_layout(one_device_run["dcp"])
    weights = type(source_layout)(1, source_layout.mesh, {f: t for f, t in source_layout.tensors.items() if f in plain})
    save_layout(weights, tmp_path / "weights.json")
    three = layout_on_mesh(weights, MeshLayout.one_dimensional(3), rows)
    transform_checkpoints(tmp_path / "weights.pt", tmp_path / "out", "ckpt_", tmp_path / "weights.json", three)
    for rank in range(3):
        shards = load_resharded_checkpoint(tmp_path / "out" / f"rank_{rank}" / f"ckpt_{rank}.pt")["tensors"]
        assert set(shards) == set(plain)
        for fqn, shard in shards.items():
            (chunk,) = three.tensors[fqn].chunks_of_rank(rank)
            assert torch.equal(shard, plain[fqn][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))])


class Payload:
    """An arbitrary class: unpickling it would run code the file names."""


def test_a_ckpt_naming_code_is_refused_naming_the_file(tmp_path: Path, one_device_run):
    torch.save(
        {"pytorch-lightning_version": "2.6", "state_dict": {"w": torch.ones(4)}, "evil": Payload()},
        tmp_path / "evil.ckpt",
    )
    with pytest.raises(ValueError, match=r"evil\.ckpt.*Weights only load failed"):
        transform_checkpoints(tmp_path / "evil.ckpt", tmp_path / "out", "ckpt_", None, one_device_run["tp2"])
    assert not (tmp_path / "out").exists()


def test_a_flipped_byte_in_the_ckpt_is_refused(one_device_run, tmp_path: Path):
    """Each of the 2 tensor-parallel targets reads half of the weight's rows: the parts' CRC-32s catch the flip."""
    import os
    import shutil

    from lightning_sink.reshard.reader import ReadStats, locate_tensors

    damaged = Path(shutil.copy(one_device_run["ckpt"], tmp_path / "damaged.ckpt"))
    fd = os.open(damaged, os.O_RDWR)
    try:
        location = locate_tensors(fd, damaged, 0, damaged.stat().st_size, "probe", ReadStats())["state_dict"][
            "net.0.weight"
        ]
        at = location.data_offset + 3
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x20]), at)
    finally:
        os.close(fd)
    with pytest.raises(
        ValueError, match=r"tensor .state_dict.net.0.weight. in checkpoint file .*damaged\.ckpt.*corrupt: CRC-32"
    ):
        transform_checkpoints(damaged, tmp_path / "out", "ckpt_", None, one_device_run["tp2"])
    assert not (tmp_path / "out").exists()
