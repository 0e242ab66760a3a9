"""A stock Lightning ``ModelParallelStrategy`` sharded checkpoint (no layout file: the layout comes from DCP
metadata) resharded to 1 and 3 ranks, checked against DCP's own full load (``dcp_to_torch_save``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_sink.layout import MeshLayout, layout_from_dcp_metadata, layout_on_mesh
from lightning_sink.reshard import load_resharded_checkpoint, transform_checkpoints, unpickle_carried
from tests.distributed import run_launched
from tests.reshard.conftest import rows

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lightning_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning") / "model_parallel.ckpt"
    run_launched(ROOT / "tests" / "reshard" / "lightning_mp_run.py", out, cwd=out.parent, timeout=400)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 3])
def test_lightning_sharded_checkpoint_reshards_to_dcps_full_values(
    lightning_checkpoint: Path, tmp_path: Path, ranks: int
):
    assert (lightning_checkpoint / ".metadata").is_file() and not (lightning_checkpoint / "layout.json").exists()
    source_layout = layout_from_dcp_metadata(lightning_checkpoint)
    assert source_layout.world_size == 4
    assert {
        "state_dict.fc1.weight",
        "optimizer_0.state.fc1.weight.exp_avg_sq",
        "optimizer_0.state.fc2.bias.step",
    } <= set(source_layout.tensors)
    layout = layout_on_mesh(source_layout, MeshLayout.one_dimensional(ranks), rows)
    transform_checkpoints(lightning_checkpoint, tmp_path / "out", "ckpt_", None, layout)
    dcp_to_torch_save(lightning_checkpoint, tmp_path / "full.pt")  # DCP's own offline full load
    full, _ = flatten_state_dict(torch.load(tmp_path / "full.pt", weights_only=True))
    for rank in range(ranks):
        checkpoint = load_resharded_checkpoint(tmp_path / "out" / f"rank_{rank}" / f"ckpt_{rank}.pt")
        for fqn, shard in checkpoint["tensors"].items():
            (chunk,) = layout.tensors[fqn].chunks_of_rank(rank)
            expected = torch.as_tensor(full[fqn])[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            assert torch.equal(shard, expected), (rank, fqn)
        # Lightning's non-tensor checkpoint (epoch, loops, ...) rides along byte for byte.
        assert checkpoint["extra_files"]["meta.pt"] == (lightning_checkpoint / "meta.pt").read_bytes()
        carried = checkpoint["non_tensor_state"]
        assert unpickle_carried(carried["optimizer_0.param_groups.0.lr"]) == 0.01  # the run's Adam lr
        assert unpickle_carried(carried["optimizer_0.param_groups.0.betas"]) == (0.9, 0.999)
