"""A source is one save (issue 31, item 6): a folder this package saved records the SHA-256 of each of its files
(``SAVE_DIGESTS.json``, written last), so one save's ``.metadata`` with another save's storage file at the same
offsets - which converted and verified, every tensor a mix of the two, because each record's CRC-32 is
self-consistent - is refused, naming the file. The fingerprint is that of the metadata bytes actually parsed."""

from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from lightning_sink.checkpoint_format.dcp_folder import save_dcp_atomically
from lightning_sink.layout import MeshLayout, layout_on_mesh, load_layout
from lightning_sink.reshard import load_resharded_checkpoint, transform_checkpoints
from lightning_sink.reshard.open_source import open_source
from tests.reshard.conftest import rows


def save(folder: Path, value: float) -> Path:
    """The save ``ReshardCheckpoint`` makes of a one-device run (and, per rank, the model-parallel strategy)."""
    state = {"state_dict": {"w": torch.full((6, 4), value), "b": torch.full((4,), value)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_dcp_atomically(state, {"epoch": int(value)}, folder, global_rank=0, world_size=1, barrier=lambda: None)
    return folder


@pytest.fixture
def two_saves(tmp_path: Path) -> tuple[Path, Path]:
    return save(tmp_path / "a", 1.0), save(tmp_path / "b", 2.0)


def test_one_saves_metadata_with_anothers_storage_file_is_refused(two_saves, tmp_path: Path):
    a, b = two_saves
    shutil.copyfile(b / "__0_0.distcp", a / "__0_0.distcp")  # the same offsets: every record self-consistent
    target = layout_on_mesh(load_layout(a), MeshLayout.one_dimensional(2), rows)
    with pytest.raises(ValueError, match=r"a/__0_0\.distcp' does not belong to this save"):
        transform_checkpoints(a, tmp_path / "out", "ckpt_", None, target)
    assert not (tmp_path / "out").exists()


def test_a_save_converts_with_its_files_checked_whole(two_saves, tmp_path: Path):
    a, _ = two_saves
    target = layout_on_mesh(load_layout(a), MeshLayout.one_dimensional(2), rows)
    report = transform_checkpoints(a, tmp_path / "out", "ckpt_", None, target)
    assert report.stats.verify_bytes_read >= (a / "__0_0.distcp").stat().st_size
    shard = load_resharded_checkpoint(tmp_path / "out" / "rank_1" / "ckpt_1.pt")["tensors"]["state_dict.w"]
    assert torch.equal(shard, torch.full((3, 4), 1.0))


def test_the_fingerprint_is_that_of_the_metadata_bytes_parsed(two_saves):
    a, _ = two_saves
    assert open_source(a, None).fingerprint == hashlib.sha256((a / ".metadata").read_bytes()).hexdigest()
