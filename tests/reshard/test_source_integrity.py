"""Every source byte a conversion copies is integrity-checked, whatever the read pattern: a byte flipped inside a
record that each target rank reads only in part, or inside a rank file (whose records carry no CRC-32), makes the
conversion refuse, naming the file (and tensor), and leaves nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from lightning_sink.layout import MeshLayout, layout_on_mesh, load_layout
from lightning_sink.layout.dcp_metadata import read_dcp_metadata
from lightning_sink.reshard import (
    transform_checkpoint_by_rank,
    transform_checkpoints,
    verify_checkpoint,
)
from tests.dcp_runs import full_tensors
from tests.reshard.conftest import SPEC_3, rows

pytestmark = pytest.mark.slow


def flip_dcp_element(folder: Path, fqn: str, chunk_offsets: tuple[int, ...], element: int) -> Path:
    """Flip one bit of element ``element`` (row-major, in the stored chunk) of a DCP chunk; the file's path."""
    from lightning_sink.reshard.reader import ReadStats, locate_tensors

    metadata = read_dcp_metadata(folder)
    index = next(i for i, c in enumerate(metadata.state_dict_metadata[fqn].chunks) if tuple(c.offsets) == chunk_offsets)
    info = metadata.storage_data[MetadataIndex(fqn, torch.Size(chunk_offsets), index)]
    path = folder / info.relative_path
    fd = os.open(path, os.O_RDWR)
    try:
        location = locate_tensors(fd, path, info.offset, info.length, "probe", ReadStats())
        at = location.data_offset + element * location.dtype.itemsize
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x04]), at)
    finally:
        os.close(fd)
    return path


def leftovers(tmp_path: Path, name: str) -> list[Path]:
    return [p for p in tmp_path.iterdir() if p.name == name or p.name.startswith(f".{name}.")]


@pytest.mark.parametrize("workers", [None, 1])
def test_a_flipped_byte_in_a_record_every_target_reads_in_part_is_refused(
    source: Path, two_ranks, tmp_path: Path, workers
):
    # Chunk 1 of v holds columns 3..5 of rows 0..3; target rank 1 reads its rows 2..3 and rank 0 rows 0..1.
    path = flip_dcp_element(source, "state_dict.v", (0, 3), element=2 * 3 + 1)  # row 2, read by target rank 1 only
    with pytest.raises(ValueError, match=rf"tensor 'state_dict.v' .*{path.name}.*corrupt: CRC-32"):
        transform_checkpoints(source, tmp_path / "out", "ckpt_", None, two_ranks, workers=workers)
    assert leftovers(tmp_path, "out") == []


def test_the_intact_checkpoint_converts_and_every_record_read_in_part_is_checked(
    source: Path, two_ranks, tmp_path: Path
):
    report = transform_checkpoints(source, tmp_path / "out", "ckpt_", None, two_ranks)
    full = full_tensors(SPEC_3, seed=1)
    for rank in range(2):
        shards = torch.load(tmp_path / "out" / f"rank_{rank}" / f"ckpt_{rank}.pt", weights_only=True)["tensors"]
        (chunk,) = two_ranks.tensors["state_dict.v"].chunks_of_rank(rank)
        assert torch.equal(
            shards["state_dict.v"], full["state_dict.v"][chunk.offsets[0] : chunk.offsets[0] + chunk.sizes[0]]
        )
    stats = report.stats
    # Every stored non-empty chunk (v: 3, w: 3, b: 2, exp_avg: 3) was checked, read whole or in parts; the
    # payload read stays exactly what is needed, the checks read only the 8-byte data descriptors.
    assert stats.records_crc_checked == 11
    assert stats.payload_bytes_read == stats.bytes_needed
    assert 0 < stats.verify_bytes_read <= 8 * 11 * 2


def test_one_target_rank_alone_reads_the_rest_of_a_record_for_checking(source: Path, two_ranks, tmp_path: Path):
    """transform_checkpoint_by_rank sees no other target rank's parts: a byte it does not copy still fails it."""
    flip_dcp_element(source, "state_dict.v", (0, 6), element=0)  # row 0: target rank 0's part
    files = {rank: source / f"__{rank}_0.distcp" for rank in range(3)}
    with pytest.raises(ValueError, match=r"tensor 'state_dict.v' .*corrupt: CRC-32"):
        transform_checkpoint_by_rank(1, files, tmp_path / "r1.pt", None, two_ranks)
    assert not list(tmp_path.glob("*r1.pt*"))


def test_a_flipped_byte_in_a_rank_file_source_is_refused(source: Path, two_ranks, tmp_path: Path):
    """This package's rank files carry no CRC-32s: they are checked against their manifest's SHA-256."""
    from lightning_sink.reshard.reader import ReadStats, locate_tensors

    transform_checkpoints(source, tmp_path / "mid", "ckpt_", None, two_ranks)
    rank_file = tmp_path / "mid" / "rank_0" / "ckpt_0.pt"
    fd = os.open(rank_file, os.O_RDWR)
    try:
        location = locate_tensors(fd, rank_file, 0, rank_file.stat().st_size, "probe", ReadStats())["tensors"][
            "state_dict.w"
        ]
        at = location.data_offset + 5
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
    finally:
        os.close(fd)
    three = layout_on_mesh(load_layout(source), MeshLayout.one_dimensional(3), rows)
    with pytest.raises(ValueError, match=r"rank file '.*rank_0/ckpt_0\.pt': SHA-256 or size differs"):
        transform_checkpoints(tmp_path / "mid", tmp_path / "out", "ckpt_", None, three)
    assert leftovers(tmp_path, "out") == []
    # Without its manifest, nothing vouches for the file's bytes: refused as well.
    (tmp_path / "mid" / "MANIFEST.json").unlink()
    with pytest.raises(ValueError, match=r"ckpt_0\.pt' carries no CRC-32s and has no MANIFEST\.json entry"):
        transform_checkpoints(tmp_path / "mid", tmp_path / "out", "ckpt_", None, three)
    assert leftovers(tmp_path, "out") == []


def test_an_intact_rank_file_source_is_hashed_once_apart_from_the_payload(source: Path, two_ranks, tmp_path: Path):
    transform_checkpoints(source, tmp_path / "mid", "ckpt_", None, two_ranks)
    three = layout_on_mesh(load_layout(source), MeshLayout.one_dimensional(3), rows)
    report = transform_checkpoints(tmp_path / "mid", tmp_path / "out", "ckpt_", None, three)
    assert verify_checkpoint(tmp_path / "out").world_size == 3
    manifest = json.loads((tmp_path / "mid" / "MANIFEST.json").read_text())
    rank_file_bytes = sum(entry["bytes"] for name, entry in manifest["files"].items() if name.endswith(".pt"))
    stats = report.stats
    assert stats.verify_bytes_read == rank_file_bytes
    assert stats.payload_bytes_read == stats.bytes_needed
