"""MindSpore's checkpoint transformation API on DCP checkpoints: any M ranks and layout to any N, offline.

Each target rank's file is built from exact byte ranges of the source chunks it overlaps; ranks are independent
(``workers`` processes convert one target rank each). The whole output is written into a staging folder beside
the destination, with a manifest of SHA-256 digests written last, then renamed into place.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import resource
import shutil
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_sink.checkpoint_format.atomic import commit_folder, staging_dir
from lightning_sink.checkpoint_format.fs import (
    DiskFullError,
    check_file_prefix,
    check_room_for,
    fsync_dir,
    open_nofollow,
    remove_leftovers,
    sha256_of_file,
)
from lightning_sink.checkpoint_format.manifest import Manifest, read_manifest, write_manifest
from lightning_sink.checkpoint_format.rank_file import (
    RANK_FILE_FORMAT,
    RANK_FILE_VERSION,
    rank_dir_name,
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
    "ReshardReport",
    "RankResult",
    "transform_checkpoints",
    "transform_checkpoint_by_rank",
    "rank_list_for_transform",
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
    with _write_errors_in_words(out_path):
        try:
            out = StreamedRankFile(out_path, payload)
        except RuntimeError as error:  # torch.save says a failed write so ("unexpected pos", "iostream error")
            raise OSError(errno.EIO, f"torch.save could not write it ({error})") from None
        try:
            _fill(plan, source, out, stats, checks, on_shard)
        except BaseException:
            out.close()
            raise
        digest, size = out.finish()
    return digest, size, stats


@contextmanager
def _write_errors_in_words(path: Path) -> Iterator[None]:
    """A write of ``path`` that fails (a full disk, the file-size limit, torch.save's own report of either) becomes
    one OSError naming the file and, where it can be told, the reason in words."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as error:
        if error.filename is not None and Path(error.filename) != path:
            raise  # not this file's write (e.g. a source that vanished)
        reason = _full_disk_reason(path, error)
        raise (DiskFullError if reason else OSError)(f"could not write {str(path)!r}: {reason or error}") from None


def _full_disk_reason(path: Path, error: OSError) -> str | None:
    if error.errno == errno.ENOSPC or error.errno == errno.EDQUOT:
        return "the disk is full"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    written = path.stat().st_size if path.exists() else 0
    if error.errno == errno.EFBIG or (limit != resource.RLIM_INFINITY and written >= limit):
        return f"the file reached this process's file-size limit ({limit} bytes)"
    stats = os.statvfs(path.parent)
    if stats.f_bavail == 0:
        return "the disk is full"
    return None


def _check_room(plans: list[RankPlan], target: Layout, output: Path) -> None:
    """Refuse before writing when the rank files (at least their shards and layout) cannot fit."""
    header = len(target.to_json())
    sizes = [_shard_bytes(plan) + header for plan in plans]
    check_room_for(output.parent, sum(sizes), max(sizes, default=0), f"resharded checkpoint {str(output)!r}")


def _provenance(source: Source, dst: Layout, ckpt_prefix: str) -> dict[str, Any]:
    import hashlib

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


def worker_main(task: dict) -> int:
    """A worker process's entry (see workers.py): convert one target rank, print the result as JSON."""
    import json
    import sys

    try:
        result = _convert_task(task)
    except (ValueError, FileNotFoundError, TypeError, OSError) as error:
        kind = type(error).__name__ if isinstance(error, (ValueError, FileNotFoundError, TypeError)) else "OSError"
        print(json.dumps({"error": kind, "message": str(error)}))
        return 1
    print(json.dumps({"result": result}))
    sys.stdout.flush()
    return 0


def _convert_task(task: dict) -> dict:
    started = time.perf_counter()
    rank, staging, ckpt_prefix = task["rank"], Path(task["staging"]), task["ckpt_prefix"]
    dst = Layout.from_json(task["dst_layout"])
    source = open_source(task["src_dir"], task["src_layout"], roles=dst)
    relative = rank_file_name(rank, ckpt_prefix)
    (staging / rank_dir_name(rank)).mkdir(parents=True, exist_ok=True)
    plan = plan_rank(rank, source.layout, dst)
    checks = RecordChecks(set(task["verified_files"]))
    digest, size, stats = _convert_rank(
        plan, source, dst, staging / relative, _provenance(source, dst, ckpt_prefix), checks
    )
    return {
        "rank": rank,
        "relative_path": relative,
        "sha256": digest,
        "bytes_written": size,
        "stats": vars(stats),
        "checks": checks.to_json(),
        "peak_rss_bytes": peak_rss_bytes(),
        "seconds": time.perf_counter() - started,
    }


def _prepare_destination(dst: Path, provenance: dict, overwrite: bool) -> None:
    """Refuse a destination holding anything but this same conversion, unless ``overwrite``; clear leftovers of
    killed runs (staging and retired folders are never visible as the destination)."""
    remove_leftovers(dst.parent, dst.name, ("staging",))
    if not dst.exists():
        return
    if not dst.is_dir():
        raise ValueError(f"dst_checkpoints_dir={str(dst)!r} exists and is not a folder")
    if overwrite or not any(dst.iterdir()):
        return
    try:
        previous = read_manifest(dst).provenance
    except (FileNotFoundError, ValueError):
        previous = None
    same = previous is not None and all(
        previous.get(k) == provenance[k] for k in ("source_fingerprint", "target_layout_sha256", "ckpt_prefix")
    )
    if not same:
        raise ValueError(
            f"dst_checkpoints_dir={str(dst)!r} already holds a different checkpoint (or other files);"
            " pass overwrite=True (--overwrite on the command line) to replace it, or choose an empty"
            " folder"
        )


@contextmanager
def _exclusive(dst: Path) -> Iterator[None]:
    """Only one conversion at a time into ``dst``: another would clear this one's staging folder as a leftover.

    An ``flock`` on ``.<dst>.lock`` beside it; the kernel drops it when the process dies, so a killed conversion
    never blocks the next. The file is removed on the way out; a waiter that locked a file removed meanwhile
    sees another inode at the path and tries again.
    """
    path = dst.parent / f".{dst.name}.lock"
    while True:
        fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)  # a planted link must not make us create its target
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"dst_checkpoints_dir={str(dst)!r}: another conversion into it is running (it holds"
                f" {str(path)!r}); wait for it to finish or choose another destination"
            ) from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


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
        src_strategy_file: the source layout; None: the folder's ``layout.json``, else derived from DCP metadata.
        dst_strategy_file: the target layout (file or :class:`Layout`).
        workers: None converts in this process; k converts in k spawned processes, one target rank each.
        overwrite: replace a destination that holds a different checkpoint.
        memory_budget_bytes: caps the worker count at budget // (the writer's two windows of about the largest
            band of rows + read buffer + an idle worker's ~600 MiB); see ``worker_count``.
        progress: called with (target bytes done, target bytes in all) as shards fill (in process) or as
            target ranks finish (workers).
    """
    check_file_prefix(ckpt_prefix, "ckpt_prefix")
    if Path(dst_checkpoints_dir).is_symlink():  # the output replaces dst as a whole: never at a link's target
        raise ValueError(f"dst_checkpoints_dir={str(dst_checkpoints_dir)!r} is a symbolic link; name the folder itself")
    src_dir, dst = Path(src_checkpoints_dir).resolve(), Path(dst_checkpoints_dir).resolve()
    if dst == src_dir or src_dir in dst.parents or dst in src_dir.parents:
        raise ValueError(
            f"dst_checkpoints_dir={str(dst)!r} must not be, contain or lie inside src_checkpoints_dir={str(src_dir)!r}"
        )
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers={workers!r} must be None or a positive integer")
    roles = _layout(dst_strategy_file, "dst_strategy_file") if src_dir.is_file() else None  # a .ckpt's buffers
    source = open_source(src_dir, _source_layout_arg(src_strategy_file), roles=roles)
    target = roles or _layout(dst_strategy_file, "dst_strategy_file")
    plans = [plan_rank(rank, source.layout, target) for rank in range(target.world_size)]  # all errors before writing
    source.check_files(sorted({r for plan in plans for r in plan.source_ranks()}))
    provenance = _provenance(source, target, ckpt_prefix)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _check_room(plans, target, dst)
    with _exclusive(dst):
        _prepare_destination(dst, provenance, overwrite)
        return _convert_all(
            plans,
            source,
            target,
            src_dir,
            src_strategy_file,
            dst,
            ckpt_prefix,
            provenance,
            workers,
            memory_budget_bytes,
            progress,
        )


def _convert_all(
    plans,
    source,
    target,
    src_dir,
    src_strategy_file,
    dst,
    ckpt_prefix,
    provenance,
    workers,
    memory_budget_bytes,
    progress,
) -> ReshardReport:
    """Every target rank into a staging folder, then the manifest, then the rename into place."""
    staging = staging_dir(dst, f"-{uuid.uuid4().hex[:8]}")  # unique: one conversion's leftovers never match another's
    staging.mkdir()
    report = ReshardReport(dst)
    report.checks.verify_bytes_read += source.verify_bytes_read
    checks = RecordChecks(source.verified_files)
    try:
        layout_arg = str(src_strategy_file) if src_strategy_file is not None else None
        tasks = [
            {
                "rank": plan.rank,
                "src_dir": str(src_dir),
                "src_layout": layout_arg,
                "dst_layout": target.to_json(),
                "staging": str(staging),
                "ckpt_prefix": ckpt_prefix,
                "verified_files": sorted(source.verified_files),
            }
            for plan in plans
        ]
        total, done = sum(_shard_bytes(plan) for plan in plans), 0

        def advance(count: int) -> None:
            nonlocal done
            done += count
            if progress is not None:
                progress(done, total)

        for result in _run(
            tasks, plans, source, target, staging, ckpt_prefix, workers, memory_budget_bytes, advance, checks
        ):
            report.ranks.append(result)
        checks.finish(report.checks)  # every record read in parts, before anything is committed
        report.ranks.sort(key=lambda r: r.rank)
        save_layout(target, staging / LAYOUT_FILE_NAME)
        files = {r.relative_path: {"sha256": r.sha256, "bytes": r.bytes_written} for r in report.ranks}
        files[LAYOUT_FILE_NAME] = {
            "sha256": sha256_of_file(staging / LAYOUT_FILE_NAME),
            "bytes": (staging / LAYOUT_FILE_NAME).stat().st_size,
        }
        write_manifest(staging, Manifest(files=files, provenance=provenance))
        fsync_dir(staging)
        commit_folder(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def _run(
    tasks, plans, source, target, staging, ckpt_prefix, workers, memory_budget_bytes, advance, checks: RecordChecks
):
    """Convert every target rank, in this process or in workers; the parts of records read in part are merged
    into ``checks``."""
    if workers is None:
        provenance = _provenance(source, target, ckpt_prefix)
        for plan in plans:
            started = time.perf_counter()
            relative = rank_file_name(plan.rank, ckpt_prefix)
            (staging / rank_dir_name(plan.rank)).mkdir()
            digest, size, stats = _convert_rank(plan, source, target, staging / relative, provenance, checks, advance)
            peak = peak_rss_bytes()
            yield RankResult(plan.rank, relative, digest, size, stats, peak, time.perf_counter() - started)
        return
    for result in run_in_workers(tasks, worker_count(plans, workers, memory_budget_bytes)):
        checks.merge(RecordChecks.from_json(result["checks"]))
        advance(_shard_bytes(plans[result["rank"]]))
        yield RankResult(
            result["rank"],
            result["relative_path"],
            result["sha256"],
            result["bytes_written"],
            ReadStats(**result["stats"]),
            result["peak_rss_bytes"],
            result["seconds"],
        )


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
    sidecar that ``load_resharded_checkpoint`` checks."""
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
    provenance = _provenance(source, target, "")
    if out.exists() and not overwrite:
        header = read_rank_file_header(out) if out.is_file() else {}
        previous = header.get("provenance") or {}
        if header.get("rank") != rank_id or any(
            previous.get(k) != provenance[k] for k in ("source_fingerprint", "target_layout_sha256")
        ):
            raise ValueError(
                f"save_checkpoint_file_name={str(out)!r} already holds a different checkpoint; pass"
                " overwrite=True (--overwrite on the command line)"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_room([plan], target, out)
    temp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    sidecar = sidecar_path(out)
    try:
        checks = RecordChecks(source.verified_files)
        digest, size, stats = _convert_rank(plan, source, target, temp, provenance, checks)
        stats.verify_bytes_read += source.verify_bytes_read
        checks.finish(stats)  # this rank's parts of records: the rest of each is read for checking only
        temp_sidecar = sidecar.with_name(f".{sidecar.name}.tmp")
        temp_sidecar.write_text(f"{digest} {size}\n")
        os.replace(temp, out)  # a kill between the two replaces leaves a digest mismatch that loaders report
        os.replace(temp_sidecar, sidecar)
        fsync_dir(out.parent)
    finally:
        temp.unlink(missing_ok=True)
    peak = peak_rss_bytes()
    return RankResult(rank_id, out.name, digest, size, stats, peak, time.perf_counter() - started)
