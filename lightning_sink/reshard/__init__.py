"""Offline resharding of distributed checkpoints (MindSpore's ``transform_checkpoints`` family) on DCP."""

from lightning_sink.checkpoint_format.live_state import load_into_state_dict, to_dtensors
from lightning_sink.checkpoint_format.rank_file import load_resharded_checkpoint, unpickle_carried
from lightning_sink.checkpoint_format.resharded_folder import verify_checkpoint
from lightning_sink.layout.merge import merge_pipeline_strategies
from lightning_sink.reshard.transform import ReshardReport, transform_checkpoints
from lightning_sink.reshard.transform_by_rank import rank_list_for_transform, transform_checkpoint_by_rank

__all__ = [
    "ReshardReport",
    "load_into_state_dict",
    "load_resharded_checkpoint",
    "merge_pipeline_strategies",
    "rank_list_for_transform",
    "to_dtensors",
    "transform_checkpoint_by_rank",
    "transform_checkpoints",
    "unpickle_carried",
    "verify_checkpoint",
]
