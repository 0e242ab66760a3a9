"""Checkpoint folders from untrusted hands: nothing outside the given folders is read or written.

Each test crafts the hostile folder itself: a name in a manifest that climbs out, symbolic links planted where the
engine reads or writes, a destination name holding glob characters, a layout claiming more bytes than the file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from lightning_sink.checkpoint_format.resharded_folder import rank_file_path
from lightning_sink.layout import (
    Chunk,
    Layout,
    MeshLayout,
    TensorLayout,
    save_layout,
)
from lightning_sink.reshard import transform_checkpoints, verify_checkpoint


def outside_copy(path: Path, tmp_path: Path) -> Path:
    """A file outside every folder the conversion is given, with ``path``'s bytes."""
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    return Path(shutil.copy(path, tmp_path / "elsewhere" / path.name))


def leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out."))


def test_a_manifest_prefix_that_climbs_out_is_refused_before_any_open(tmp_path: Path):
    """provenance.ckpt_prefix would make the loader open ``elsewhere/rank_0/o_0.pt`` beside the folder."""
    folder, elsewhere = tmp_path / "resharded", tmp_path / "elsewhere" / "rank_0"
    elsewhere.mkdir(parents=True)
    (folder / "rank_0").mkdir(parents=True)
    torch.save({"planted": torch.zeros(1)}, elsewhere / "o_0.pt")
    manifest = {
        "format": "lightning-sink-reshard-manifest",
        "version": 1,
        "files": {},
        "provenance": {"ckpt_prefix": "../../elsewhere/rank_0/o_", "world_size": 1},
    }
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(
        ValueError,
        match=r"MANIFEST.json.*provenance.ckpt_prefix='\.\./\.\./elsewhere/rank_0/o_' must be"
        r" a plain file-name prefix",
    ):
        rank_file_path(folder, 0)  # what Trainer.fit(ckpt_path=folder) on SinkModelParallelStrategy opens
    with pytest.raises(ValueError, match=r"provenance.ckpt_prefix"):
        verify_checkpoint(folder)


@pytest.mark.slow
def test_a_linked_meta_pt_in_the_source_is_not_read(source: Path, two_ranks, tmp_path: Path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not for the checkpoint")
    (source / "meta.pt").symlink_to(secret)
    with pytest.raises(ValueError, match=r"src/meta.pt' is a symbolic link"):
        transform_checkpoints(source, tmp_path / "out", "ckpt_", None, two_ranks)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.slow
def test_a_linked_shard_file_in_the_source_is_not_read(source: Path, two_ranks, tmp_path: Path):
    shard = source / "__1_0.distcp"
    target = outside_copy(shard, tmp_path)
    shard.unlink()
    shard.symlink_to(target)
    with pytest.raises(ValueError, match=r"src/__1_0.distcp' is a symbolic link"):
        transform_checkpoints(source, tmp_path / "out", "ckpt_", None, two_ranks)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.slow
def test_verify_does_not_follow_a_linked_rank_folder(source: Path, two_ranks, tmp_path: Path):
    dst = tmp_path / "out"
    transform_checkpoints(source, dst, "ckpt_", None, two_ranks)
    moved = Path(shutil.move(dst / "rank_1", tmp_path / "rank_1_elsewhere"))
    (dst / "rank_1").symlink_to(moved, target_is_directory=True)  # same bytes: only the link is wrong
    with pytest.raises(ValueError, match=r"out/rank_1.*symbolic link"):
        verify_checkpoint(dst)


@pytest.mark.slow
def test_a_planted_lock_link_does_not_create_its_target(source: Path, two_ranks, tmp_path: Path):
    target = tmp_path / "elsewhere" / "created_by_the_conversion"
    target.parent.mkdir()
    (tmp_path / ".out.lock").symlink_to(target)
    with pytest.raises(ValueError, match=r"\.out\.lock' is a symbolic link"):
        transform_checkpoints(source, tmp_path / "out", "ckpt_", None, two_ranks)
    assert not target.exists() and not os.path.lexists(tmp_path / "out")


@pytest.mark.slow
def test_a_destination_that_is_a_link_is_refused(source_3: Path, two_ranks, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match=r"dst_checkpoints_dir=.*out' is a symbolic link"):
        transform_checkpoints(source_3, tmp_path / "out", "ckpt_", None, two_ranks)
    assert list(elsewhere.iterdir()) == [] and leftovers(tmp_path) == []


@pytest.mark.slow
def test_a_destination_named_with_glob_characters_leaves_other_leftovers_alone(source: Path, two_ranks, tmp_path: Path):
    """Converting into ``ckpt*`` clears only its own leftovers, not ``ckptA``'s (a glob would match them)."""
    others = [tmp_path / ".ckptA.staging-0123abcd", tmp_path / ".ckptA.previous"]
    for folder in others:
        folder.mkdir()
        (folder / "keep.txt").write_text("another conversion's")
    own = tmp_path / ".ckpt*.staging-89abcdef"
    own.mkdir()
    transform_checkpoints(source, tmp_path / "ckpt*", "ckpt_", None, two_ranks)
    assert all((folder / "keep.txt").is_file() for folder in others)
    assert not own.exists() and verify_checkpoint(tmp_path / "ckpt*").world_size == 2


@pytest.mark.slow
def test_a_layout_claiming_more_bytes_than_the_rank_file_is_refused_before_allocating(tmp_path: Path):
    """A 10**18-element tensor in the layout of a plain rank file: refused by size, no allocation attempted."""
    source = tmp_path / "src"
    (source / "rank_0").mkdir(parents=True)
    torch.save({"w": torch.zeros(4)}, source / "rank_0" / "model.pt")
    huge = TensorLayout(
        role="parameter",
        global_shape=(10**18,),
        dtype="float32",
        placements=("Replicate()",),
        chunks=(Chunk(0, (0,), (10**18,)),),
    )
    layout = Layout(world_size=1, mesh=MeshLayout.one_dimensional(1), tensors={"w": huge})
    save_layout(layout, source / "layout.json")
    with pytest.raises(
        ValueError,
        match=r"model.pt'.*gives rank 0 4000000000000000000 bytes of tensors, the file"
        r" holds only",
    ):
        transform_checkpoints(source, tmp_path / "out", "ckpt_", None, layout)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.slow
def test_one_rank_conversion_does_not_follow_a_linked_rank_folder_of_its_source(
    source: Path, two_ranks, tmp_path: Path, capsys
):
    """``lightning-sink reshard --rank-id`` of a rank-file source finds each rank's file as a whole conversion
    does: a ``rank_<x>/`` that is a link out of the folder is refused, not read through."""
    from lightning_sink.cli import main

    rank_files, layout_file = tmp_path / "rank_files", tmp_path / "two_ranks.json"
    transform_checkpoints(source, rank_files, "ckpt_", None, two_ranks)
    save_layout(two_ranks, layout_file)
    moved = Path(shutil.move(rank_files / "rank_1", tmp_path / "elsewhere_rank_1"))
    (rank_files / "rank_1").symlink_to(moved, target_is_directory=True)  # same bytes: only the link is wrong
    out = tmp_path / "out" / "ckpt_1.pt"
    argv = ["reshard", "--src-checkpoints-dir", str(rank_files), "--dst-strategy-file", str(layout_file)]
    assert main([*argv, "--rank-id", "1", "--save-checkpoint-file-name", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "rank_1" in error and "symbolic link" in error and "\n" not in error
    assert not out.exists()
