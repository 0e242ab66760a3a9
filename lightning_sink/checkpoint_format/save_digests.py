"""What binds the files of one save together: ``SAVE_DIGESTS.json``, the SHA-256 and size of every file of a DCP
folder this package saved, written last (by rank 0, once DCP has written its ``.metadata``, which it does after
every rank's files), before the folder is committed.

Without it, a folder mixing two saves - one save's ``.metadata`` with another's ``__0_0.distcp`` at the same
offsets - converts without complaint: each record's CRC-32 is consistent with its own bytes. A conversion of a
folder that has the file checks every file it reads against it first. Stock DCP folders (saved by Lightning or DCP
itself) record nothing of the kind, so for them a mix of two saves with identical structure cannot be told apart.

A DCP storage file is recorded record by record: the SHA-256 of each record DCP stored in it (a tensor chunk or a
non-tensor value, by name and offsets), whose byte ranges come from the save's ``.metadata`` (``storage_data``,
read with this package's restricted unpickler) and cover the file from its first byte to its last. A damaged byte
is then refused naming the tensor it lies in, for the same single pass over the bytes that a digest of the whole
file costs. Other files (``.metadata``, ``meta.pt``, the layout), and a storage file whose records would not cover
it exactly, are recorded whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from lightning_sink.checkpoint_format.fs import check_relative_name, open_inside, write_new_file
from lightning_sink.counts import is_count
from lightning_sink.layout.bounded_json import MAX_JSON_BYTES, loads_bounded
from lightning_sink.layout.dcp_metadata import DCP_METADATA_FILE, read_dcp_metadata
from lightning_sink.regular_file import read_regular

__all__ = [
    "SAVE_DIGESTS_FILE",
    "RecordedFile",
    "RecordedRecord",
    "check_save_digests",
    "check_recorded_files",
    "read_save_digests",
    "share_of_files",
    "write_save_digests",
]

SAVE_DIGESTS_FILE = "SAVE_DIGESTS.json"
_FORMAT = "lightning-sink-save-digests"
_VERSION = 2
_VERSIONS_READ = (1, 2)  # (version 1 recorded every file whole)
_BLOCK = 1 << 23
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class RecordedRecord:
    """One record DCP stored in a file: a tensor chunk (``offsets``: where it starts in the tensor) or a non-tensor
    value (``offsets`` None), at bytes ``start`` to ``start + length`` of the file."""

    name: str
    offsets: tuple[int, ...] | None
    start: int
    length: int
    sha256: str

    def describe(self) -> str:
        where = f"bytes {self.start}-{self.start + self.length}"
        if self.offsets is None:
            return f"non-tensor value {self.name!r} ({where})"
        return f"tensor {self.name!r} (chunk at offsets {list(self.offsets)}, {where})"


@dataclass(frozen=True)
class RecordedFile:
    """A file of the save: its size and either its records, in byte order, covering it exactly, or (no records) the
    SHA-256 of the whole file."""

    size: int
    sha256: str | None
    records: tuple[RecordedRecord, ...]


# ---------------------------------------------------------------------------------------------------- writing
def write_save_digests(folder: Path) -> None:
    """Record every regular file directly in ``folder`` (the save's own, freshly written)."""
    records = _records_in_metadata(folder)
    files: dict[str, dict[str, object]] = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name == SAVE_DIGESTS_FILE or not entry.is_file(follow_symlinks=False):
            continue
        mine = records.get(entry.name, [])
        if not _tiles(mine, entry.stat(follow_symlinks=False).st_size):
            mine = []  # (recorded whole)
        ranges = [(start, length) for _, _, start, length in mine]
        digest, size, record_digests = _digests(folder, entry.name, ranges, f"checkpoint {str(folder)!r}")
        files[entry.name] = {"bytes": size}
        if mine:
            files[entry.name]["records"] = [
                {"name": fqn, "offsets": offsets, "start": start, "length": length, "sha256": record_digest}
                for (fqn, offsets, start, length), record_digest in zip(mine, record_digests)
            ]
        else:
            files[entry.name]["sha256"] = digest
    document = {"format": _FORMAT, "version": _VERSION, "files": files}
    write_new_file(folder / SAVE_DIGESTS_FILE, json.dumps(document, separators=(",", ":")).encode())


def _records_in_metadata(folder: Path) -> dict[str, list[tuple[str, list[int] | None, int, int]]]:
    """Per storage file, its records (name, offsets, start, length) in byte order, from the save's ``.metadata``."""
    if not os.path.lexists(folder / DCP_METADATA_FILE):
        return {}
    by_file: dict[str, list[tuple[str, list[int] | None, int, int]]] = {}
    for index, info in (read_dcp_metadata(folder).storage_data or {}).items():
        offsets = None if index.offset is None else [int(o) for o in index.offset]
        by_file.setdefault(info.relative_path, []).append((index.fqn, offsets, info.offset, info.length))
    for records in by_file.values():
        records.sort(key=lambda record: record[2])
    return by_file


def _tiles(records: Sequence[tuple[str, object, int, int]], size: int) -> bool:
    """Whether the records cover bytes 0 to ``size`` exactly, one after the other (as DCP writes them)."""
    end = 0
    for _, _, start, length in records:
        if start != end or length < 1:
            return False
        end = start + length
    return bool(records) and end == size


# ---------------------------------------------------------------------------------------------------- reading
def read_save_digests(folder: Path, what: str) -> dict[str, RecordedFile] | None:
    """The files ``SAVE_DIGESTS.json`` records, every field checked; None when there is none (a stock DCP folder).
    A file that is not a well-formed record of this save's files is one ValueError naming it."""
    path = folder / SAVE_DIGESTS_FILE
    if not os.path.lexists(path):
        return None
    where = f"save digests {str(path)!r}"
    document = loads_bounded(read_regular(path, MAX_JSON_BYTES, f"{what}: save digests"), where)
    files = document.get("files") if isinstance(document, dict) else None
    if not isinstance(document, dict) or document.get("format") != _FORMAT or not isinstance(files, dict):
        raise ValueError(f"{where}: not a {_FORMAT!r} file")
    if document.get("version") not in _VERSIONS_READ:
        raise ValueError(
            f"{where}: version {document.get('version')!r} is not one this package reads {list(_VERSIONS_READ)}"
        )
    recorded = {}
    for name, entry in files.items():
        if not isinstance(name, str) or len(check_relative_name(name, where).parts) != 1:
            raise ValueError(f"{where}: {name!r} is not a file name directly in the folder")
        recorded[name] = _recorded_file(entry, f"{where}: file {name!r}")
    return recorded


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def _recorded_file(entry: object, where: str) -> RecordedFile:
    raw_records = entry.get("records") if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or not is_count(entry.get("bytes")):
        raise ValueError(f"{where}: not a record of a file (a 'bytes' count and a 'sha256' or 'records')")
    if raw_records is None:
        if not _is_digest(entry.get("sha256")):
            raise ValueError(f"{where}: has neither 'records' nor a 'sha256' of 64 hex digits")
        return RecordedFile(entry["bytes"], entry["sha256"], ())
    if not isinstance(raw_records, list) or not raw_records:
        raise ValueError(f"{where}: 'records' is not a list of records")
    size, records, end = entry["bytes"], [], 0
    for number, raw in enumerate(raw_records):
        record = _recorded_record(raw, f"{where}: record {number}")
        if record.start != end or record.length < 1 or record.start + record.length > size:
            raise ValueError(
                f"{where}: record {number} ({record.describe()}) does not follow the one before it, is empty or lies"
                f" outside the file's {size} bytes"
            )
        end = record.start + record.length
        records.append(record)
    if end != size:
        raise ValueError(f"{where}: its records end at byte {end}, the file's {size} bytes are not all covered")
    return RecordedFile(size, None, tuple(records))


def _recorded_record(raw: object, where: str) -> RecordedRecord:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a map")
    name, offsets, start, length = (raw.get(key) for key in ("name", "offsets", "start", "length"))
    if not (
        isinstance(name, str)
        and (offsets is None or (isinstance(offsets, list) and all(is_count(o) for o in offsets)))
        and is_count(start)
        and is_count(length)
        and _is_digest(raw.get("sha256"))
    ):
        raise ValueError(
            f"{where}: needs 'name' (a string), 'offsets' (counts or null), 'start' and 'length' (counts) and"
            " 'sha256' (64 hex digits)"
        )
    assert isinstance(start, int) and isinstance(length, int)
    return RecordedRecord(name, None if offsets is None else tuple(offsets), start, length, raw["sha256"])


# ---------------------------------------------------------------------------------------------------- checking
def check_recorded_files(folder: Path, recorded: dict[str, RecordedFile], names: Sequence[str], what: str) -> int:
    """Check each of ``names`` against what was recorded of it, in one pass over its bytes; return the bytes read.
    A file that differs is a ValueError naming it and, for a storage file, the first tensor whose bytes differ."""
    read = 0
    for name in names:
        check_relative_name(name, f"{what}: file")
        entry = recorded.get(name)
        if entry is None:
            raise ValueError(f"{what}: file {str(folder / name)!r} is not one this save wrote ({SAVE_DIGESTS_FILE})")
        digest, size, record_digests = _digests(folder, name, [(r.start, r.length) for r in entry.records], what)
        read += size
        differing = [record for record, got in zip(entry.records, record_digests) if got != record.sha256]
        if differing:
            more = f" and {len(differing) - 1} more record(s)" if len(differing) > 1 else ""
            culprit = f"{differing[0].describe()}{more} differs from its SHA-256"
        elif size != entry.size:
            culprit = f"it holds {size} bytes, the save wrote {entry.size}"
        elif entry.sha256 is not None and digest != entry.sha256:
            culprit = "its SHA-256 differs from the one"
        else:
            continue
        raise ValueError(
            f"{what}: file {str(folder / name)!r} does not belong to this save: {culprit} in {SAVE_DIGESTS_FILE} (a"
            " damaged byte, a file of another save, or changed since)"
        )
    return read


def check_save_digests(folder: Path, names: list[str], what: str) -> int | None:
    """None when ``folder`` records no digests (a stock DCP folder). Otherwise check that each of ``names`` is
    listed with the SHA-256 and size of its bytes (ValueError naming the file, and the tensor, when not: it does not
    belong to this save) and return the bytes read."""
    recorded = read_save_digests(folder, what)
    if recorded is None:
        return None
    return check_recorded_files(folder, recorded, names, what)


def share_of_files(recorded: dict[str, RecordedFile], names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The names among ``names`` that ``rank`` of ``world_size`` checks: every name goes to exactly one rank, the
    largest files first, each to the rank with the fewest bytes so far (the same answer on every rank that read the
    same digests). A name not recorded counts as an empty file; the rank it goes to refuses it."""
    loads = [0] * world_size
    mine = []
    for name in sorted(names, key=lambda n: (-(recorded[n].size if n in recorded else 0), n)):
        least = min(range(world_size), key=lambda r: loads[r])
        loads[least] += recorded[name].size if name in recorded else 0
        if least == rank:
            mine.append(name)
    return mine


def _digests(folder: Path, name: str, ranges: Sequence[tuple[int, int]], what: str) -> tuple[str, int, list[str]]:
    """In one pass over the file (reached without following symbolic links): the SHA-256 of each of ``ranges`` (start,
    length; in order, one after the other from byte 0) or, without ranges, of the whole file (else ""); the size."""
    whole = hashlib.sha256()
    parts = [hashlib.sha256() for _ in ranges]
    position = 0
    with os.fdopen(open_inside(folder, name, what), "rb") as handle:
        for (_, length), part in zip(ranges, parts):
            fed = _feed(handle, length, (part,))
            position += fed
            if fed < length:
                break  # the file ends inside this record: its digest (and the ones after) will differ
        position += _feed(handle, None, () if ranges else (whole,))
    return ("" if ranges else whole.hexdigest()), position, [part.hexdigest() for part in parts]


def _feed(handle: BinaryIO, count: int | None, hashes: Sequence[hashlib._Hash]) -> int:
    """Read ``count`` bytes (None: to the end) into each of ``hashes``; return how many there were."""
    fed = 0
    while count is None or fed < count:
        data = handle.read(_BLOCK if count is None else min(_BLOCK, count - fed))
        if not data:
            break
        for digest in hashes:
            digest.update(data)
        fed += len(data)
    return fed
