"""Hand-made hostile files (issue 31, items 2 and 3): links and FIFOs where the engine reads or writes, and tiny
files whose names or contents claim huge world sizes. Each is refused with one ValueError naming the file, without
following the link, waiting on the FIFO, quoting the file's content or allocating by the claim."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from lightning_sink.checkpoint_format.rank_file import RANK_FILE_FORMAT, RANK_FILE_VERSION
from lightning_sink.layout import load_layout, save_layout
from lightning_sink.reshard import (
    load_resharded_checkpoint,
    transform_checkpoint_by_rank,
    transform_checkpoints,
    verify_checkpoint,
)

SECRET = "TOP-SECRET-TOKEN-1234"


def returns_within(seconds: float, call, fifo: Path | None = None):
    """``call()``'s result or exception, or a failure when it is still blocked after ``seconds`` (a FIFO's reader
    is then released by opening its other end, so that no thread stays blocked)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"still blocked after {seconds} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def one_rank_file(tiny, tmp_path: Path) -> Path:
    """Target rank 1's file written alone (with its ``.sha256`` sidecar)."""
    out = tmp_path / "alone" / "ckpt_1.pt"
    transform_checkpoint_by_rank(1, {0: tiny["src"] / "rank_0" / "model.pt"}, out, tiny["src"], tiny["two"])
    return out


def test_a_planted_link_at_a_temporary_name_is_not_written_through(tiny, tmp_path: Path):
    """Per-rank mode wrote its sidecar's temporary file at a fixed name: a link planted there made it overwrite a
    file outside the folder."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    (tmp_path / "alone").mkdir()
    (tmp_path / "alone" / ".ckpt_1.pt.sha256.tmp").symlink_to(outside)
    out = one_rank_file(tiny, tmp_path)
    assert outside.read_text() == "not yours"
    assert load_resharded_checkpoint(out)["rank"] == 1


def test_a_sidecar_that_is_a_link_is_refused_without_quoting_its_target(tiny, tmp_path: Path):
    out = one_rank_file(tiny, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text(f"{SECRET} 12\n")
    sidecar = out.with_name(out.name + ".sha256")
    sidecar.unlink()
    sidecar.symlink_to(secret)
    with pytest.raises(ValueError, match=r"ckpt_1\.pt\.sha256.*symbolic link") as refused:
        load_resharded_checkpoint(out)
    assert SECRET not in str(refused.value)


def test_a_sidecar_of_other_text_is_refused_without_quoting_it(tiny, tmp_path: Path):
    out = one_rank_file(tiny, tmp_path)
    out.with_name(out.name + ".sha256").write_text(f"{SECRET} 12\n")
    with pytest.raises(ValueError, match=r"ckpt_1\.pt\.sha256' is not '<64 hex digits> <bytes>'") as refused:
        load_resharded_checkpoint(out)
    assert SECRET not in str(refused.value)


@pytest.mark.parametrize("replaced", ["MANIFEST.json", "rank_1/ckpt_1.pt"])
def test_a_fifo_in_a_resharded_folder_does_not_hang_verify(tiny, tmp_path: Path, replaced: str):
    dst = tmp_path / "out"
    transform_checkpoints(tiny["src"], dst, "ckpt_", None, tiny["two"])
    (dst / replaced).unlink()
    os.mkfifo(dst / replaced)
    with pytest.raises(ValueError, match=rf"{replaced}.*not a regular file"):
        returns_within(60, lambda: verify_checkpoint(dst), fifo=dst / replaced)


def test_a_fifo_as_a_source_file_does_not_hang_reshard(tiny, tmp_path: Path):
    model = tiny["src"] / "rank_0" / "model.pt"
    model.unlink()
    os.mkfifo(model)
    with pytest.raises(ValueError, match=r"model\.pt.*not a regular file"):
        returns_within(60, lambda: transform_checkpoints(tiny["src"], tmp_path / "out", "ckpt_", None, tiny["two"]))


@pytest.mark.slow
def test_a_fifo_as_meta_pt_does_not_hang_reshard(source: Path, two_ranks, tmp_path: Path):
    os.mkfifo(source / "meta.pt")
    with pytest.raises(ValueError, match=r"meta\.pt.*not a regular file"):
        returns_within(
            120,
            lambda: transform_checkpoints(source, tmp_path / "out", "ckpt_", None, two_ranks),
            fifo=source / "meta.pt",
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_empty_file_named_for_a_huge_rank_is_refused_before_allocating(source: Path, two_ranks, tmp_path: Path):
    """An empty ``__300000000_0.distcp`` made the source's world size 3e8 (a mesh of that many ranks built)."""
    (source / "__300000000_0.distcp").touch()
    with pytest.raises(ValueError, match=r"name rank 300000000, but only 4 rank\(s\) have a file"):
        transform_checkpoints(source, tmp_path / "out", "ckpt_", None, two_ranks)


def test_an_embedded_layout_claiming_a_huge_world_is_refused(tiny, tmp_path: Path):
    """A small unsigned rank file whose embedded layout says world_size 3e8: embedded layouts were never
    validated."""
    layout = json.loads((tiny["src"] / "layout.json").read_text())
    layout["world_size"] = 300_000_000
    source = tmp_path / "crafted"
    (source / "rank_0").mkdir(parents=True)
    torch.save(
        {
            "format": RANK_FILE_FORMAT,
            "version": RANK_FILE_VERSION,
            "rank": 0,
            "layout": json.dumps(layout),
            "tensors": {"w": torch.arange(8.0)},
            "non_tensor_state": {},
            "extra_files": {},
            "paths": {},
            "provenance": {},
        },
        source / "rank_0" / "ckpt_0.pt",
    )
    with pytest.raises(ValueError, match=r"ckpt_0\.pt': embedded layout: world_size 300000000 does not match"):
        transform_checkpoints(source, tmp_path / "out", "ckpt_", None, tiny["two"])


def test_a_target_layout_with_millions_of_pipeline_stages_is_refused(tiny, tmp_path: Path):
    """A 1.26 KB target layout with pipeline.num_stages 2**23 (under the world-size bound) made the conversion
    plan 2**23 target ranks."""
    layout = json.loads(tiny["two"].read_text())
    layout["pipeline"] = {"stage": 0, "num_stages": 2**23}
    layout["world_size"] = 2 * 2**23
    crafted = tmp_path / "stages.json"
    crafted.write_text(json.dumps(layout))
    with pytest.raises(ValueError, match=r"stages\.json': pipeline.num_stages must be an integer from 1 to 1024"):
        transform_checkpoints(tiny["src"], tmp_path / "out", "ckpt_", None, crafted)


def test_a_good_layout_still_loads_and_saves(tiny, tmp_path: Path):
    assert load_layout(save_layout(load_layout(tiny["two"]), tmp_path / "again.json")) == load_layout(tiny["two"])
