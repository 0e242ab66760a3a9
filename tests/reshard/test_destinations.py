"""Destinations that hold other things: a conversion replaces its destination as a whole, so it must never be a
folder the user keeps anything else in.

Refused for every entry point (the command line, ``transform_checkpoints``, ``ReshardCheckpoint``), with one line:
the working folder, a folder holding it, the home folder, the root, the source or a folder around it; and, even
with ``overwrite``, any existing folder that is not a previous output of this package (its manifest says so and it
holds nothing the manifest does not list). Every test runs in a scratch folder: the working folder it names is
``tmp_path``'s, never the real one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from callbacks import ReshardCheckpoint
from lightning_sink.cli import main
from lightning_sink.reshard import transform_checkpoint_by_rank, transform_checkpoints, verify_checkpoint


def user_folder(path: Path) -> Path:
    """A folder holding the user's own file (what must survive)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "precious.txt").write_text("keep me")
    return path


def intact(path: Path) -> bool:
    return (path / "precious.txt").read_text() == "keep me"


def test_the_command_line_never_replaces_the_working_folder(tiny, tmp_path: Path, monkeypatch, capsys):
    """``lightning-sink reshard --dst-checkpoints-dir . --overwrite`` (issue 31, item 4): it replaced the working
    folder, deleting the user's files in it."""
    work = user_folder(tmp_path / "work")
    monkeypatch.chdir(work)
    argv = ["reshard", "--src-checkpoints-dir", str(tiny["src"]), "--dst-strategy-file", str(tiny["two"])]
    assert main([*argv, "--dst-checkpoints-dir", ".", "--overwrite", "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: dst_checkpoints_dir='.'") and "working folder" in error
    assert intact(work) and sorted(p.name for p in work.iterdir()) == ["precious.txt"]


@pytest.mark.parametrize("where", ["working folder", "parent of the working folder", "home folder", "root"])
def test_the_python_api_refuses_folders_that_hold_the_users_things(tiny, tmp_path: Path, monkeypatch, where: str):
    work = user_folder(tmp_path / "outer" / "work")
    monkeypatch.chdir(work)
    home = user_folder(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    dst = {"working folder": ".", "parent of the working folder": "..", "home folder": str(home), "root": "/"}[where]
    with pytest.raises(ValueError, match=r"^dst_checkpoints_dir=.* (is|holds) (the|a) .*(folder|root)"):
        transform_checkpoints(tiny["src"], dst, "ckpt_", None, tiny["two"], overwrite=True)
    assert intact(work) and intact(home)


@pytest.mark.parametrize("where", ["the source", "a parent of the source", "inside the source"])
def test_the_python_api_refuses_the_source_and_folders_around_it(tiny, where: str):
    src = tiny["src"]
    dst = {"the source": src, "a parent of the source": src.parent, "inside the source": src / "out"}[where]
    with pytest.raises(ValueError, match=r"must not be, contain or lie inside src_checkpoints_dir="):
        transform_checkpoints(src, dst, "ckpt_", None, tiny["two"], overwrite=True)
    assert (src / "rank_0" / "model.pt").is_file()


def test_overwrite_never_replaces_a_folder_of_other_files(tiny, tmp_path: Path):
    dst = user_folder(tmp_path / "out")
    with pytest.raises(ValueError, match=r"not a previous output of lightning-sink.*never replaced"):
        transform_checkpoints(tiny["src"], dst, "ckpt_", None, tiny["two"], overwrite=True)
    assert intact(dst)


def test_overwrite_replaces_a_previous_output_but_not_one_with_files_added(tiny, tmp_path: Path):
    dst = tmp_path / "out"
    one = tiny["src"] / "layout.json"
    transform_checkpoints(tiny["src"], dst, "ckpt_", None, one)  # a previous output: one rank
    transform_checkpoints(tiny["src"], dst, "ckpt_", None, tiny["two"], overwrite=True)  # replaced: two ranks
    assert verify_checkpoint(dst).world_size == 2
    (dst / "notes.txt").write_text("the user's, added later")
    with pytest.raises(ValueError, match=r"'notes.txt' is not listed"):
        transform_checkpoints(tiny["src"], dst, "ckpt_", None, one, overwrite=True)
    assert (dst / "notes.txt").is_file() and verify_checkpoint(dst).world_size == 2


def test_one_rank_overwrite_never_replaces_a_file_that_is_not_a_rank_file(tiny, tmp_path: Path):
    out = tmp_path / "notes.pt"
    out.write_text("the user's")
    with pytest.raises(ValueError, match=r"not a lightning-sink rank file; it is never replaced"):
        transform_checkpoint_by_rank(
            1, {0: tiny["src"] / "rank_0" / "model.pt"}, out, tiny["src"] / "layout.json", tiny["two"], overwrite=True
        )
    assert out.read_text() == "the user's"


@pytest.mark.parametrize("where", ["working folder", "parent of the working folder", "home folder"])
def test_the_callback_refuses_them_at_construction(tiny, tmp_path: Path, monkeypatch, where: str):
    work = user_folder(tmp_path / "outer" / "work")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(work))
    dst = {"working folder": ".", "parent of the working folder": "..", "home folder": str(work)}[where]
    with pytest.raises(ValueError, match=r"^dst_dir=.* (is|holds) the (working|home) folder"):
        ReshardCheckpoint(tiny["two"], dst, overwrite=True)
