"""Integrity of the non-tensor bytes a conversion carries into its output: every record's CRC-32.

Carried values are ``torch.save`` archives copied unchanged (DCP's non-tensor items, Lightning's ``meta.pt``), or
values re-saved from one (a one-device checkpoint's optimizer settings and Lightning state). A zip record of such an
archive holds its CRC-32, which ``torch.load`` never checks; so before any of those bytes reach an output, every
record of the archive is read against its CRC-32 (``check_archive_bytes``), or, for a one-device file, every record
that the tensor copies do not already check (``check_untensored_records``, see integrity.py for those). That covers
every byte a load of the value reads (its pickle, the storages it holds, the archive's version and byte order);
bytes no load reads (zip timestamps, alignment padding) are not. A record stored without its CRC-32 fails like a
damaged one, and compressed records (``torch.save`` never writes them) are refused unread.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from lightning_sink.checkpoint_format.fs import open_nofollow

__all__ = ["check_archive_bytes", "check_untensored_records"]

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length
_READ_BLOCK = 1 << 20


def check_archive_bytes(data: bytes, what: str) -> None:
    """``data`` is a ``torch.save`` archive whose every record matches its CRC-32; ValueError naming ``what``."""
    with _archive(io.BytesIO(data), what) as archive:
        _check_records(archive, archive.infolist(), what)


def check_untensored_records(path: Path, tensor_offsets: Iterable[int], what: str) -> int:
    """Check every record of the ``torch.save`` file ``path`` except the storages at ``tensor_offsets`` (their data
    offsets: the tensors a conversion copies, checked as it reads them); returns the bytes read."""
    skip = set(tensor_offsets)
    with os.fdopen(open_nofollow(path), "rb") as handle, _archive(handle, what) as archive:
        records = [info for info in archive.infolist() if _data_offset(handle, info, what) not in skip]
        return _check_records(archive, records, what)


def _archive(handle: IO[bytes], what: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(handle)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
        raise ValueError(f"{what}: not a readable torch.save archive ({error})") from None


def _data_offset(handle: IO[bytes], info: zipfile.ZipInfo, what: str) -> int:
    """Where the record's bytes start: after its local header, whose name and extra field lengths are its own."""
    handle.seek(info.header_offset)
    header = handle.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise ValueError(f"{what}: record {info.filename!r} has no valid local header: the archive is corrupt")
    _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _check_records(archive: zipfile.ZipFile, records: list[zipfile.ZipInfo], what: str) -> int:
    read = 0
    for info in records:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{what}: record {info.filename!r} is compressed; torch.save stores records as they are")
        read += _read_through(archive, info, what)
    return read


def _read_through(archive: zipfile.ZipFile, info: zipfile.ZipInfo, what: str) -> int:
    """Read the record to its end, where zipfile compares the CRC-32 (BadZipFile on a mismatch)."""
    read = 0
    try:
        with archive.open(info) as record:
            while block := record.read(_READ_BLOCK):
                read += len(block)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as error:  # (a garbled name: UnicodeDecodeError)
        raise ValueError(
            f"{what}: record {info.filename!r} does not match its CRC-32 or is cut short ({error}): the bytes are"
            " corrupt"
        ) from None
    return read
