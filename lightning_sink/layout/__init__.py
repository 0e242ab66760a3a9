"""Layout (strategy) files: which chunk of which tensor each rank of a distributed checkpoint holds."""

from lightning_sink.layout.build import layout_on_mesh
from lightning_sink.layout.dcp_metadata import layout_from_dcp_metadata, read_dcp_metadata
from lightning_sink.layout.from_state_dict import flatten_like_dcp, layout_from_state_dict
from lightning_sink.layout.geometry import chunks_for_placements, parse_placement, placement_to_str
from lightning_sink.layout.io import load_layout, save_layout
from lightning_sink.layout.merge import merge_pipeline_strategies
from lightning_sink.layout.schema import (
    LAYOUT_FILE_NAME,
    LAYOUT_FORMAT,
    LAYOUT_VERSION,
    Chunk,
    Layout,
    MeshLayout,
    PipelineLayout,
    TensorLayout,
)
from lightning_sink.layout.validation import torch_dtype, validate_layout

__all__ = [
    "LAYOUT_FILE_NAME",
    "LAYOUT_FORMAT",
    "LAYOUT_VERSION",
    "Chunk",
    "Layout",
    "MeshLayout",
    "PipelineLayout",
    "TensorLayout",
    "chunks_for_placements",
    "flatten_like_dcp",
    "layout_from_dcp_metadata",
    "layout_from_state_dict",
    "layout_on_mesh",
    "load_layout",
    "merge_pipeline_strategies",
    "parse_placement",
    "placement_to_str",
    "read_dcp_metadata",
    "save_layout",
    "torch_dtype",
    "validate_layout",
]
