"""Checks that a layout is self-consistent: every error names the file (``source``) and the tensor."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lightning_sink.counts import is_int
from lightning_sink.layout.geometry import parse_placement
from lightning_sink.layout.schema import TENSOR_ROLES, Chunk, Layout, MeshLayout, TensorLayout
from lightning_sink.layout.tiling import MAX_INNER_DIMS, tiling_fault

__all__ = [
    "MAX_DIMS",
    "MAX_INNER_DIMS",
    "MAX_PIPELINE_STAGES",
    "MAX_TENSOR_BYTES",
    "MAX_WORLD_SIZE",
    "validate_layout",
    "torch_dtype",
]

MAX_DIMS = 64  # torch's own limit on a tensor's dims
MAX_WORLD_SIZE = 2**24  # far beyond any job; bounds the per-rank loops a per-stage layout's stage count could inflate
# Far beyond any pipeline (a stage holds at least one layer); a per-stage layout's world is its mesh times this, so
# an unbounded count would let a file of a few bytes claim millions of ranks.
MAX_PIPELINE_STAGES = 1024
MAX_TENSOR_BYTES = 2**63 - 1  # a tensor's byte size is an int64 in torch


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; ValueError for anything that is not a torch dtype name."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected a torch dtype name such as 'float32')")
    return dtype


def validate_layout(layout: Layout, source: str = "layout") -> Layout:
    """Raise ValueError naming ``source`` and the offending tensor when ``layout`` is inconsistent."""
    if not is_int(layout.world_size) or layout.world_size < 1:
        raise ValueError(f"{source}: world_size must be a positive integer, got {layout.world_size!r}")
    _validate_mesh(layout.mesh, layout.world_size, source)
    pipeline = layout.pipeline
    if not is_int(pipeline.num_stages) or pipeline.num_stages < 1:
        raise ValueError(f"{source}: pipeline.num_stages must be a positive integer, got {pipeline.num_stages!r}")
    _validate_world_size(layout, source)
    if pipeline.num_stages > MAX_PIPELINE_STAGES:
        raise ValueError(
            f"{source}: pipeline.num_stages must be an integer from 1 to {MAX_PIPELINE_STAGES},"
            f" got {pipeline.num_stages!r}"
        )
    if pipeline.stage is not None and not (is_int(pipeline.stage) and 0 <= pipeline.stage < pipeline.num_stages):
        raise ValueError(f"{source}: pipeline.stage {pipeline.stage!r} is outside 0..{pipeline.num_stages - 1}")
    for fqn, tensor in layout.tensors.items():
        _validate_tensor(fqn, tensor, layout, f"{source}: tensor {fqn!r}")
    for fqn, how in layout.non_tensor_state.items():
        if not isinstance(fqn, str) or not isinstance(how, str):
            raise ValueError(f"{source}: non_tensor_state entries must map a name to a string, got {fqn!r}: {how!r}")
    return layout


def _validate_world_size(layout: Layout, source: str) -> None:
    """The world is the mesh's ranks: the mesh itself, or, in the layout of one pipeline stage, one mesh of that
    size per stage. (A world size the mesh does not account for would make every rank loop run that long.)"""
    mesh_size = len(layout.mesh.flat_ranks())
    stages = layout.pipeline.num_stages if layout.pipeline.stage is not None else 1
    allowed = sorted({mesh_size, mesh_size * stages})
    if layout.world_size not in allowed:
        raise ValueError(
            f"{source}: world_size {layout.world_size} does not match the mesh of {mesh_size} ranks"
            f" (expected {' or '.join(map(str, allowed))}"
            f"{' for ' + str(stages) + ' pipeline stages' if stages > 1 else ''})"
        )
    if layout.world_size > MAX_WORLD_SIZE:
        raise ValueError(f"{source}: world_size {layout.world_size} is beyond {MAX_WORLD_SIZE} ranks (one file each)")


def _validate_mesh(mesh: MeshLayout, world_size: int, source: str) -> None:
    if not mesh.shape or not all(is_int(size) and size >= 1 for size in mesh.shape):
        raise ValueError(
            f"{source}: mesh.shape must be a non-empty list of positive integers, got {list(mesh.shape)[:8]}"
        )
    if math.prod(mesh.shape) > world_size:
        raise ValueError(f"{source}: mesh.shape {list(mesh.shape)} holds more ranks than the world size {world_size}")
    if len(mesh.dim_names) != len(mesh.shape):
        raise ValueError(
            f"{source}: mesh.dim_names {list(mesh.dim_names)} must name each of the {len(mesh.shape)} mesh dims"
        )
    if _nested_shape(mesh.ranks) != tuple(mesh.shape):
        raise ValueError(f"{source}: mesh.ranks is not nested as mesh.shape {list(mesh.shape)}")
    ranks = mesh.flat_ranks()
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{source}: mesh.ranks lists a rank twice: {ranks}")
    for rank in ranks:
        if not is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(
                f"{source}: mesh rank {rank!r} is outside the world size {world_size} (0..{world_size - 1})"
            )


def _nested_shape(node: object) -> tuple[int, ...]:
    if not isinstance(node, (list, tuple)):
        return ()
    inner = {_nested_shape(item) for item in node}
    if len(inner) > 1:
        return (-1,)
    return (len(node), *(inner.pop() if inner else ()))


def _validate_tensor(fqn: str, tensor: TensorLayout, layout: Layout, where: str) -> None:
    if tensor.role not in TENSOR_ROLES:
        raise ValueError(f"{where}: role {tensor.role!r} is not one of {list(TENSOR_ROLES)}")
    try:
        torch_dtype(tensor.dtype)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    shape = tensor.global_shape
    if not all(is_int(size) and size >= 0 for size in shape):
        raise ValueError(f"{where}: global_shape must be non-negative integers, got {list(shape)[:8]}")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"{where}: global_shape has {len(shape)} dims; at most {MAX_DIMS} are supported")
    nbytes = math.prod(shape) * torch_dtype(tensor.dtype).itemsize
    if nbytes > MAX_TENSOR_BYTES:
        raise ValueError(
            f"{where}: global_shape {list(shape)} is {nbytes} bytes of {tensor.dtype}, beyond any"
            f" tensor torch can hold ({MAX_TENSOR_BYTES} bytes)"
        )
    if tensor.placements is not None:
        if len(tensor.placements) != len(layout.mesh.shape):
            raise ValueError(
                f"{where}: {len(tensor.placements)} placements {list(tensor.placements)} for a"
                f" {len(layout.mesh.shape)}-D mesh (one per mesh dim expected)"
            )
        for text in tensor.placements:
            try:
                placement = parse_placement(text)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            dim = getattr(placement, "dim", None)
            if dim is not None and not 0 <= dim < max(len(shape), 1):
                raise ValueError(f"{where}: placement {text} shards dim {dim} of a {len(shape)}-D tensor")
    if not is_int(tensor.stage) or not 0 <= tensor.stage < layout.pipeline.num_stages:
        raise ValueError(f"{where}: stage {tensor.stage!r} is outside 0..{layout.pipeline.num_stages - 1}")
    for chunk in tensor.chunks:
        _validate_chunk(chunk, shape, layout.world_size, where)
    _validate_tiling(tensor.chunks, shape, where)


def _validate_chunk(chunk: Chunk, shape: tuple[int, ...], world_size: int, where: str) -> None:
    if not is_int(chunk.rank) or not 0 <= chunk.rank < world_size:
        raise ValueError(f"{where}: chunk rank {chunk.rank!r} is outside the world size {world_size}")
    if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
        raise ValueError(
            f"{where}: chunk of rank {chunk.rank} has offsets {list(chunk.offsets)} / sizes {list(chunk.sizes)}"
            f" for a {len(shape)}-D tensor of shape {list(shape)}"
        )
    for offset, size, extent in zip(chunk.offsets, chunk.sizes, shape):
        if not (is_int(offset) and is_int(size)) or offset < 0 or size < 0 or offset + size > extent:
            raise ValueError(
                f"{where}: chunk of rank {chunk.rank} (offsets {list(chunk.offsets)}, sizes {list(chunk.sizes)})"
                f" is out of bounds of shape {list(shape)}"
            )


def _validate_tiling(chunks: Iterable[Chunk], shape: tuple[int, ...], where: str) -> None:
    """Distinct non-empty boxes must cover each element once; identical boxes are replicas."""
    boxes = sorted({chunk.box for chunk in chunks if chunk.numel > 0})
    fault = tiling_fault(boxes, shape)
    if fault is None:
        return
    if fault.too_complex is not None:
        offsets, sizes = fault.too_complex
        raise ValueError(
            f"{where}: chunk at offsets {list(offsets)} sizes {list(sizes)} ends inside shape {list(shape)} in more"
            f" than {MAX_INNER_DIMS} dims; at most {MAX_INNER_DIMS} are supported"
        )
    covered, total = sum(math.prod(sizes) for _, sizes in boxes), math.prod(shape)
    if fault.coverage > 1:
        (offsets_a, sizes_a), (offsets_b, sizes_b) = fault.boxes
        raise ValueError(
            f"{where}: chunks overlap at element {list(fault.point)}: offsets {list(offsets_a)} sizes"
            f" {list(sizes_a)} and offsets {list(offsets_b)} sizes {list(sizes_b)}"
        )
    if covered >= total:  # the sizes add up, so some other element is covered twice
        raise ValueError(
            f"{where}: chunks overlap: they hold {covered} elements of shape {list(shape)}'s {total}"
            f" but leave element {list(fault.point)} uncovered"
        )
    raise ValueError(
        f"{where}: chunks cover {covered} of {total} elements of shape {list(shape)}: they leave a gap"
        f" at element {list(fault.point)}"
    )
