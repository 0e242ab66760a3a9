"""Pure planning: for one target rank, which region of which stored source chunk fills which part of its shards.

Computed from two layouts alone (no files, no process group). The source layout here is a *storage* layout:
each chunk is listed under a rank whose file holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_sink.layout.schema import Chunk, Layout, TensorLayout

__all__ = [
    "Box",
    "CopyOp",
    "TargetShard",
    "Band",
    "bands_of",
    "band_box",
    "RankPlan",
    "plan_rank",
    "check_compatible",
    "intersect",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in global coordinates


@dataclass(frozen=True)
class CopyOp:
    """Copy ``region`` (global box) from the source chunk ``src_chunk`` stored by ``src_chunk.rank``."""

    src_chunk: Chunk
    region: Box


@dataclass(frozen=True)
class TargetShard:
    """One tensor's shard on the target rank and the copies that fill it."""

    fqn: str
    dtype: str
    chunk: Chunk
    copies: tuple[CopyOp, ...]

    @property
    def numel(self) -> int:
        return self.chunk.numel


@dataclass(frozen=True)
class Band:
    """Rows ``start..stop`` (dim 0, counted from the shard's first row) of a target shard and the copies that fill
    them; a scalar shard is one band of one "row"."""

    start: int
    stop: int
    copies: tuple[CopyOp, ...]


def bands_of(shard: TargetShard) -> list[Band]:
    """Cut a shard along dim 0 into bands that each contain whole copies (the rows whose copies overlap).

    A band is written as soon as it is filled, so the writer holds one band, not the shard; and a copy never
    spans two bands, so a source record read whole is still read whole (and CRC-checked) by one band.
    """
    if not shard.chunk.sizes:
        return [Band(0, 1, shard.copies)]
    origin = shard.chunk.offsets[0]
    bands: list[list] = []
    for copy in sorted(shard.copies, key=lambda c: c.region[0][0]):
        start = copy.region[0][0] - origin
        stop = start + copy.region[1][0]
        if bands and start < bands[-1][1]:
            bands[-1][1] = max(bands[-1][1], stop)
            bands[-1][2].append(copy)
        else:
            bands.append([start, stop, [copy]])
    return [Band(start, stop, tuple(copies)) for start, stop, copies in bands]


def band_box(shard: TargetShard, band: Band) -> Box:
    """The band's (global offsets, sizes): its rows of the shard, every other dim whole."""
    if not shard.chunk.sizes:
        return (), ()
    offsets, sizes = shard.chunk.offsets, shard.chunk.sizes
    return (offsets[0] + band.start, *offsets[1:]), (band.stop - band.start, *sizes[1:])


@dataclass(frozen=True)
class RankPlan:
    rank: int
    shards: tuple[TargetShard, ...]

    def source_ranks(self) -> list[int]:
        return sorted({copy.src_chunk.rank for shard in self.shards for copy in shard.copies})


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None; 0-d boxes (scalars) always overlap."""
    offsets, sizes = [], []
    for offset_a, size_a, offset_b, size_b in zip(a[0], a[1], b[0], b[1]):
        start, stop = max(offset_a, offset_b), min(offset_a + size_a, offset_b + size_b)
        if stop <= start:
            return None
        offsets.append(start)
        sizes.append(stop - start)
    return tuple(offsets), tuple(sizes)


def check_compatible(
    src: Layout, dst: Layout, src_name: str = "source layout", dst_name: str = "target layout"
) -> None:
    """Every target tensor must exist in the source with the same shape and dtype (source-only tensors, e.g.
    optimizer state for an inference target, are dropped)."""
    missing = sorted(set(dst.tensors) - set(src.tensors))
    if missing:
        raise ValueError(f"{dst_name} names tensor(s) the {src_name} does not have: {missing[:10]}")
    for fqn, target in dst.tensors.items():
        source = src.tensors[fqn]
        if not source.same_tensor_as(target):
            raise ValueError(
                f"tensor {fqn!r}: {src_name} has shape {list(source.global_shape)} {source.dtype}, {dst_name} has"
                f" shape {list(target.global_shape)} {target.dtype}"
            )


def _stored_boxes(tensor: TensorLayout, prefer_rank: int) -> list[Chunk]:
    """One holder per distinct stored box: the target's own rank if it holds it (same-numbered file), else the
    lowest rank — deterministic, so ``rank_list_for_transform`` and the conversion agree."""
    holders: dict[Box, Chunk] = {}
    for chunk in sorted(tensor.chunks, key=lambda c: (c.rank != prefer_rank, c.rank)):
        if chunk.numel > 0:
            holders.setdefault(chunk.box, chunk)
    return list(holders.values())


def plan_rank(rank: int, src: Layout, dst: Layout) -> RankPlan:
    """The copies that build target ``rank``'s shards of every tensor in ``dst``."""
    if not 0 <= rank < dst.world_size:
        raise ValueError(f"rank_id {rank} is outside the target world size {dst.world_size} (0..{dst.world_size - 1})")
    check_compatible(src, dst)
    shards = []
    for fqn, target in sorted(dst.tensors.items()):
        mine = target.chunks_of_rank(rank)
        if not mine:
            continue
        if len(mine) > 1:
            raise ValueError(f"target layout: tensor {fqn!r} gives rank {rank} {len(mine)} chunks; one is supported")
        (chunk,) = mine
        copies = []
        if chunk.numel > 0:
            for stored in _stored_boxes(src.tensors[fqn], prefer_rank=rank):
                region = intersect(chunk.box, stored.box)
                if region is not None:
                    copies.append(CopyOp(stored, region))
            covered = sum(math.prod(copy.region[1]) for copy in copies)
            if covered != chunk.numel:  # the source layout was validated to tile, so this is a broken source
                raise ValueError(
                    f"tensor {fqn!r}: source chunks cover {covered} of the {chunk.numel} elements rank {rank} needs"
                )
        shards.append(TargetShard(fqn, target.dtype, chunk, tuple(copies)))
    return RankPlan(rank, tuple(shards))
