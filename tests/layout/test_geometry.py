"""Chunk geometry from placements, against tables torch documents and against slicing a real tensor."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from lightning_sink.layout import MeshLayout, chunks_for_placements, parse_placement, placement_to_str

MESH_2X2 = MeshLayout(shape=(2, 2), dim_names=("dp", "tp"), ranks=((0, 1), (2, 3)))


def rows(chunks):
    return {chunk.rank: (chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]) for chunk in chunks}


def test_strided_shard_matches_the_table_in_torchs_docstring():
    # _StridedShard docstring: [8, 8] on mesh [[0, 1], [2, 3]] with [_StridedShard(0, sf=2), Shard(0)]:
    # rank 0 rows 0-1, rank 1 rows 4-5, rank 2 rows 2-3, rank 3 rows 6-7.
    chunks = chunks_for_placements((8, 8), MESH_2X2, [_StridedShard(0, split_factor=2), Shard(0)])
    assert rows(chunks) == {0: (0, 2), 1: (4, 6), 2: (2, 4), 3: (6, 8)}


def test_left_to_right_shard_matches_the_same_docstring():
    chunks = chunks_for_placements((8, 8), MESH_2X2, [Shard(0), Shard(0)])
    assert rows(chunks) == {0: (0, 2), 1: (2, 4), 2: (4, 6), 3: (6, 8)}


@pytest.mark.parametrize("extent", [5, 7, 3, 1])
def test_uneven_shards_follow_torch_chunk(extent: int):
    mesh = MeshLayout.one_dimensional(4)
    chunks = chunks_for_placements((extent, 3), mesh, [Shard(0)])
    pieces = torch.arange(extent).chunk(4)  # the documented rule: torch.chunk, trailing ranks may be empty
    for rank, chunk in enumerate(chunks):
        expected = pieces[rank].tolist() if rank < len(pieces) else []
        assert list(range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])) == expected
        assert chunk.sizes[1] == 3


def test_replicate_gives_every_rank_the_whole_tensor_and_mixed_dims_tile():
    chunks = chunks_for_placements((4, 6), MESH_2X2, [Replicate(), Shard(1)])
    assert {(c.rank, c.offsets, c.sizes) for c in chunks} == {
        (0, (0, 0), (4, 3)),
        (1, (0, 3), (4, 3)),
        (2, (0, 0), (4, 3)),
        (3, (0, 3), (4, 3)),
    }


@pytest.mark.parametrize("placement", [Replicate(), Shard(1), _StridedShard(0, split_factor=4)])
def test_placement_strings_round_trip(placement):
    assert parse_placement(placement_to_str(placement)) == placement


def test_unknown_placement_strings_are_rejected():
    with pytest.raises(ValueError, match="unknown placement 'Shard\\(x\\)'"):
        parse_placement("Shard(x)")
