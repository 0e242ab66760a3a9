"""MindSpore's checkpoint transformation API on DCP checkpoints: any M ranks and layout to any N, offline.

Each target rank's file is built from exact byte ranges of the source chunks it overlaps; ranks are independent
(``workers`` processes convert one target rank each). The whole output is written into a staging folder beside
the destination, with a manifest of SHA-256 digests written last, then renamed into place.

This module converts a whole checkpoint; one target rank's file is built in ``rank_conversion.py``, and the by-rank
API lives in ``transform_by_rank.py``. What the destination may be, its lock, its staging folder and write failures
in words live in ``checkpoint_format/destination.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sink.checkpoint_format.destination import (
    check_destination_path,
    check_replaceable,
    exclusive,
    staged_folder,
    write_errors_in_words,
)
from lightning_sink.checkpoint_format.fs import check_file_prefix, fsync_dir, sha256_of_file
from lightning_sink.checkpoint_format.manifest import Manifest, read_manifest, write_manifest
from lightning_sink.layout.io import save_layout
from lightning_sink.layout.schema import LAYOUT_FILE_NAME
from lightning_sink.reshard.integrity import RecordChecks
from lightning_sink.reshard.layout_args import LayoutArg, source_layout_path, target_layout
from lightning_sink.reshard.open_source import open_source
from lightning_sink.reshard.plan import RankPlan, plan_rank
from lightning_sink.reshard.rank_conversion import (
    Conversion,
    RankResult,
    check_room,
    convert_one_rank,
    provenance_of,
    shard_bytes,
)
from lightning_sink.reshard.reader import ReadStats
from lightning_sink.reshard.source import Source
from lightning_sink.reshard.workers import run_in_workers, worker_count

__all__ = ["ReshardReport", "transform_checkpoints"]


@dataclass
class ReshardReport:
    destination: Path
    ranks: list[RankResult] = field(default_factory=list)
    checks: ReadStats = field(default_factory=ReadStats)  # integrity checks done once for all ranks

    @property
    def stats(self) -> ReadStats:
        total = ReadStats()
        total.add(self.checks)
        for result in self.ranks:
            total.add(result.stats)
        return total


@dataclass(frozen=True)
class _RunOptions:
    """How the target ranks are run: in this process (``workers`` None) or in worker processes, as many as
    ``memory_budget_bytes`` allows; and who hears of the progress."""

    workers: int | None
    memory_budget_bytes: int | None
    progress: Callable[[int, int], None] | None


def transform_checkpoints(
    src_checkpoints_dir: str | os.PathLike,
    dst_checkpoints_dir: str | os.PathLike,
    ckpt_prefix: str,
    src_strategy_file: str | os.PathLike | None,
    dst_strategy_file: LayoutArg,
    *,
    workers: int | None = None,
    overwrite: bool = False,
    memory_budget_bytes: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReshardReport:
    """Convert a whole checkpoint to one file per target rank: ``dst/rank_{r}/{ckpt_prefix}{r}.pt``.

    Args:
        src_checkpoints_dir: a DCP folder (this package's, or a Lightning ModelParallelStrategy/FSDPStrategy
            sharded checkpoint), a folder of ``rank_{x}/`` subfolders holding one checkpoint file each, or a
            one-device checkpoint file (a Lightning ``.ckpt``, or a plain ``torch.save`` state dict).
        dst_checkpoints_dir: the output folder, replaced as a whole: a new or empty folder, or a previous output
            of this package (never the working, home or root folder, nor one holding the source; see
            ``checkpoint_format/destination.py``).
        src_strategy_file: the source layout; None: the folder's ``layout.json``, else derived from DCP metadata.
        dst_strategy_file: the target layout (file or :class:`Layout`).
        workers: None converts in this process; k converts in k spawned processes, one target rank each.
        overwrite: replace a previous output of this package that holds a different conversion.
        memory_budget_bytes: caps the worker count at budget // (the writer's two windows of about the largest
            band of rows + read buffer + an idle worker's ~600 MiB); see ``worker_count``.
        progress: called with (target bytes done, target bytes in all) as shards fill (in process) or as
            target ranks finish (workers).
    """
    check_file_prefix(ckpt_prefix, "ckpt_prefix")
    src_dir = Path(src_checkpoints_dir).resolve()
    dst = check_destination_path(dst_checkpoints_dir, {"src_checkpoints_dir": src_dir}, "dst_checkpoints_dir")
    run = _run_options(workers, memory_budget_bytes, progress)
    roles = target_layout(dst_strategy_file, "dst_strategy_file") if src_dir.is_file() else None  # a .ckpt's buffers
    source = open_source(src_dir, source_layout_path(src_strategy_file), roles=roles)
    target = roles or target_layout(dst_strategy_file, "dst_strategy_file")
    plans = [plan_rank(rank, source.layout, target) for rank in range(target.world_size)]  # all errors before writing
    source.check_files(sorted({r for plan in plans for r in plan.source_ranks()}))
    provenance = provenance_of(source, target, ckpt_prefix)
    with write_errors_in_words(dst.parent):
        dst.parent.mkdir(parents=True, exist_ok=True)
    check_room(plans, target, dst)
    with exclusive(dst, "dst_checkpoints_dir"):
        _check_destination_holds(dst, provenance, overwrite)
        with staged_folder(dst) as staging:
            conversion = Conversion(
                src_dir,
                source_layout_path(src_strategy_file),
                target,
                ckpt_prefix,
                staging,
                frozenset(source.verified_files),
            )
            return _convert_all(dst, conversion, source, plans, provenance, run)


def _run_options(
    workers: int | None, memory_budget_bytes: int | None, progress: Callable[[int, int], None] | None
) -> _RunOptions:
    """The keyword arguments that say how to run, refused unless ``workers`` and the budget are positive integers."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers={workers!r} must be None or a positive integer")
    if memory_budget_bytes is not None and (
        isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, int) or memory_budget_bytes < 1
    ):
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes!r} must be None or a positive number of bytes")
    return _RunOptions(workers, memory_budget_bytes, progress)


def _check_destination_holds(dst: Path, provenance: dict, overwrite: bool) -> None:
    """A destination holding a previous output of a different conversion is replaced only with ``overwrite``; one
    holding anything else never (``check_replaceable``)."""
    if not check_replaceable(dst, "dst_checkpoints_dir") or overwrite:
        return
    previous = read_manifest(dst).provenance
    if any(previous.get(k) != provenance[k] for k in ("source_fingerprint", "target_layout_sha256", "ckpt_prefix")):
        raise ValueError(
            f"dst_checkpoints_dir={str(dst)!r} already holds a different checkpoint; pass overwrite=True"
            " (--overwrite on the command line) to replace it, or choose an empty folder"
        )


def _convert_all(
    dst: Path,
    conversion: Conversion,
    source: Source,
    plans: list[RankPlan],
    provenance: dict[str, Any],
    run: _RunOptions,
) -> ReshardReport:
    """Every target rank into the staging folder, then the layout and the manifest (last)."""
    report = ReshardReport(dst)
    report.checks.verify_bytes_read += source.verify_bytes_read
    checks = RecordChecks(set(conversion.verified_files))
    report.ranks.extend(_convert_ranks(conversion, source, plans, checks, run))
    checks.finish(report.checks)  # every record read in parts, before anything is committed
    report.ranks.sort(key=lambda r: r.rank)
    _write_layout_and_manifest(conversion, report.ranks, provenance)
    return report


def _convert_ranks(
    conversion: Conversion, source: Source, plans: list[RankPlan], checks: RecordChecks, run: _RunOptions
) -> list[RankResult]:
    """Every target rank's file into the staging folder, in this process or in workers; the parts of records read
    in part are gathered in ``checks``."""
    total, done = sum(shard_bytes(plan) for plan in plans), 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        if run.progress is not None:
            run.progress(done, total)

    if run.workers is None:
        return [convert_one_rank(conversion, source, plan, checks, advance) for plan in plans]
    results = []
    tasks = [{"conversion": conversion.to_json(), "rank": plan.rank} for plan in plans]
    for reply in run_in_workers(tasks, worker_count(plans, run.workers, run.memory_budget_bytes)):
        checks.merge(RecordChecks.from_json(reply["checks"]))
        result = RankResult.from_json(reply)
        advance(shard_bytes(plans[result.rank]))
        results.append(result)
    return results


def _write_layout_and_manifest(conversion: Conversion, ranks: list[RankResult], provenance: dict[str, Any]) -> None:
    """The target layout and the manifest of every file's digest, written last into the staging folder."""
    staging = conversion.staging
    with write_errors_in_words(staging):
        save_layout(conversion.target, staging / LAYOUT_FILE_NAME)
        files = {r.relative_path: {"sha256": r.sha256, "bytes": r.bytes_written} for r in ranks}
        files[LAYOUT_FILE_NAME] = {
            "sha256": sha256_of_file(staging / LAYOUT_FILE_NAME),
            "bytes": (staging / LAYOUT_FILE_NAME).stat().st_size,
        }
        write_manifest(staging, Manifest(files=files, provenance=provenance))
        fsync_dir(staging)
