"""MindSpore's by-rank transformation API: which source ranks' files a target rank needs, and that one rank's file
built from those files alone, written atomically beside a ``.sha256`` sidecar (no folder, no manifest).
"""

from __future__ import annotations

import os
import time
import uuid
import zipfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from lightning_sink.checkpoint_format.destination import write_errors_in_words
from lightning_sink.checkpoint_format.fs import fsync_dir, write_new_file
from lightning_sink.checkpoint_format.rank_file import (
    RANK_FILE_FORMAT,
    rank_file_name,
    read_rank_file_header,
    sidecar_path,
)
from lightning_sink.layout.dcp_metadata import DCP_METADATA_FILE
from lightning_sink.layout.io import load_layout
from lightning_sink.reshard.integrity import RecordChecks
from lightning_sink.reshard.layout_args import LayoutArg, source_layout_path, target_layout
from lightning_sink.reshard.open_source import open_source, source_from_files
from lightning_sink.reshard.plan import plan_rank
from lightning_sink.reshard.rank_conversion import (
    RankFileSpec,
    RankResult,
    check_room,
    convert_rank,
    peak_rss_bytes,
    provenance_of,
)
from lightning_sink.reshard.reader import ReadStats
from lightning_sink.reshard.source import Source

__all__ = ["rank_list_for_transform", "transform_checkpoint_by_rank"]


def rank_list_for_transform(
    rank_id: int, src_strategy_file: str | os.PathLike, dst_strategy_file: LayoutArg
) -> list[int]:
    """The source ranks whose files target ``rank_id`` needs, from the layouts alone.

    ``src_strategy_file`` may also be a DCP checkpoint folder: its stored chunks then say which rank holds what
    (DCP stores a replicated chunk once, so only that folder knows which replica's file has it).
    """
    source_path = Path(src_strategy_file)
    target = target_layout(dst_strategy_file, "dst_strategy_file")
    if (source_path.is_dir() and (source_path / DCP_METADATA_FILE).is_file()) or zipfile.is_zipfile(source_path):
        src = open_source(source_path, None, roles=target).layout  # a DCP folder or a one-device checkpoint
    else:
        src = load_layout(source_path)
    return plan_rank(rank_id, src, target).source_ranks()


def transform_checkpoint_by_rank(
    rank_id: int,
    checkpoint_files_map: Mapping[int, str | os.PathLike],
    save_checkpoint_file_name: str | os.PathLike,
    src_strategy_file: str | os.PathLike | None,
    dst_strategy_file: LayoutArg,
    *,
    overwrite: bool = False,
) -> RankResult:
    """Build target ``rank_id``'s file from the source files it needs ({source rank: file}; DCP ``.distcp``
    files of one folder, or rank files). Writes ``save_checkpoint_file_name`` atomically plus a ``.sha256``
    sidecar that ``load_resharded_checkpoint`` checks; an existing file there is replaced only when it is a rank
    file of this package (with ``overwrite``, or when it holds this same rank of this same conversion)."""
    started = time.perf_counter()
    files = list(checkpoint_files_map.values())
    roles = target_layout(dst_strategy_file, "dst_strategy_file") if len(files) == 1 else None  # a .ckpt's buffers
    source = source_from_files(checkpoint_files_map, source_layout_path(src_strategy_file), roles=roles)
    target = roles or target_layout(dst_strategy_file, "dst_strategy_file")
    plan = plan_rank(rank_id, source.layout, target)
    missing = [rank for rank in plan.source_ranks() if rank not in {int(r) for r in checkpoint_files_map}]
    if missing:
        raise ValueError(
            f"checkpoint_files_map lacks source rank(s) {missing} that target rank {rank_id} needs"
            f" (see rank_list_for_transform)"
        )
    source.check_files(plan.source_ranks())
    out = Path(save_checkpoint_file_name)
    _check_output_name(out, rank_id, source)
    provenance = provenance_of(source, target, "")
    if os.path.lexists(out):
        _check_rank_file_replaceable(out, rank_id, provenance, overwrite)
    with write_errors_in_words(out.parent):
        out.parent.mkdir(parents=True, exist_ok=True)
    check_room([plan], target, out)
    digest, size, stats = _write_with_sidecar(RankFileSpec(plan, target, out, provenance), source)
    peak = peak_rss_bytes()
    return RankResult(rank_id, out.name, digest, size, stats, peak, time.perf_counter() - started)


def _check_output_name(out: Path, rank_id: int, source: Source) -> None:
    """``save_checkpoint_file_name`` must name a file to write: not a folder, a symbolic link or a source file."""
    if out.is_dir() or not out.name:
        raise ValueError(
            f"save_checkpoint_file_name={str(out)!r} is a folder: name the rank file to write (e.g."
            f" {str(out / rank_file_name(rank_id, 'checkpoint_'))!r})"
        )
    if out.is_symlink():
        raise ValueError(f"save_checkpoint_file_name={str(out)!r} is a symbolic link; name the file itself")
    if any(out.resolve() == path.resolve() for path in source.files.values()):
        raise ValueError(f"save_checkpoint_file_name={str(out)!r} is a file of the source")


def _write_with_sidecar(spec: RankFileSpec, source: Source) -> tuple[str, int, ReadStats]:
    """The rank file at ``spec.path`` and its ``.sha256`` sidecar, each written to a temporary name beside it
    and renamed into place once whole."""
    out = spec.path
    temp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    sidecar = sidecar_path(out)
    temp_sidecar = sidecar.with_name(f".{sidecar.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        checks = RecordChecks(source.verified_files)
        digest, size, stats = convert_rank(replace(spec, path=temp), source, checks)
        stats.verify_bytes_read += source.verify_bytes_read
        checks.finish(stats)  # this rank's parts of records: the rest of each is read for checking only
        with write_errors_in_words(temp_sidecar):
            write_new_file(temp_sidecar, f"{digest} {size}\n".encode())
        with write_errors_in_words(out):
            os.replace(temp, out)  # a kill between the two replaces leaves a digest mismatch that loaders report
            os.replace(temp_sidecar, sidecar)
            fsync_dir(out.parent)
    finally:
        temp.unlink(missing_ok=True)
        temp_sidecar.unlink(missing_ok=True)
    return digest, size, stats


def _check_rank_file_replaceable(out: Path, rank_id: int, provenance: dict, overwrite: bool) -> None:
    """An existing ``out`` is replaced only when it is a rank file of this package: this same rank of this same
    conversion, or with ``overwrite`` any rank file; never another kind of file."""
    name = f"save_checkpoint_file_name={str(out)!r}"
    try:
        header = read_rank_file_header(out)
    except ValueError:
        header = {}
    if header.get("format") != RANK_FILE_FORMAT:
        raise ValueError(f"{name} exists and is not a lightning-sink rank file; it is never replaced: name a new file")
    previous = header.get("provenance") or {}
    same = header.get("rank") == rank_id and all(
        previous.get(k) == provenance[k] for k in ("source_fingerprint", "target_layout_sha256")
    )
    if not (same or overwrite):
        raise ValueError(
            f"{name} already holds a different checkpoint; pass overwrite=True (--overwrite on the command line)"
        )
