"""Layouts of real DCP checkpoints saved by gloo processes: ``layout_from_state_dict`` (written by rank 0),
``layout_from_dcp_metadata``, and a meta-tensor prediction under a fake process group, all checked against what
``distribute_tensor`` gave each rank and what DCP wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_sink.layout import layout_from_dcp_metadata, layout_from_state_dict, load_layout, parse_placement
from lightning_sink.layout.dcp_metadata import read_dcp_metadata, storage_rank
from tests.dcp_runs import full_tensors, save_dcp_checkpoint

SPEC = {
    "state_dict.fc.weight": ((8, 3), "float32", ("_StridedShard(0,sf=2)", "Shard(0)")),  # FSDP2 + TP rows
    "state_dict.fc.bias": ((7,), "float32", ("Shard(0)", "Replicate()")),  # uneven, replicated over tp
    "state_dict.proj.weight": ((5, 3), "bfloat16", ("Shard(1)", "Shard(0)")),  # uneven on both dims
    "optimizer_0.state.fc.weight.exp_avg": ((8, 3), "float32", ("_StridedShard(0,sf=2)", "Shard(0)")),
    "optimizer_0.state.fc.weight.step": ((), "float32", ("Replicate()", "Replicate()")),
}
PLAIN = ("optimizer_0.state.fc.weight.step",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_dcp_checkpoint(tmp_path_factory.mktemp("dcp") / "ckpt", SPEC, (2, 2), ("dp", "tp"), plain_names=PLAIN)


@pytest.mark.slow
def test_layout_chunks_are_the_shards_each_rank_holds(checkpoint: Path):
    layout = load_layout(checkpoint / "layout.json")
    full = full_tensors(SPEC)
    assert layout.world_size == 4 and layout.mesh.shape == (2, 2) and layout.mesh.dim_names == ("dp", "tp")
    assert set(layout.tensors) == set(SPEC)
    assert set(layout.non_tensor_state) == {"meta.epoch", "meta.global_step", "meta.loops.fit_loop.batches"}
    assert layout.tensors["optimizer_0.state.fc.weight.exp_avg"].role == "optimizer_state"
    assert layout.tensors["state_dict.fc.weight"].placements == ("_StridedShard(0,sf=2)", "Shard(0)")
    for rank in range(4):
        local = torch.load(checkpoint.parent / f"ckpt.local_{rank}.pt", weights_only=True)
        for name, tensor in layout.tensors.items():
            (chunk,) = tensor.chunks_of_rank(rank)
            box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            assert torch.equal(local[name], full[name][box]), (rank, name)


@pytest.mark.slow
def test_layout_agrees_with_the_chunks_dcp_wrote(checkpoint: Path):
    layout = load_layout(checkpoint)
    metadata = read_dcp_metadata(checkpoint)
    for name, tensor in layout.tensors.items():
        stored = metadata.state_dict_metadata[name]
        assert tuple(stored.size) == tensor.global_shape
        assert str(stored.properties.dtype) == f"torch.{tensor.dtype}"
        boxes = {(tuple(c.offsets), tuple(c.sizes)) for c in stored.chunks}
        assert boxes == {c.box for c in tensor.chunks}
        for index, chunk in enumerate(stored.chunks):  # the storing rank holds that box in the layout
            from torch.distributed.checkpoint.metadata import MetadataIndex

            info = metadata.storage_data[MetadataIndex(name, chunk.offsets, index)]
            holder = storage_rank(info.relative_path)
            assert (tuple(chunk.offsets), tuple(chunk.sizes)) in {c.box for c in tensor.chunks_of_rank(holder)}


@pytest.mark.slow
def test_layout_from_dcp_metadata_covers_the_same_boxes(checkpoint: Path):
    derived = layout_from_dcp_metadata(checkpoint)
    written = load_layout(checkpoint)
    assert derived.world_size == 4 and derived.mesh.shape == (4,)
    assert set(derived.tensors) == set(written.tensors)
    assert derived.non_tensor_state.keys() == written.non_tensor_state.keys()
    for name, tensor in derived.tensors.items():
        assert {c.box for c in tensor.chunks} == {c.box for c in written.tensors[name].chunks}
        assert tensor.dtype == written.tensors[name].dtype
    assert derived.tensors["optimizer_0.state.fc.weight.step"].placements == ("Replicate()",)


@pytest.mark.slow
def test_meta_tensors_under_a_fake_process_group_predict_the_same_layout(checkpoint: Path):
    """No real processes: rank 3 of a fake 4-rank group, meta tensors, gives the layout the real run wrote."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.dcp_runs import NON_TENSOR_STATE, _nest

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = {}
    for name, (shape, dtype, placements) in SPEC.items():
        meta = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        if name in PLAIN:
            flat[name] = meta
            continue
        parsed = [parse_placement(p) for p in placements]
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, parsed)
        local = torch.empty(local_shape, dtype=meta.dtype, device="meta")
        flat[name] = DTensor.from_local(
            local, mesh, parsed, run_check=False, shape=torch.Size(shape), stride=meta.stride()
        )
    state = _nest(flat)
    state["meta"] = dict(NON_TENSOR_STATE)
    assert layout_from_state_dict(state) == load_layout(checkpoint)
