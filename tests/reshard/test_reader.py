"""Exact reads from torch.save'd tensors: row-major, non-row-major (a saved transpose) and 0-d, checked against
slicing the tensors in memory; bytes read against bytes needed."""

from __future__ import annotations

from pathlib import Path

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
    torch.save(full, source / "rank_0" / "checkpoint_0.pt")  # one rank holding everything (the seed's layout)
    tensors = {name: TensorLayout(role="parameter", global_shape=tuple(v.shape), dtype=str(v.dtype).removeprefix("torch."),
                                  placements=("Replicate()",), chunks=(Chunk(0, (0,) * v.dim(), tuple(v.shape)),))
               for name, v in full.items()}
    one = Layout(world_size=1, mesh=MeshLayout.one_dimensional(1), tensors=tensors)
    save_layout(one, source / "layout.json")
    three = layout_on_mesh(one, MeshLayout.one_dimensional(3), lambda f, t: ["Shard(1)"] if t.global_shape else ["Replicate()"])
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
