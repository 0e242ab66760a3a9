"""Carried non-tensor bytes are checked before they reach an output: a byte flipped in a DCP non-tensor item, in a
DCP folder's ``meta.pt`` or in a one-device checkpoint's pickle makes the conversion refuse, naming the item, and
leaves no destination. Without the check each of these converts, and ``verify`` certifies the corrupted output."""

from __future__ import annotations

import io
import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from lightning_sink.layout import MeshLayout, layout_on_mesh, save_layout
from lightning_sink.reshard import (
    load_resharded_checkpoint,
    transform_checkpoint_by_rank,
    transform_checkpoints,
    unpickle_carried,
    verify_checkpoint,
)
from lightning_sink.reshard.carried_integrity import check_archive_bytes
from lightning_sink.reshard.open_source import open_source
from tests.reshard.conftest import rows


def record_span(archive: bytes, name_suffix: str) -> tuple[int, int]:
    """[start, end) of the stored bytes of the zip record whose name ends with ``name_suffix`` (zip format: the data
    follows a 30-byte local header, the file name and the extra field)."""
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        (info,) = [i for i in opened.infolist() if i.filename.endswith(name_suffix)]
    name_length, extra_length = struct.unpack_from("<HH", archive, info.header_offset + 26)
    start = info.header_offset + 30 + name_length + extra_length
    return start, start + info.file_size


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def float_byte(archive: bytes, value: float) -> int:
    """The offset of the last byte of a pickled float (BINFLOAT: ``G`` + 8 big-endian bytes) inside data.pkl: a flip
    there still unpickles, to a slightly different number."""
    start, end = record_span(archive, "data.pkl")
    position = archive.index(b"G" + struct.pack(">d", value), start, end)
    return position + 8


def assert_no_destination(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


# --- the check itself -----------------------------------------------------------------------------------------------


def saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_an_intact_archive_passes_and_a_flipped_pickle_byte_fails():
    archive = saved({"lr": 0.01, "w": torch.arange(4.0)})
    check_archive_bytes(archive, "item")
    damaged = bytearray(archive)
    damaged[float_byte(archive, 0.01)] ^= 0x01
    assert torch.load(io.BytesIO(bytes(damaged)), weights_only=True)["lr"] != 0.01  # loads, silently changed
    with pytest.raises(ValueError, match=r"item: record '.*data.pkl' does not match its CRC-32"):
        check_archive_bytes(bytes(damaged), "item")


def test_a_flipped_tensor_byte_inside_a_carried_archive_fails():
    archive = saved({"w": torch.arange(4.0)})
    start, _ = record_span(archive, "data/0")
    damaged = bytearray(archive)
    damaged[start + 5] ^= 0x01
    with pytest.raises(ValueError, match=r"record '.*data/0' does not match its CRC-32"):
        check_archive_bytes(bytes(damaged), "item")


def test_compressed_records_and_non_archives_are_refused():
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02K\x11." * 100)
    with pytest.raises(ValueError, match=r"is compressed"):
        check_archive_bytes(buffer.getvalue(), "item")
    with pytest.raises(ValueError, match=r"item: not a readable torch.save archive"):
        check_archive_bytes(b"\x80\x02K\x11.", "item")


# --- one-device source (no processes needed) -------------------------------------------------------------------------


@pytest.fixture
def one_device(tmp_path: Path) -> tuple[Path, Path]:
    source = tmp_path / "model.pt"
    torch.save({"w": torch.arange(24.0).reshape(6, 4), "lr": 0.01, "step": torch.tensor(5.0)}, source)
    target = layout_on_mesh(open_source(source, None).layout, MeshLayout.one_dimensional(2), rows)
    return source, save_layout(target, tmp_path / "two.json")


def test_a_one_device_pickle_with_a_flipped_byte_is_refused(one_device: tuple[Path, Path], tmp_path: Path):
    source, layout = one_device
    flip(source, float_byte(source.read_bytes(), 0.01))
    assert torch.load(source, weights_only=True)["lr"] != 0.01  # the file still loads: nothing else would notice
    with pytest.raises(ValueError, match=r"checkpoint file '.*model.pt'.*data.pkl' does not match its CRC-32"):
        transform_checkpoints(source, tmp_path / "out", "ckpt_", None, layout)
    assert_no_destination(tmp_path)


def test_an_intact_one_device_file_carries_its_values(one_device: tuple[Path, Path], tmp_path: Path):
    source, layout = one_device
    report = transform_checkpoints(source, tmp_path / "out", "ckpt_", None, layout)
    carried = load_resharded_checkpoint(tmp_path / "out" / "rank_0" / "ckpt_0.pt")["non_tensor_state"]
    assert unpickle_carried(carried["lr"]) == 0.01
    assert report.stats.verify_bytes_read > 0  # the pickle's records, read for checking only


# --- DCP sources (saved by real gloo processes, once per session) ---------------------------------------------------


def item_span(folder: Path, fqn: str) -> tuple[Path, int, int]:
    """(file, offset, length) of a DCP non-tensor item, from DCP's own metadata reader."""
    info = dcp.FileSystemReader(str(folder)).read_metadata().storage_data[MetadataIndex(fqn)]
    return folder / info.relative_path, info.offset, info.length


@pytest.mark.slow
def test_a_dcp_non_tensor_item_with_a_flipped_byte_is_refused(source: Path, two_ranks, tmp_path: Path):
    path, offset, length = item_span(source, "meta.global_step")
    item = path.read_bytes()[offset : offset + length]
    start, end = record_span(item, "data.pkl")
    position = item.index(b"K\x11", start, end) + 1  # BININT1 17: a flip makes it 16, still a valid pickle
    flip(path, offset + position)
    with pytest.raises(ValueError, match=r"non-tensor item 'meta.global_step'.*does not match its CRC-32"):
        transform_checkpoints(source, tmp_path / "out", "ckpt_", None, two_ranks)
    assert_no_destination(tmp_path)
    layout = save_layout(two_ranks, tmp_path / "two.json")
    files = {rank: source / f"__{rank}_0.distcp" for rank in range(3)}
    with pytest.raises(ValueError, match=r"non-tensor item 'meta.global_step'.*does not match its CRC-32"):
        transform_checkpoint_by_rank(0, files, tmp_path / "one" / "rank_0.pt", None, layout)
    assert not (tmp_path / "one" / "rank_0.pt").exists()


@pytest.mark.slow
def test_a_dcp_folders_meta_pt_with_a_flipped_byte_is_refused(source: Path, two_ranks, tmp_path: Path):
    torch.save({"epoch": 3, "lr": 0.01}, source / "meta.pt")
    intact = transform_checkpoints(source, tmp_path / "good", "ckpt_", None, two_ranks)
    assert verify_checkpoint(intact.destination).world_size == 2
    meta = load_resharded_checkpoint(tmp_path / "good" / "rank_1" / "ckpt_1.pt")["extra_files"]["meta.pt"]
    assert meta == (source / "meta.pt").read_bytes()
    flip(source / "meta.pt", float_byte((source / "meta.pt").read_bytes(), 0.01))
    with pytest.raises(ValueError, match=r"meta.pt'.*data.pkl' does not match its CRC-32"):
        transform_checkpoints(source, tmp_path / "out", "ckpt_", None, two_ranks)
    assert_no_destination(tmp_path)
    assert os.path.isdir(tmp_path / "good")
