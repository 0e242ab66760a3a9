"""transform_checkpoints M -> N against two independent references: slicing the full tensors the sources were
built from, and DCP's own load-time resharding in real gloo processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_sink.layout import MeshLayout, layout_on_mesh, load_layout, save_layout
from lightning_sink.reshard import (
    load_resharded_checkpoint,
    rank_list_for_transform,
    transform_checkpoint_by_rank,
    transform_checkpoints,
    verify_checkpoint,
)
from tests.dcp_runs import NON_TENSOR_STATE, dcp_reshard_load, full_tensors
from tests.reshard.conftest import SPEC_3, SPEC_4X2

MESH_4X2 = MeshLayout(shape=(4, 2), dim_names=("dp", "tp"), ranks=((0, 1), (2, 3), (4, 5), (6, 7)))
MESH_2X2 = MeshLayout(shape=(2, 2), dim_names=("dp", "tp"), ranks=((0, 1), (2, 3)))


def rows_1d(fqn, tensor):
    return ["Shard(0)"] if tensor.global_shape else ["Replicate()"]


def mixed_2d(fqn, tensor):
    if len(tensor.global_shape) == 2:
        return ["Shard(1)", "Shard(0)"]
    return ["Replicate()", "Shard(0)"] if tensor.global_shape else ["Replicate()", "Replicate()"]


def fsdp_tp_2x2(fqn, tensor):
    if fqn == "state_dict.fc1.weight":
        return ["_StridedShard(0,sf=2)", "Shard(0)"]
    return mixed_2d(fqn, tensor)


def target(source: Path, mesh: MeshLayout, rule):
    return layout_on_mesh(load_layout(source), mesh, rule)


def assert_matches_full_slices(out: Path, layout, full: dict[str, torch.Tensor], prefix: str = "ckpt_") -> None:
    for rank in range(layout.world_size):
        checkpoint = load_resharded_checkpoint(out / f"rank_{rank}" / f"{prefix}{rank}.pt")
        assert checkpoint["rank"] == rank and checkpoint["layout"] == layout
        assert set(checkpoint["tensors"]) == {f for f, t in layout.tensors.items() if t.chunks_of_rank(rank)}
        for fqn, shard in checkpoint["tensors"].items():
            (chunk,) = layout.tensors[fqn].chunks_of_rank(rank)
            box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            expected = full[fqn][box]
            assert shard.dtype == expected.dtype and torch.equal(shard, expected), (rank, fqn)


CASES = {
    "8_to_3": ("source_8", SPEC_4X2, 0, MeshLayout.one_dimensional(3), rows_1d),
    "8_to_1": ("source_8", SPEC_4X2, 0, MeshLayout.one_dimensional(1), rows_1d),
    "8_to_2x2_fsdp_tp": ("source_8", SPEC_4X2, 0, MESH_2X2, fsdp_tp_2x2),
    "3_to_8": ("source_3", SPEC_3, 1, MESH_4X2, mixed_2d),
    "3_to_5": ("source_3", SPEC_3, 1, MeshLayout.one_dimensional(5), rows_1d),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_target_shard_is_the_slice_of_the_full_tensor(case: str, request, tmp_path: Path):
    fixture, spec, seed, mesh, rule = CASES[case]
    source = request.getfixturevalue(fixture)
    layout = target(source, mesh, rule)
    report = transform_checkpoints(source, tmp_path / "out", "ckpt_", None, layout)
    assert_matches_full_slices(tmp_path / "out", layout, full_tensors(spec, seed))
    assert verify_checkpoint(tmp_path / "out").world_size == mesh.shape[0] * (
        mesh.shape[1] if len(mesh.shape) > 1 else 1
    )
    stats = report.stats
    # Exact reads: every source chunk here is row-major, so the payload read is exactly what is needed.
    assert stats.payload_bytes_read == stats.bytes_needed > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["8_to_3", "8_to_2x2_fsdp_tp"])
def test_equals_dcps_own_load_time_resharding(case: str, request, tmp_path: Path):
    fixture, _, _, mesh, rule = CASES[case]
    source = request.getfixturevalue(fixture)
    layout = target(source, mesh, rule)
    transform_checkpoints(source, tmp_path / "out", "ckpt_", None, layout)
    by_dcp = dcp_reshard_load(layout, source, tmp_path / "dcp_local")
    for rank in range(layout.world_size):
        mine = load_resharded_checkpoint(tmp_path / "out" / f"rank_{rank}" / f"ckpt_{rank}.pt")["tensors"]
        assert set(mine) == set(by_dcp[rank])
        for fqn, shard in mine.items():
            assert torch.equal(shard, by_dcp[rank][fqn]), (rank, fqn)


@pytest.mark.slow
def test_non_tensor_state_is_carried_and_unpickles_weights_only(source_8: Path, tmp_path: Path):
    from lightning_sink.reshard import unpickle_carried

    layout = target(source_8, MeshLayout.one_dimensional(2), rows_1d)
    transform_checkpoints(source_8, tmp_path / "out", "ckpt_", None, layout)
    for rank in range(2):
        carried = load_resharded_checkpoint(tmp_path / "out" / f"rank_{rank}" / f"ckpt_{rank}.pt")["non_tensor_state"]
        assert unpickle_carried(carried["meta.epoch"]) == NON_TENSOR_STATE["epoch"]
        assert unpickle_carried(carried["meta.global_step"]) == NON_TENSOR_STATE["global_step"]
        assert unpickle_carried(carried["meta.loops.fit_loop.batches"]) == [1, 2, 3]


@pytest.mark.slow
def test_rank_list_is_exactly_the_files_a_target_rank_needs(source_8: Path, tmp_path: Path):
    layout = target(source_8, MeshLayout.one_dimensional(3), rows_1d)
    layout_file = save_layout(layout, tmp_path / "dst_layout.json")
    full = full_tensors(SPEC_4X2)
    for rank in range(3):
        needed = rank_list_for_transform(rank, source_8, layout_file)
        files = {r: source_8 / f"__{r}_0.distcp" for r in needed}
        out = tmp_path / "by_rank" / f"rank_{rank}" / f"ckpt_{rank}.pt"
        transform_checkpoint_by_rank(rank, files, out, None, layout_file)  # succeeds with only these files
        shards = load_resharded_checkpoint(out)["tensors"]  # checked against its .sha256 sidecar
        for fqn, shard in shards.items():
            (chunk,) = layout.tensors[fqn].chunks_of_rank(rank)
            assert torch.equal(shard, full[fqn][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))])
        for dropped in needed:  # and each listed file is really needed
            fewer = {r: f for r, f in files.items() if r != dropped}
            if not fewer:
                continue
            with pytest.raises(ValueError, match=f"lacks source rank\\(s\\) \\[{dropped}\\]"):
                transform_checkpoint_by_rank(rank, fewer, tmp_path / "x.pt", None, layout_file)


@pytest.mark.slow
def test_worker_processes_write_the_same_files(source_8: Path, tmp_path: Path):
    layout = target(source_8, MeshLayout.one_dimensional(3), rows_1d)
    calls: list[tuple[int, int]] = []
    serial = transform_checkpoints(
        source_8, tmp_path / "serial", "ckpt_", None, layout, progress=lambda *a: calls.append(a)
    )
    parallel = transform_checkpoints(source_8, tmp_path / "parallel", "ckpt_", None, layout, workers=2)
    total = sum(c.numel * (2 if t.dtype == "bfloat16" else 4) for t in layout.tensors.values() for c in t.chunks)
    assert calls[-1] == (total, total) and [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert [r.sha256 for r in serial.ranks] == [r.sha256 for r in parallel.ranks]
    assert all(r.peak_rss_bytes > 0 for r in parallel.ranks)


@pytest.mark.slow
def test_rank_folder_sources_resharded_output_and_plain_seed_files(source_8: Path, tmp_path: Path):
    """MindSpore's rank_x/checkpoint_x layout: this package's own output, and plain {fqn: local shard} files."""
    full = full_tensors(SPEC_4X2)
    three = target(source_8, MeshLayout.one_dimensional(3), rows_1d)
    transform_checkpoints(source_8, tmp_path / "three", "checkpoint_", None, three)
    # 3 -> 2x2 from the resharded files (their embedded layout is the source layout)
    square = target(source_8, MESH_2X2, fsdp_tp_2x2)
    transform_checkpoints(tmp_path / "three", tmp_path / "square", "ckpt_", None, square)
    assert_matches_full_slices(tmp_path / "square", square, full)
    # plain seed files: rank_x/checkpoint_x.pt = {fqn: local shard}, layout beside them
    seed = tmp_path / "seed"
    for rank in range(3):
        shards = load_resharded_checkpoint(tmp_path / "three" / f"rank_{rank}" / f"checkpoint_{rank}.pt")["tensors"]
        (seed / f"rank_{rank}").mkdir(parents=True)
        torch.save(shards, seed / f"rank_{rank}" / f"checkpoint_{rank}.pt")
    save_layout(three, seed / "strategy.json")
    single = target(source_8, MeshLayout.one_dimensional(1), rows_1d)
    transform_checkpoints(seed, tmp_path / "single", "ckpt_", seed / "strategy.json", single)
    assert_matches_full_slices(tmp_path / "single", single, full)


@pytest.mark.slow
def test_optimizer_state_can_be_dropped_for_an_inference_target(source_8: Path, tmp_path: Path):
    full_layout = target(source_8, MeshLayout.one_dimensional(2), rows_1d)
    from lightning_sink.layout import Layout

    weights_only = Layout(
        full_layout.world_size,
        full_layout.mesh,
        {f: t for f, t in full_layout.tensors.items() if t.role == "parameter"},
    )
    transform_checkpoints(source_8, tmp_path / "out", "ckpt_", None, weights_only)
    shards = load_resharded_checkpoint(tmp_path / "out" / "rank_0" / "ckpt_0.pt")["tensors"]
    assert shards and all(fqn.startswith("state_dict.") for fqn in shards)
