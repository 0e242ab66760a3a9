"""Atomic DCP commits in one process (a 1-rank gloo group): replace, failure mid-write, a crash between renames."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_sink.checkpoint_format.atomic import check_checkpoint_dir, previous_dir, staging_dir
from lightning_sink.checkpoint_format.dcp_folder import save_dcp_atomically
from lightning_sink.layout import load_layout


def save(state, metadata, target):
    save_dcp_atomically(state, metadata, target, global_rank=0, world_size=1, barrier=lambda: None)


def read_back(target, like):
    state = {"state_dict": {key: torch.empty_like(value) for key, value in like.items()}}
    dcp.load(state, checkpoint_id=target)
    return state["state_dict"]


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


def test_a_save_replaces_the_previous_checkpoint_whole(tmp_path, one_rank):
    target = tmp_path / "ckpt"
    save({"state_dict": {"w": torch.ones(3)}}, {"global_step": 1}, target)
    save({"state_dict": {"w": torch.full((3,), 2.0)}}, {"global_step": 2}, target)
    assert torch.equal(read_back(target, {"w": torch.ones(3)})["w"], torch.full((3,), 2.0))
    assert torch.load(target / "meta.pt")["global_step"] == 2
    assert set(load_layout(target).tensors) == {"state_dict.w"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]  # no staging or previous folder left


def test_a_write_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, one_rank):
    target = tmp_path / "ckpt"
    save({"state_dict": {"w": torch.ones(3)}}, {"global_step": 1}, target)
    unpicklable = {"state_dict": {"w": torch.zeros(3)}, "extra": {"callback": lambda: None}}
    with pytest.raises(CheckpointException):  # DCP fails while writing its files (the lambda does not pickle)
        save(unpicklable, {"global_step": 2}, target)
    assert torch.equal(read_back(target, {"w": torch.ones(3)})["w"], torch.ones(3))
    assert torch.load(target / "meta.pt")["global_step"] == 1
    assert not staging_dir(target).exists()  # a failed save removes its staging folder (issue 31, item 8)
    save({"state_dict": {"w": torch.full((3,), 3.0)}}, {"global_step": 3}, target)
    assert not staging_dir(target).exists()
    assert torch.load(target / "meta.pt")["global_step"] == 3


def test_a_crash_between_the_two_renames_is_named_on_load(tmp_path):
    target = tmp_path / "ckpt"
    previous_dir(target).mkdir()
    with pytest.raises(FileNotFoundError, match=r"\.ckpt\.previous.*previous, complete checkpoint"):
        check_checkpoint_dir(target)
    target.mkdir()
    check_checkpoint_dir(target)  # a target that exists is fine
