"""The source of a conversion, from what the user names: a folder, a one-device file, or a map of rank files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from lightning_sink.checkpoint_format.rank_file import rank_dir_name
from lightning_sink.layout.dcp_metadata import DCP_METADATA_FILE
from lightning_sink.layout.schema import Layout
from lightning_sink.reshard.dcp_source import DcpSource
from lightning_sink.reshard.one_device import OneDeviceSource, is_lightning_file
from lightning_sink.reshard.rank_files_source import RankFilesSource, rank_files_in
from lightning_sink.reshard.source import Source, own_layout_file

__all__ = ["open_source", "source_from_files", "source_files_for_ranks"]


def open_source(
    src_checkpoints_dir: str | os.PathLike, src_strategy_file: str | os.PathLike | None, roles: Layout | None = None
) -> Source:
    """A DCP folder (``.metadata`` inside), a folder of ``rank_{x}/`` subfolders, or a one-device checkpoint file
    (``roles``: a layout whose roles tell a Lightning checkpoint's buffers from its parameters, see one_device.py)."""
    folder = Path(src_checkpoints_dir)
    layout_file = Path(src_strategy_file) if src_strategy_file is not None else None
    if folder.is_file():
        return OneDeviceSource(folder, layout_file, roles)
    if not folder.is_dir():
        raise FileNotFoundError(f"src_checkpoints_dir={str(folder)!r} is not a folder (nor a checkpoint file)")
    if (folder / DCP_METADATA_FILE).is_file():
        return DcpSource(folder, layout_file)
    files = rank_files_in(folder)
    if not files:
        raise ValueError(
            f"src_checkpoints_dir={str(folder)!r} is neither a DCP checkpoint (no .metadata) nor a folder of rank_<x>/"
            " checkpoint folders"
        )
    if layout_file is None:
        layout_file = own_layout_file(folder)
    source = RankFilesSource(files, layout_file, f"rank-file checkpoint {str(folder)!r}")
    expected = set(range(source.layout.world_size))
    if set(files) - expected:
        raise ValueError(
            f"{source.description}: rank folders {sorted(set(files) - expected)} are outside the layout's world size {source.layout.world_size}"
        )
    for rank in sorted(expected - set(files)):
        files[rank] = folder / rank_dir_name(rank) / "<missing>"
    return source


def source_files_for_ranks(src_checkpoints_dir: str | os.PathLike, ranks: list[int]) -> dict[int, Path]:
    """The {source rank: file} map ``transform_checkpoint_by_rank`` takes, for the source ranks ``ranks`` of what
    ``open_source`` accepts: {0: the file} of a one-device checkpoint, the ranks' first ``.distcp`` files of a DCP
    folder, or their rank files (linked rank folders and files refused, as ``open_source`` refuses them)."""
    folder = Path(src_checkpoints_dir)
    if folder.is_file():
        return {0: folder}
    if (folder / DCP_METADATA_FILE).is_file():
        return {rank: folder / f"__{rank}_0.distcp" for rank in ranks}
    files = rank_files_in(folder) if folder.is_dir() else {}
    return {rank: files.get(rank, folder / rank_dir_name(rank) / "<missing>") for rank in ranks}


def source_from_files(
    checkpoint_files_map: Mapping[int, str | os.PathLike], src_strategy_file, roles: Layout | None = None
) -> Source:
    """``transform_checkpoint_by_rank``'s map {source rank: file}: DCP ``.distcp`` files of one folder, rank files,
    or {0: a one-device Lightning checkpoint file}."""
    files = {int(rank): Path(path) for rank, path in checkpoint_files_map.items()}
    if not files:
        raise ValueError("checkpoint_files_map is empty: map each needed source rank to its file")
    if list(files) == [0] and files[0].is_file() and is_lightning_file(files[0]):
        return OneDeviceSource(files[0], Path(src_strategy_file) if src_strategy_file is not None else None, roles)
    if all(path.suffix == ".distcp" for path in files.values()):
        folders = {path.parent for path in files.values()}
        if len(folders) != 1:
            raise ValueError(
                f"checkpoint_files_map: DCP files must come from one checkpoint folder, got {sorted(map(str, folders))}"
            )
        layout_file = Path(src_strategy_file) if src_strategy_file is not None else None
        return DcpSource(folders.pop(), layout_file, allowed=files)
    return RankFilesSource(
        files, Path(src_strategy_file) if src_strategy_file is not None else None, "checkpoint_files_map"
    )
