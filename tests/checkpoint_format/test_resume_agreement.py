"""Ranks agreeing that they resume from one checkpoint: two gloo processes whose checkpoint path holds another file for
each (a node's own disk), against the same file for both; the identities themselves in one process."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from lightning_sink.checkpoint_format.agreement import CheckpointNotSharedError
from lightning_sink.checkpoint_format.resume_agreement import (
    CHUNK_BYTES,
    agree_on_resume,
    checkpoint_identity,
    checkpoint_step,
)
from tests.distributed import init_process_group, spawn


def test_a_file_is_identified_by_the_sha256_of_its_bytes_read_in_chunks(tmp_path):
    data = bytes(range(256)) * (CHUNK_BYTES // 128 + 3)  # more than two chunks
    (tmp_path / "a.ckpt").write_bytes(data)
    assert checkpoint_identity(tmp_path / "a.ckpt").digest == hashlib.sha256(data).hexdigest()
    assert "inode" in checkpoint_identity(tmp_path / "a.ckpt", hash_file=False).digest  # the first round: no read
    assert checkpoint_identity(None).path is None
    assert checkpoint_identity(tmp_path / "absent").digest != checkpoint_identity(None).digest


def test_a_folder_is_identified_by_its_entries_and_identifying_files_not_its_shards(tmp_path):
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(b"metadata")
        (tmp_path / name / "__0_0.distcp").write_bytes(b"shard")
    assert checkpoint_identity(tmp_path / "one").digest == checkpoint_identity(tmp_path / "two").digest
    torch.save({"global_step": 7}, tmp_path / "two" / "meta.pt")
    assert checkpoint_identity(tmp_path / "one").digest != checkpoint_identity(tmp_path / "two").digest
    assert checkpoint_step(tmp_path / "two") == 7 and checkpoint_step(tmp_path / "one") is None


def _resume(rank: int, world_size: int, init_file: str, root: str, folders: list[str]) -> None:
    init_process_group(rank, world_size, init_file)
    folder = f"{root}/{folders[rank]}"
    error = None
    try:
        agree_on_resume(f"{folder}/resume.ckpt", world_size)
    except CheckpointNotSharedError as failure:
        error = str(failure)
    with open(f"{root}/result{rank}.json", "w") as out:
        json.dump(error, out)


def _per_rank_checkpoints(tmp_path):
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
        torch.save({"global_step": 4 * (rank + 1), "state_dict": {}}, tmp_path / f"rank{rank}" / "resume.ckpt")


def test_ranks_seeing_different_steps_at_one_path_all_raise_the_same_line_naming_the_steps(tmp_path):
    _per_rank_checkpoints(tmp_path)
    spawn(_resume, 2, tmp_path / "init", str(tmp_path), ["rank0", "rank1"])
    errors = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(2)]
    assert errors[0] == errors[1] and errors[0] is not None
    assert "\n" not in errors[0]
    assert "rank 0 (host" in errors[0] and ") see" in errors[0] and "step 4 " in errors[0], errors[0]
    assert "rank 1 (host" in errors[0] and "step 8 " in errors[0], errors[0]


@pytest.mark.parametrize("copied", [False, True])
def test_ranks_seeing_one_file_or_copies_of_the_same_bytes_pass(tmp_path, copied):
    _per_rank_checkpoints(tmp_path)
    if copied:  # another file (inode, time) with the same bytes: compared by hashing
        (tmp_path / "copy").mkdir()
        shutil.copyfile(tmp_path / "rank0" / "resume.ckpt", tmp_path / "copy" / "resume.ckpt")
    spawn(_resume, 2, tmp_path / "init", str(tmp_path), ["rank0", "copy" if copied else "rank0"])
    assert [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(2)] == [None, None]
