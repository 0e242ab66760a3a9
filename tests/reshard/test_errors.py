"""Bad inputs: each a clear error naming the file or tensor, with nothing written to the destination."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_sink.layout import MeshLayout, layout_on_mesh, load_layout, save_layout
from lightning_sink.layout.dcp_metadata import read_dcp_metadata
from lightning_sink.reshard import load_resharded_checkpoint, transform_checkpoints, verify_checkpoint
from tests.reshard.conftest import rows

pytestmark = pytest.mark.slow


def convert(source: Path, layout, dst: Path, **kwargs):
    return transform_checkpoints(source, dst, "ckpt_", kwargs.pop("src_layout", None), layout, **kwargs)


def nothing_written(tmp_path: Path, dst: Path) -> bool:
    return not dst.exists() and not list(tmp_path.glob(".out.*"))


def test_missing_rank_file(source: Path, two_ranks, tmp_path: Path):
    (source / "__1_0.distcp").unlink()
    with pytest.raises(FileNotFoundError, match=r"source rank 1 is missing.*__1_0\.distcp"):
        convert(source, two_ranks, tmp_path / "out")
    assert nothing_written(tmp_path, tmp_path / "out")


def test_truncated_shard_file(source: Path, two_ranks, tmp_path: Path):
    path = source / "__2_0.distcp"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"__2_0\.distcp' is truncated: tensor '.*' needs bytes up to"):
        convert(source, two_ranks, tmp_path / "out")
    assert nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("workers", [None, 1])
def test_corrupted_tensor_bytes_fail_the_crc(source: Path, two_ranks, tmp_path: Path, workers):
    """Flip one byte inside a chunk's raw tensor data: the record is read whole, so its CRC-32 catches it."""
    metadata = read_dcp_metadata(source)
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = metadata.storage_data[MetadataIndex("state_dict.w", torch.Size([0, 0]))]
    blob = bytearray((source / info.relative_path).read_bytes())
    window = blob[info.offset : info.offset + info.length]
    original = torch.load(__import__("io").BytesIO(bytes(window)), weights_only=True)
    needle = original.reshape(-1)[:4].numpy().tobytes()
    position = info.offset + bytes(window).index(needle)
    blob[position] ^= 0xFF
    (source / info.relative_path).write_bytes(bytes(blob))
    one = layout_on_mesh(load_layout(source), MeshLayout.one_dimensional(1), rows)
    with pytest.raises(ValueError, match=rf"tensor 'state_dict.w' .*{info.relative_path}.*corrupt: CRC-32"):
        convert(source, one, tmp_path / "out", workers=workers)  # a worker process's error reaches the caller
    assert nothing_written(tmp_path, tmp_path / "out")


def test_corrupted_zip_structure(source: Path, two_ranks, tmp_path: Path):
    path = source / "__0_0.distcp"
    blob = bytearray(path.read_bytes())
    blob[0:4] = b"JUNK"  # the first chunk's zip local header
    path.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"__0_0\.distcp.*truncated or corrupt"):
        convert(source, two_ranks, tmp_path / "out")
    assert nothing_written(tmp_path, tmp_path / "out")


def widen_w(data: dict) -> None:
    """A self-consistent layout of another shape (each chunk one column wider)."""
    tensor = data["tensors"]["state_dict.w"]
    tensor["global_shape"] = [10, 5]
    for chunk in tensor["chunks"]:
        chunk["sizes"][1] = 5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            widen_w,
            "does not match DCP checkpoint .*: tensor 'state_dict.w' is \\[10, 4\\] float32 in the checkpoint,"
            " \\[10, 5\\] float32 in the layout",
        ),
        (
            lambda d: d["tensors"]["state_dict.w"].update(dtype="float16"),
            "tensor 'state_dict.w' is \\[10, 4\\] float32 in the checkpoint",
        ),
        (lambda d: d["tensors"].pop("state_dict.v"), "only in the checkpoint: \\['state_dict.v'\\]"),
        (lambda d: d.update(version=2), "unknown layout schema version 2"),
    ],
)
def test_layout_that_does_not_match_the_checkpoint(source: Path, two_ranks, tmp_path: Path, change, message):
    layout_file = source / "layout.json"
    data = json.loads(layout_file.read_text())
    change(data)
    layout_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        convert(source, two_ranks, tmp_path / "out")
    assert nothing_written(tmp_path, tmp_path / "out")


def test_target_layout_with_another_shape_or_unknown_version(source: Path, two_ranks, tmp_path: Path):
    path = save_layout(two_ranks, tmp_path / "dst.json")
    data = json.loads(path.read_text())
    data["tensors"]["state_dict.w"]["dtype"] = "float64"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="tensor 'state_dict.w': source layout has shape \\[10, 4\\] float32"):
        convert(source, path, tmp_path / "out")
    data["version"] = 7
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="dst.json.*unknown layout schema version 7"):
        convert(source, path, tmp_path / "out")
    assert nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("prefix", ["../escape_", "a/b", "..", "x\\y"])
def test_prefix_that_would_escape_the_destination(source: Path, two_ranks, tmp_path: Path, prefix: str):
    with pytest.raises(ValueError, match="ckpt_prefix=.*no path separators"):
        transform_checkpoints(source, tmp_path / "out", prefix, None, two_ranks)
    assert nothing_written(tmp_path, tmp_path / "out")


def test_destination_inside_the_source_is_refused(source: Path, two_ranks):
    with pytest.raises(ValueError, match="must not be, contain or lie inside src_checkpoints_dir"):
        convert(source, two_ranks, source / "out")


def test_destination_with_a_different_checkpoint_needs_overwrite(source: Path, two_ranks, tmp_path: Path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a previous output of lightning-sink.*never replaced"):
        convert(source, two_ranks, dst, overwrite=True)  # a folder of other files: never replaced (issue 31)
    assert (dst / "precious.txt").read_text() == "keep me"
    (dst / "precious.txt").unlink()
    convert(source, two_ranks, dst)  # an empty folder is taken
    assert verify_checkpoint(dst).world_size == 2
    convert(source, two_ranks, dst)  # the same conversion again: allowed, replaced atomically
    other = layout_on_mesh(load_layout(source), MeshLayout.one_dimensional(3), rows)
    with pytest.raises(ValueError, match="already holds a different checkpoint.*overwrite=True"):
        convert(source, other, dst)
    assert verify_checkpoint(dst).world_size == 2
    convert(source, other, dst, overwrite=True)  # a previous output of this package: replaced with overwrite
    assert verify_checkpoint(dst).world_size == 3


def test_verify_and_loader_catch_a_damaged_or_incomplete_output(source: Path, two_ranks, tmp_path: Path):
    dst = tmp_path / "out"
    convert(source, two_ranks, dst)
    rank_file = dst / "rank_1" / "ckpt_1.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    rank_file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"rank_1/ckpt_1\.pt.*SHA-256 differs"):
        verify_checkpoint(dst)
    with pytest.raises(ValueError, match=r"ckpt_1\.pt.*SHA-256 or size differs"):
        load_resharded_checkpoint(rank_file)
    rank_file.unlink()
    with pytest.raises(FileNotFoundError, match=r"rank_1/ckpt_1\.pt.*listed in the manifest but missing"):
        verify_checkpoint(dst)
    manifest = json.loads((dst / "MANIFEST.json").read_text())
    manifest["files"]["../../etc/passwd"] = {"sha256": "0", "bytes": 1}
    (dst / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="path '../../etc/passwd' would escape"):
        verify_checkpoint(dst)


class NotATensor:
    """An arbitrary class: unpickling it would mean running code named by the file."""


def test_rank_files_are_loaded_without_unpickling_code(tmp_path: Path):
    """A rank file carrying a pickled object of an arbitrary class is refused (weights_only=True)."""
    from lightning_sink.checkpoint_format.rank_file import load_rank_payload

    path = tmp_path / "evil.pt"
    torch.save({"format": "lightning-sink-resharded-rank", "version": 1, "x": NotATensor()}, path)
    with pytest.raises(ValueError, match="evil.pt.*truncated or corrupt.*Weights only load failed"):
        load_rank_payload(path)
