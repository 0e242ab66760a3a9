"""MindSpore's checkpoint transformation API on DCP checkpoints: any M ranks and layout to any N, offline.

Each target rank's file is built from exact byte ranges of the source chunks it overlaps; ranks are independent
(``workers`` processes convert one target rank each). The whole output is written into a staging folder beside
the destination, with a manifest of SHA-256 digests written last, then renamed into place.

One ``Conversion`` describes a whole conversion; ``convert_one_rank`` converts one target rank of it, the same
function in this process and in a worker (which receives the description as JSON). What the destination may be,
its lock, its staging folder and write failures in words live in ``checkpoint_format/destination.py``.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import time
import uuid
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_sink.checkpoint_format.destination import (
    check_destination_path,
    check_replaceable,
    exclusive,
    staged_folder,
    write_errors_in_words,
)
from lightning_sink.checkpoint_format.fs import (
    check_file_prefix,
    check_room_for,
    fsync_dir,
    sha256_of_file,
    write_new_file,
)
from lightning_sink.checkpoint_format.manifest import Manifest, read_manifest, write_manifest
from lightning_sink.checkpoint_format.rank_file import (
    RANK_FILE_FORMAT,
    RANK_FILE_VERSION,
    check_loaded_rank_file,
    rank_file_name,
    read_rank_file_header,
    sidecar_path,
)
from lightning_sink.layout.dcp_metadata import DCP_METADATA_FILE
from lightning_sink.layout.io import load_layout, save_layout
from lightning_sink.layout.schema import LAYOUT_FILE_NAME, Layout
from lightning_sink.layout.validation import torch_dtype
from lightning_sink.reshard.integrity import RecordChecks
from lightning_sink.reshard.open_source import open_source, source_from_files
from lightning_sink.reshard.plan import RankPlan, band_box, bands_of, plan_rank
from lightning_sink.reshard.reader import READ_BUFFER_BYTES, FileCache, ReadStats, copy_region
from lightning_sink.reshard.source import Source
from lightning_sink.reshard.workers import run_in_workers
from lightning_sink.reshard.writer import StreamedRankFile, write_memory_bytes

__all__ = [
    "Conversion",
    "ReshardReport",
    "RankResult",
    "transform_checkpoints",
    "transform_checkpoint_by_rank",
    "rank_list_for_transform",
    "convert_one_rank",
]

LayoutArg = str | os.PathLike | Layout | None
# An idle worker interpreter with torch imported (measured: about 560 MiB peak RSS on this project's CPU machine).
WORKER_BASELINE_BYTES = 600 * 2**20


@dataclass
class RankResult:
    rank: int
    relative_path: str
    sha256: str
    bytes_written: int
    stats: ReadStats
    peak_rss_bytes: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "stats": vars(self.stats)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankResult:
        fields = {name: data[name] for name in cls.__dataclass_fields__}
        return cls(**{**fields, "stats": ReadStats(**data["stats"])})


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


def _layout(value: LayoutArg, name: str) -> Layout:
    if isinstance(value, Layout):
        return value
    if value is None:
        raise ValueError(
            f"{name} is required for the target (a layout file such as the one `lightning-sink layout` writes)"
        )
    return load_layout(value)


def _source_layout_arg(value: LayoutArg) -> Path | None:
    if isinstance(value, Layout):
        raise TypeError("src_strategy_file must be a path (or None to use the checkpoint's own layout), not a Layout")
    return None if value is None else Path(value)


def rank_list_for_transform(
    rank_id: int, src_strategy_file: str | os.PathLike, dst_strategy_file: LayoutArg
) -> list[int]:
    """The source ranks whose files target ``rank_id`` needs, from the layouts alone.

    ``src_strategy_file`` may also be a DCP checkpoint folder: its stored chunks then say which rank holds what
    (DCP stores a replicated chunk once, so only that folder knows which replica's file has it).
    """
    source_path = Path(src_strategy_file)
    target = _layout(dst_strategy_file, "dst_strategy_file")
    if (source_path.is_dir() and (source_path / DCP_METADATA_FILE).is_file()) or zipfile.is_zipfile(source_path):
        src = open_source(source_path, None, roles=target).layout  # a DCP folder or a one-device checkpoint
    else:
        src = load_layout(source_path)
    return plan_rank(rank_id, src, target).source_ranks()


def _shard_bytes(plan: RankPlan) -> int:
    return sum(shard.numel * torch_dtype(shard.dtype).itemsize for shard in plan.shards)


def _payload(plan: RankPlan, source: Source, dst: Layout, stats: ReadStats, provenance: dict) -> dict[str, Any]:
    """What a rank file holds; its tensors are untouched placeholders that ``_fill`` writes band by band."""
    return {
        "format": RANK_FILE_FORMAT,
        "version": RANK_FILE_VERSION,
        "rank": plan.rank,
        "layout": dst.to_json(),
        "tensors": {shard.fqn: torch.empty(shard.chunk.sizes, dtype=torch_dtype(shard.dtype)) for shard in plan.shards},
        "non_tensor_state": source.non_tensor_state(stats),
        "extra_files": source.extra_files(),
        "paths": dict(source.paths),
        "provenance": provenance,
    }


def _fill(
    plan: RankPlan,
    source: Source,
    out: StreamedRankFile,
    stats: ReadStats,
    checks: RecordChecks,
    on_shard: Callable[[int], None] | None,
) -> None:
    """Every shard in file order, band by band: each band filled in place, in the file's write window, from
    exact byte ranges of the source."""
    fds = FileCache()
    try:
        for shard in sorted(plan.shards, key=lambda s: out.offset(s.fqn)):
            dtype = torch_dtype(shard.dtype)
            for band in bands_of(shard):
                band_offsets, band_sizes = band_box(shard, band)
                rows = out.band(shard.fqn, band.start, band_sizes)
                for copy in band.copies:
                    location = source.locate(copy.src_chunk, shard.fqn, stats, fds)
                    if location.shape != copy.src_chunk.sizes or location.dtype != dtype:
                        raise ValueError(
                            f"{location.what}: stored as {list(location.shape)} {location.dtype}, the"
                            f" source layout says {list(copy.src_chunk.sizes)} {shard.dtype}"
                        )
                    copy_region(
                        fds.fd(location.path),
                        location,
                        copy.src_chunk.offsets,
                        copy.region,
                        rows,
                        band_offsets,
                        stats,
                        checks,
                    )
            if on_shard is not None:
                on_shard(shard.numel * dtype.itemsize)
    finally:
        fds.close()


def _convert_rank(
    plan: RankPlan,
    source: Source,
    dst: Layout,
    out_path: Path,
    provenance: dict,
    checks: RecordChecks,
    on_shard: Callable[[int], None] | None = None,
) -> tuple[str, int, ReadStats]:
    """Write target rank ``plan.rank``'s file; the parts of records it read in part are left in ``checks``."""
    stats = ReadStats()
    payload = _payload(plan, source, dst, stats, provenance)

    def as_verify_reads_it(loaded: Any) -> None:
        try:
            check_loaded_rank_file(loaded, dst, plan.rank, out_path, payload["layout"])
        except ValueError as error:  # the output's fault is the source's: say which, and that nothing is committed
            raise ValueError(f"{source.description} converts to a file that verify refuses: {error}") from None

    with write_errors_in_words(out_path):
        try:
            out = StreamedRankFile(out_path, payload, as_verify_reads_it)
        except RuntimeError as error:  # torch.save says a failed write so ("unexpected pos", "iostream error")
            raise OSError(errno.EIO, f"torch.save could not write it ({error})") from None
        try:
            _fill(plan, source, out, stats, checks, on_shard)
        except BaseException:
            out.close()
            raise
        digest, size = out.finish()
    return digest, size, stats


def _check_room(plans: list[RankPlan], target: Layout, output: Path) -> None:
    """Refuse before writing when the rank files (at least their shards and layout) cannot fit."""
    header = len(target.to_json())
    sizes = [_shard_bytes(plan) + header for plan in plans]
    check_room_for(output.parent, sum(sizes), max(sizes, default=0), f"resharded checkpoint {str(output)!r}")


def _provenance(source: Source, dst: Layout, ckpt_prefix: str) -> dict[str, Any]:
    return {
        "source_fingerprint": source.fingerprint,
        "target_layout_sha256": hashlib.sha256(dst.to_json().encode()).hexdigest(),
        "ckpt_prefix": ckpt_prefix,
        "world_size": dst.world_size,
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not ``ru_maxrss``: Linux carries that across exec, so a worker
    would report its launcher's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class Conversion:
    """One conversion, described once: what the in-process path and every worker need to convert a target rank."""

    src_dir: Path
    src_layout: Path | None  # None: the source's own layout (its layout.json, DCP metadata or embedded)
    target: Layout
    ckpt_prefix: str
    staging: Path  # where the rank files are written before the commit
    verified_files: frozenset[str]  # source files whose whole SHA-256 was checked (their records need no CRC-32)

    def open_source(self) -> Source:
        roles = self.target if self.src_dir.is_file() else None  # a one-device file's buffers, by the target's roles
        return open_source(self.src_dir, self.src_layout, roles=roles)

    def to_json(self) -> dict[str, Any]:
        return {
            "src_dir": str(self.src_dir),
            "src_layout": None if self.src_layout is None else str(self.src_layout),
            "target": self.target.to_json(),
            "ckpt_prefix": self.ckpt_prefix,
            "staging": str(self.staging),
            "verified_files": sorted(self.verified_files),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Conversion:
        return cls(
            Path(data["src_dir"]),
            None if data["src_layout"] is None else Path(data["src_layout"]),
            Layout.from_json(data["target"]),
            data["ckpt_prefix"],
            Path(data["staging"]),
            frozenset(data["verified_files"]),
        )


def convert_one_rank(
    conversion: Conversion,
    source: Source,
    plan: RankPlan,
    checks: RecordChecks,
    on_shard: Callable[[int], None] | None = None,
) -> RankResult:
    """Target rank ``plan.rank``'s file in the staging folder; the same steps in this process and in a worker."""
    started = time.perf_counter()
    relative = rank_file_name(plan.rank, conversion.ckpt_prefix)
    out_path = conversion.staging / relative
    with write_errors_in_words(out_path.parent):
        out_path.parent.mkdir(exist_ok=True)
    provenance = _provenance(source, conversion.target, conversion.ckpt_prefix)
    digest, size, stats = _convert_rank(plan, source, conversion.target, out_path, provenance, checks, on_shard)
    return RankResult(plan.rank, relative, digest, size, stats, peak_rss_bytes(), time.perf_counter() - started)


def worker_main(task: dict) -> int:
    """A worker process's entry (see workers.py): convert one target rank, print the result as JSON."""
    import json
    import sys

    try:
        conversion = Conversion.from_json(task["conversion"])
        source = conversion.open_source()
        checks = RecordChecks(set(conversion.verified_files))
        result = convert_one_rank(conversion, source, plan_rank(task["rank"], source.layout, conversion.target), checks)
    except (ValueError, FileNotFoundError, TypeError, OSError) as error:
        kind = type(error).__name__ if isinstance(error, (ValueError, FileNotFoundError, TypeError)) else "OSError"
        print(json.dumps({"error": kind, "message": str(error)}))
        return 1
    print(json.dumps({"result": {**result.to_json(), "checks": checks.to_json()}}))
    sys.stdout.flush()
    return 0


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
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers={workers!r} must be None or a positive integer")
    if memory_budget_bytes is not None and (
        isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, int) or memory_budget_bytes < 1
    ):
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes!r} must be None or a positive number of bytes")
    roles = _layout(dst_strategy_file, "dst_strategy_file") if src_dir.is_file() else None  # a .ckpt's buffers
    source = open_source(src_dir, _source_layout_arg(src_strategy_file), roles=roles)
    target = roles or _layout(dst_strategy_file, "dst_strategy_file")
    plans = [plan_rank(rank, source.layout, target) for rank in range(target.world_size)]  # all errors before writing
    source.check_files(sorted({r for plan in plans for r in plan.source_ranks()}))
    provenance = _provenance(source, target, ckpt_prefix)
    with write_errors_in_words(dst.parent):
        dst.parent.mkdir(parents=True, exist_ok=True)
    _check_room(plans, target, dst)
    with exclusive(dst, "dst_checkpoints_dir"):
        _check_destination_holds(dst, provenance, overwrite)
        with staged_folder(dst) as staging:
            conversion = Conversion(
                src_dir,
                _source_layout_arg(src_strategy_file),
                target,
                ckpt_prefix,
                staging,
                frozenset(source.verified_files),
            )
            return _convert_all(dst, conversion, source, plans, provenance, workers, memory_budget_bytes, progress)


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
    workers: int | None,
    memory_budget_bytes: int | None,
    progress: Callable[[int, int], None] | None,
) -> ReshardReport:
    """Every target rank into the staging folder, then the layout and the manifest (last)."""
    staging = conversion.staging
    report = ReshardReport(dst)
    report.checks.verify_bytes_read += source.verify_bytes_read
    checks = RecordChecks(set(conversion.verified_files))
    total, done = sum(_shard_bytes(plan) for plan in plans), 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, total)

    if workers is None:
        for plan in plans:
            report.ranks.append(convert_one_rank(conversion, source, plan, checks, advance))
    else:
        tasks = [{"conversion": conversion.to_json(), "rank": plan.rank} for plan in plans]
        for reply in run_in_workers(tasks, worker_count(plans, workers, memory_budget_bytes)):
            checks.merge(RecordChecks.from_json(reply["checks"]))
            result = RankResult.from_json(reply)
            advance(_shard_bytes(plans[result.rank]))
            report.ranks.append(result)
    checks.finish(report.checks)  # every record read in parts, before anything is committed
    report.ranks.sort(key=lambda r: r.rank)
    with write_errors_in_words(staging):
        save_layout(conversion.target, staging / LAYOUT_FILE_NAME)
        files = {r.relative_path: {"sha256": r.sha256, "bytes": r.bytes_written} for r in report.ranks}
        files[LAYOUT_FILE_NAME] = {
            "sha256": sha256_of_file(staging / LAYOUT_FILE_NAME),
            "bytes": (staging / LAYOUT_FILE_NAME).stat().st_size,
        }
        write_manifest(staging, Manifest(files=files, provenance=provenance))
        fsync_dir(staging)
    return report


def worker_count(plans: list[RankPlan], workers: int, memory_budget_bytes: int | None) -> int:
    """At most one worker per target rank, and as many as fit the budget: a worker holds the writer's two windows
    (each about its largest band of rows), the read buffer and an idle interpreter."""
    count = min(workers, len(plans))
    if memory_budget_bytes is None:
        return count
    largest_band = max(
        (
            math.prod(band_box(shard, band)[1]) * torch_dtype(shard.dtype).itemsize
            for plan in plans
            for shard in plan.shards
            for band in bands_of(shard)
        ),
        default=0,
    )
    per_worker = write_memory_bytes(largest_band) + READ_BUFFER_BYTES + WORKER_BASELINE_BYTES
    return max(1, min(count, memory_budget_bytes // per_worker))


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
    roles = _layout(dst_strategy_file, "dst_strategy_file") if len(files) == 1 else None  # a .ckpt's buffers
    source = source_from_files(checkpoint_files_map, _source_layout_arg(src_strategy_file), roles=roles)
    target = roles or _layout(dst_strategy_file, "dst_strategy_file")
    plan = plan_rank(rank_id, source.layout, target)
    missing = [rank for rank in plan.source_ranks() if rank not in {int(r) for r in checkpoint_files_map}]
    if missing:
        raise ValueError(
            f"checkpoint_files_map lacks source rank(s) {missing} that target rank {rank_id} needs"
            f" (see rank_list_for_transform)"
        )
    source.check_files(plan.source_ranks())
    out = Path(save_checkpoint_file_name)
    if out.is_dir() or not out.name:
        raise ValueError(
            f"save_checkpoint_file_name={str(out)!r} is a folder: name the rank file to write (e.g."
            f" {str(out / rank_file_name(rank_id, 'checkpoint_'))!r})"
        )
    if out.is_symlink():
        raise ValueError(f"save_checkpoint_file_name={str(out)!r} is a symbolic link; name the file itself")
    if any(out.resolve() == path.resolve() for path in source.files.values()):
        raise ValueError(f"save_checkpoint_file_name={str(out)!r} is a file of the source")
    provenance = _provenance(source, target, "")
    if os.path.lexists(out):
        _check_rank_file_replaceable(out, rank_id, provenance, overwrite)
    with write_errors_in_words(out.parent):
        out.parent.mkdir(parents=True, exist_ok=True)
    _check_room([plan], target, out)
    temp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    sidecar = sidecar_path(out)
    temp_sidecar = sidecar.with_name(f".{sidecar.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        checks = RecordChecks(source.verified_files)
        digest, size, stats = _convert_rank(plan, source, target, temp, provenance, checks)
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
    peak = peak_rss_bytes()
    return RankResult(rank_id, out.name, digest, size, stats, peak, time.perf_counter() - started)


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
