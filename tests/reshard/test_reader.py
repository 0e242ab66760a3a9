"""Exact reads from torch.save'd tensors: row-major, non-row-major (a saved transpose) and 0-d, checked against
slicing the tensors in memory; bytes read against bytes needed."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from lightning_sink.layout import Chunk, Layout, MeshLayout, TensorLayout, layout_on_mesh, save_layout
from lightning_sink.reshard import load_resharded_checkpoint, transform_checkpoints


def test_plain_rank_files_with_a_transposed_tensor_and_a_scalar(tmp_path: Path):
    generator = torch.Generator().manual_seed(3)
    full = {
        "w": torch.randn(7, 5, generator=generator),
        "t": torch.randn(6, 9, generator=generator).t(),  # stored column-major: shape (9, 6), stride (1, 9)
        "step": torch.tensor(4.0, dtype=torch.bfloat16),
    }
    assert not full["t"].is_contiguous()
    source = tmp_path / "seed"
    (source / "rank_0").mkdir(parents=True)
    torch.save(full, source / "rank_0" / "checkpoint_0.pt")  # one rank holding everything (MindSpore's layout)
    tensors = {
        name: TensorLayout(
            role="parameter",
            global_shape=tuple(v.shape),
            dtype=str(v.dtype).removeprefix("torch."),
            placements=("Replicate()",),
            chunks=(Chunk(0, (0,) * v.dim(), tuple(v.shape)),),
        )
        for name, v in full.items()
    }
    one = Layout(world_size=1, mesh=MeshLayout.one_dimensional(1), tensors=tensors)
    save_layout(one, source / "layout.json")
    three = layout_on_mesh(
        one, MeshLayout.one_dimensional(3), lambda f, t: ["Shard(1)"] if t.global_shape else ["Replicate()"]
    )
    report = transform_checkpoints(source, tmp_path / "out", "ckpt_", None, three)
    for rank in range(3):
        shards = load_resharded_checkpoint(tmp_path / "out" / f"rank_{rank}" / f"ckpt_{rank}.pt")["tensors"]
        for name, shard in shards.items():
            (chunk,) = three.tensors[name].chunks_of_rank(rank)
            expected = full[name][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            assert shard.is_contiguous() and torch.equal(shard, expected), (rank, name)
    stats = report.stats
    # Each target rank needs its third of w and t, and its own copy of the replicated step.
    needed = full["w"].numel() * 4 + full["t"].numel() * 4 + 3 * 2
    assert stats.bytes_needed == needed
    # Row-major tensors are read exactly; the transposed one is read whole once per target rank (3 x 216 bytes).
    assert stats.payload_bytes_read == needed + 2 * full["t"].numel() * 4


def _stored(tmp_path: Path, tensor: torch.Tensor):
    """A tensor torch.save'd alone, located on disk as the reader sees DCP chunks and rank files."""
    from lightning_sink.reshard.reader import ReadStats, locate_tensors

    path = tmp_path / "chunk.pt"
    torch.save({"x": tensor}, path)
    fd = os.open(path, os.O_RDWR)
    return path, fd, locate_tensors(fd, path, 0, path.stat().st_size, "test chunk", ReadStats())["x"]


# (stored chunk shape, its global offsets, target shard shape, its global offsets, region): chosen so that each of
# the reader's three paths runs: runs read one by one, a file span scattered into >IOV_MAX target runs, and a
# span of short runs through the bounded buffer.
READ_CASES = {
    "direct_runs": ((64, 2048), (0, 1024), (64, 1536), (0, 512), ((0, 1024), (64, 1024))),  # column part of rows
    "scattered": ((1100, 1024), (0, 1024), (1100, 2048), (0, 0), ((0, 1024), (1100, 1024))),  # half rows, whole chunk
    "buffered": ((300, 16), (10, 0), (400, 32), (0, 0), ((10, 0), (300, 16))),  # 64-byte half rows
}


@pytest.mark.parametrize("case", sorted(READ_CASES))
def test_each_read_path_equals_slicing_and_reads_only_the_region(case, tmp_path: Path):
    from lightning_sink.reshard.reader import CopyTarget, ReadStats, SourceChunk, copy_region

    chunk_shape, chunk_offsets, target_shape, target_offsets, region = READ_CASES[case]
    stored = torch.randn(chunk_shape, generator=torch.Generator().manual_seed(1))
    _, fd, location = _stored(tmp_path, stored)
    target, stats = torch.zeros(target_shape), ReadStats()
    try:
        copy_region(SourceChunk(fd, location, chunk_offsets), region, CopyTarget(target, target_offsets), stats)
    finally:
        os.close(fd)
    (offsets, sizes) = region
    source_index = tuple(slice(o - c, o - c + n) for o, c, n in zip(offsets, chunk_offsets, sizes))
    target_index = tuple(slice(o - t, o - t + n) for o, t, n in zip(offsets, target_offsets, sizes))
    expected = torch.zeros(target_shape)
    expected[target_index] = stored[source_index]
    assert torch.equal(target, expected)
    assert stats.payload_bytes_read == stats.bytes_needed == math.prod(sizes) * 4
    assert stats.records_crc_checked == (1 if tuple(sizes) == chunk_shape else 0)  # a record read whole is checked


def test_a_flipped_byte_in_a_record_read_whole_by_scatter_reads_fails_its_crc(tmp_path: Path):
    from lightning_sink.reshard.reader import CopyTarget, ReadStats, SourceChunk, copy_region

    chunk_shape, chunk_offsets, target_shape, target_offsets, region = READ_CASES["scattered"]
    _, fd, location = _stored(tmp_path, torch.randn(chunk_shape))
    try:
        byte = os.pread(fd, 1, location.data_offset + 123_457)
        os.pwrite(fd, bytes([byte[0] ^ 0x10]), location.data_offset + 123_457)
        with pytest.raises(ValueError, match="test chunk: corrupt: CRC-32"):
            target = CopyTarget(torch.zeros(target_shape), target_offsets)
            copy_region(SourceChunk(fd, location, chunk_offsets), region, target, ReadStats())
    finally:
        os.close(fd)


def test_bands_hold_whole_copies_tile_the_shard_and_cut_at_every_source_row_boundary():
    from lightning_sink.reshard.plan import bands_of, plan_rank

    # 8 sources: rows in 4 blocks of 25 (dp), columns in 2 halves (tp); 3 targets: rows 0..33, 34..67, 68..99.
    one = Layout(
        world_size=1,
        mesh=MeshLayout.one_dimensional(1),
        tensors={
            "w": TensorLayout("parameter", (100, 10), "float32", ("Replicate()",), (Chunk(0, (0, 0), (100, 10)),))
        },
    )
    source = layout_on_mesh(
        one, MeshLayout((4, 2), ("dp", "tp"), ((0, 1), (2, 3), (4, 5), (6, 7))), lambda f, t: ["Shard(0)", "Shard(1)"]
    )
    target = layout_on_mesh(one, MeshLayout.one_dimensional(3), lambda f, t: ["Shard(0)"])
    for rank in range(3):
        (shard,) = plan_rank(rank, source, target).shards
        bands = bands_of(shard)
        assert bands[0].start == 0 and bands[-1].stop == shard.chunk.sizes[0]
        assert all(a.stop == b.start for a, b in zip(bands, bands[1:]))  # contiguous, no overlap
        assert sorted((c for band in bands for c in band.copies), key=repr) == sorted(shard.copies, key=repr)
        for band in bands:
            for copy in band.copies:  # a copy lies inside its band
                first = copy.region[0][0] - shard.chunk.offsets[0]
                assert band.start <= first and first + copy.region[1][0] <= band.stop
        # the source's 25-row blocks cut the target rows: e.g. rank 0 (rows 0..33) is bands 0..24 and 25..33
        cuts = sorted(
            {0, *(b for b in range(25, 100, 25))}
            | {shard.chunk.offsets[0], shard.chunk.offsets[0] + shard.chunk.sizes[0]}
        )
        inside = [
            c - shard.chunk.offsets[0]
            for c in cuts
            if shard.chunk.offsets[0] <= c <= shard.chunk.offsets[0] + shard.chunk.sizes[0]
        ]
        assert [band.start for band in bands] + [bands[-1].stop] == inside


def test_the_memory_budget_caps_workers_by_the_largest_band():
    from lightning_sink.reshard.plan import plan_rank
    from lightning_sink.reshard.reader import READ_BUFFER_BYTES
    from lightning_sink.reshard.workers import WORKER_BASELINE_BYTES, worker_count
    from lightning_sink.reshard.writer import write_memory_bytes

    one = Layout(
        world_size=1,
        mesh=MeshLayout.one_dimensional(1),
        tensors={
            "w": TensorLayout("parameter", (100, 10), "float32", ("Replicate()",), (Chunk(0, (0, 0), (100, 10)),))
        },
    )
    source = layout_on_mesh(
        one, MeshLayout((4, 2), ("dp", "tp"), ((0, 1), (2, 3), (4, 5), (6, 7))), lambda f, t: ["Shard(0)", "Shard(1)"]
    )
    target = layout_on_mesh(one, MeshLayout.one_dimensional(3), lambda f, t: ["Shard(0)"])
    plans = [plan_rank(rank, source, target) for rank in range(3)]
    # The largest band: one source block of 25 rows x 10 float32 (a shard of 34 rows never sits in memory whole).
    per_worker = write_memory_bytes(25 * 10 * 4) + READ_BUFFER_BYTES + WORKER_BASELINE_BYTES
    assert worker_count(plans, 3, None) == 3
    assert worker_count(plans, 8, None) == 3  # never more workers than target ranks
    assert worker_count(plans, 3, 2 * per_worker) == 2
    assert worker_count(plans, 3, 2 * per_worker - 1) == 1
    assert worker_count(plans, 3, 10) == 1  # a budget too small for one still converts, in one worker
