"""One target rank's file, built from exact byte ranges of the source chunks it overlaps.

One ``Conversion`` describes a whole conversion; ``convert_one_rank`` converts one target rank of it, the same
function in this process and in a worker (which receives the description as JSON, see ``worker_main``).
``convert_rank`` writes one rank file wherever it is told, for the whole-checkpoint transform (``transform.py``)
and the by-rank one (``transform_by_rank.py``) alike.
"""

from __future__ import annotations

import errno
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_sink.checkpoint_format.destination import write_errors_in_words
from lightning_sink.checkpoint_format.fs import check_room_for
from lightning_sink.checkpoint_format.rank_file import (
    RANK_FILE_FORMAT,
    RANK_FILE_VERSION,
    check_loaded_rank_file,
    rank_file_name,
)
from lightning_sink.layout.schema import Layout
from lightning_sink.layout.validation import torch_dtype
from lightning_sink.reshard.integrity import RecordChecks
from lightning_sink.reshard.open_source import open_source
from lightning_sink.reshard.plan import RankPlan, band_box, bands_of, plan_rank
from lightning_sink.reshard.reader import CopyTarget, FileCache, ReadStats, SourceChunk, copy_region
from lightning_sink.reshard.source import Source
from lightning_sink.reshard.writer import StreamedRankFile

__all__ = [
    "Conversion",
    "RankFileSpec",
    "RankResult",
    "check_room",
    "convert_one_rank",
    "convert_rank",
    "peak_rss_bytes",
    "provenance_of",
    "shard_bytes",
    "worker_main",
]


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


@dataclass(frozen=True)
class RankFileSpec:
    """One target rank file to write: the rank's plan, the target layout it was planned on, the path to write,
    and the provenance the file records."""

    plan: RankPlan
    target: Layout
    path: Path
    provenance: dict[str, Any]


def shard_bytes(plan: RankPlan) -> int:
    return sum(shard.numel * torch_dtype(shard.dtype).itemsize for shard in plan.shards)


def _payload(spec: RankFileSpec, source: Source, stats: ReadStats) -> dict[str, Any]:
    """What a rank file holds; its tensors are untouched placeholders that ``_fill`` writes band by band."""
    return {
        "format": RANK_FILE_FORMAT,
        "version": RANK_FILE_VERSION,
        "rank": spec.plan.rank,
        "layout": spec.target.to_json(),
        "tensors": {
            shard.fqn: torch.empty(shard.chunk.sizes, dtype=torch_dtype(shard.dtype)) for shard in spec.plan.shards
        },
        "non_tensor_state": source.non_tensor_state(stats),
        "extra_files": source.extra_files(),
        "paths": dict(source.paths),
        "provenance": spec.provenance,
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
                rows = CopyTarget(out.band(shard.fqn, band.start, band_sizes), band_offsets)
                for copy in band.copies:
                    location = source.locate(copy.src_chunk, shard.fqn, stats, fds)
                    if location.shape != copy.src_chunk.sizes or location.dtype != dtype:
                        raise ValueError(
                            f"{location.what}: stored as {list(location.shape)} {location.dtype}, the"
                            f" source layout says {list(copy.src_chunk.sizes)} {shard.dtype}"
                        )
                    chunk = SourceChunk(fds.fd(location.path), location, copy.src_chunk.offsets)
                    copy_region(chunk, copy.region, rows, stats, checks)
            if on_shard is not None:
                on_shard(shard.numel * dtype.itemsize)
    finally:
        fds.close()


def convert_rank(
    spec: RankFileSpec,
    source: Source,
    checks: RecordChecks,
    on_shard: Callable[[int], None] | None = None,
) -> tuple[str, int, ReadStats]:
    """Write target rank ``spec.plan.rank``'s file at ``spec.path``; the parts of records it read in part are
    left in ``checks``."""
    plan, dst, out_path = spec.plan, spec.target, spec.path
    stats = ReadStats()
    payload = _payload(spec, source, stats)

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


def check_room(plans: list[RankPlan], target: Layout, output: Path) -> None:
    """Refuse before writing when the rank files (at least their shards and layout) cannot fit."""
    header = len(target.to_json())
    sizes = [shard_bytes(plan) + header for plan in plans]
    check_room_for(output.parent, sum(sizes), max(sizes, default=0), f"resharded checkpoint {str(output)!r}")


def provenance_of(source: Source, dst: Layout, ckpt_prefix: str) -> dict[str, Any]:
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
    provenance = provenance_of(source, conversion.target, conversion.ckpt_prefix)
    digest, size, stats = convert_rank(
        RankFileSpec(plan, conversion.target, out_path, provenance), source, checks, on_shard
    )
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
