"""Source checkpoints for the resharding tests, each saved once per session by real gloo processes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_sink.layout import Chunk, Layout, MeshLayout, TensorLayout, layout_on_mesh, save_layout
from lightning_sink.layout.io import load_layout
from tests.dcp_runs import save_dcp_checkpoint

# Lightning-style keys; a 4x2 (data x tensor parallel) mesh: FSDP2+TP strided rows, column shards, uneven
# shards, a replicated vector, bf16, Adam moments and a replicated scalar step (plain tensor).
SPEC_4X2 = {
    "state_dict.fc1.weight": ((16, 6), "float32", ("_StridedShard(0,sf=2)", "Shard(0)")),
    "state_dict.fc1.bias": ((16,), "float32", ("Shard(0)", "Replicate()")),
    "state_dict.fc2.weight": ((5, 13), "float32", ("Shard(0)", "Shard(1)")),  # uneven on both dims
    "state_dict.norm.weight": ((7,), "bfloat16", ("Replicate()", "Replicate()")),
    "optimizer_0.state.fc2.weight.exp_avg": ((5, 13), "float32", ("Shard(0)", "Shard(1)")),
    "optimizer_0.state.fc2.weight.exp_avg_sq": ((5, 13), "float32", ("Shard(0)", "Shard(1)")),
    "optimizer_0.state.fc2.weight.step": ((), "float32", ("Replicate()", "Replicate()")),
}
PLAIN_4X2 = ("optimizer_0.state.fc2.weight.step",)

SPEC_3 = {
    "state_dict.w": ((10, 4), "float32", ("Shard(0)",)),
    "state_dict.v": ((4, 9), "float64", ("Shard(1)",)),
    "state_dict.b": ((2,), "float32", ("Shard(0)",)),  # fewer rows than ranks: rank 2 holds nothing
    "optimizer_0.state.w.exp_avg": ((10, 4), "float32", ("Shard(0)",)),
}


@pytest.fixture(scope="session")
def source_8(tmp_path_factory) -> Path:
    """8 ranks on a 4x2 mesh."""
    return save_dcp_checkpoint(
        tmp_path_factory.mktemp("src8") / "ckpt", SPEC_4X2, (4, 2), ("dp", "tp"), plain_names=PLAIN_4X2
    )


@pytest.fixture(scope="session")
def source_3(tmp_path_factory) -> Path:
    """3 ranks on a 1-D mesh, each rank writing two storage files (DCP's thread_count=2)."""
    return save_dcp_checkpoint(tmp_path_factory.mktemp("src3") / "ckpt", SPEC_3, (3,), ("dp",), seed=1, thread_count=2)


def rows(fqn, tensor):
    """Placement for ``layout_on_mesh``: tensors split by rows, scalars replicated."""
    return ["Shard(0)"] if tensor.global_shape else ["Replicate()"]


@pytest.fixture
def source(source_3: Path, tmp_path: Path) -> Path:
    """A private copy of the 3-rank checkpoint (``state_dict.v`` is [4, 9] float64, three column chunks), free to
    damage."""
    return Path(shutil.copytree(source_3, tmp_path / "src"))


@pytest.fixture
def two_ranks(source_3: Path):
    """Rows in two halves: each target rank reads 2 of the 4 rows of every ``state_dict.v`` chunk."""
    return layout_on_mesh(load_layout(source_3), MeshLayout.one_dimensional(2), rows)


@pytest.fixture
def tiny(tmp_path: Path) -> dict[str, Path]:
    """A one-rank checkpoint of plain rank files (one 8-element tensor) and a two-rank target layout file."""
    source = tmp_path / "src"
    (source / "rank_0").mkdir(parents=True)
    torch.save({"w": torch.arange(8.0)}, source / "rank_0" / "model.pt")
    tensor = TensorLayout(
        role="parameter",
        global_shape=(8,),
        dtype="float32",
        placements=("Replicate()",),
        chunks=(Chunk(0, (0,), (8,)),),
    )
    one = Layout(world_size=1, mesh=MeshLayout.one_dimensional(1), tensors={"w": tensor})
    save_layout(one, source / "layout.json")
    two = save_layout(layout_on_mesh(one, MeshLayout.one_dimensional(2), rows), tmp_path / "two.json")
    return {"src": source, "two": two}
