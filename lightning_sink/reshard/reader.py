"""Exact byte-range reads of tensors stored as ``torch.save`` zip records (DCP chunks, rank files).

A DCP chunk is a whole ``torch.save`` zip blob at ``[offset, offset + length)`` of a ``__{rank}_{n}.distcp``
file. Loading the blob with ``map_location="meta"`` reads only its zip directory and pickle (a few KiB) and
reports, per storage (``_torch_compat.storage_offset_in_file``), where the uncompressed raw bytes start inside the blob. The wanted
region is then read with ``os.preadv`` straight into the target tensor, one contiguous run at a time.
"""

from __future__ import annotations

import io
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

import torch

from lightning_sink._torch_compat import storage_offset_in_file
from lightning_sink.checkpoint_format.fs import open_nofollow
from lightning_sink.error_text import reason_of
from lightning_sink.reshard.integrity import PartCrc, RecordChecks, WholeCrc
from lightning_sink.reshard.plan import Box

__all__ = [
    "ReadStats",
    "TensorLocation",
    "RangeFile",
    "locate_tensors",
    "load_on_meta",
    "locations_in",
    "copy_region",
    "SourceChunk",
    "CopyTarget",
    "FileCache",
]

READ_BUFFER_BYTES = 16 * 2**20  # the bounded staging buffer for regions that are contiguous only in the file
SCATTER_RUN_BYTES = 4096  # target runs at least this long are read into place by scatter reads (preadv)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@dataclass
class ReadStats:
    """Bytes read from the source: tensor payload, zip/pickle headers, the payload bytes actually needed, and
    the bytes read only to check integrity (CRC-32 data descriptors, the unread rest of records read in part,
    whole files hashed against their manifest)."""

    payload_bytes_read: int = 0
    header_bytes_read: int = 0
    bytes_needed: int = 0
    records_crc_checked: int = 0
    verify_bytes_read: int = 0

    @property
    def bytes_read(self) -> int:
        return self.payload_bytes_read + self.header_bytes_read

    def add(self, other: ReadStats) -> None:
        self.payload_bytes_read += other.payload_bytes_read
        self.header_bytes_read += other.header_bytes_read
        self.bytes_needed += other.bytes_needed
        self.records_crc_checked += other.records_crc_checked
        self.verify_bytes_read += other.verify_bytes_read


@dataclass(frozen=True)
class TensorLocation:
    """Where a stored tensor's raw bytes lie in a file, and how its elements are laid out there."""

    path: Path
    data_offset: int  # absolute file offset of storage element 0
    storage_nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    what: str  # for error messages: "tensor 'x' in file '...'"


class RangeFile(io.RawIOBase):
    """A read-only, seekable window ``[base, base + length)`` of a file, counting the bytes read through it."""

    def __init__(self, fd: int, base: int, length: int):
        super().__init__()
        self.fd, self.base, self.length, self.position, self.bytes_read = fd, base, length, 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: offset, io.SEEK_CUR: self.position + offset, io.SEEK_END: self.length + offset}[
            whence
        ]
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self.length - self.position))
        data = os.pread(self.fd, count, self.base + self.position)
        buffer[: len(data)] = data
        self.position += len(data)
        self.bytes_read += len(data)
        return len(data)


class FileCache:
    """Open file descriptors by path (a worker reads many chunks from few files)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = open_nofollow(path)  # a link planted as a source file is refused, not followed
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def locate_tensors(fd: int, path: Path, base: int, length: int, what: str, stats: ReadStats) -> object:
    """Load the ``torch.save`` blob at ``[base, base + length)`` of ``path`` with storages on the meta device.

    Returns the loaded object in which every tensor is replaced by its :class:`TensorLocation`; bytes objects
    and other plain values come back as they are. Loads with ``weights_only=True``: no code is unpickled.
    """
    return locations_in(load_on_meta(fd, path, base, length, what, stats), path, base, what)


def load_on_meta(fd: int, path: Path, base: int, length: int, what: str, stats: ReadStats) -> object:
    """The ``torch.save`` blob at ``[base, base + length)`` of ``path`` loaded with ``weights_only=True``, its
    tensors on the meta device (no tensor byte read)."""
    window = RangeFile(fd, base, length)
    try:
        # a binary file object (RawIOBase); torch.load reads any, its stub names only IO[bytes]
        return torch.load(cast(IO[bytes], window), map_location="meta", weights_only=True)
    except Exception as error:  # a damaged zip raises RuntimeError, a damaged pickle UnpicklingError, ...
        raise ValueError(
            f"{what}: truncated or corrupt torch.save data at bytes {base}..{base + length}: {reason_of(error)}"
        ) from None
    finally:
        stats.header_bytes_read += window.bytes_read


def locations_in(loaded: object, path: Path, base: int, what: str) -> object:
    """``loaded`` (from ``load_on_meta``) with every tensor replaced by its :class:`TensorLocation`."""
    return _replace_tensors(loaded, lambda tensor: _location(tensor, path, base, what))


def _replace_tensors(node: object, convert) -> object:
    if isinstance(node, torch.Tensor):
        return convert(node)
    if isinstance(node, dict):
        return {key: _replace_tensors(value, convert) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_replace_tensors(value, convert) for value in node)
    return node


def _location(tensor: torch.Tensor, path: Path, base: int, what: str) -> TensorLocation:
    storage = tensor.untyped_storage()
    offset = storage_offset_in_file(storage)  # set by torch.load for every storage it reads from a file
    if offset is None:
        raise ValueError(f"{what}: a tensor of {str(path)!r} has no storage in the file")
    return TensorLocation(
        path=path,
        data_offset=base + offset,
        storage_nbytes=storage.nbytes(),
        dtype=tensor.dtype,
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        storage_offset=int(tensor.storage_offset()),
        what=what,
    )


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    return tensor.reshape(-1).view(torch.uint8).numpy().data


@dataclass(frozen=True)
class SourceChunk:
    """A stored chunk to copy from: its open file, where its bytes lie in it, and its global offsets."""

    fd: int
    location: TensorLocation
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class CopyTarget:
    """Where a copied region lands: a contiguous tensor and the global offsets of its first element."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class _Runs:
    """A region of row-major storage as runs: ``sizes`` elements from ``src_start`` of the stored chunk to
    ``dst_start`` of the target (both local), each run covering dims ``split..`` (see ``_split_dim``)."""

    fd: int
    source: TensorLocation
    src_start: tuple[int, ...]
    sizes: tuple[int, ...]
    split: int
    target: torch.Tensor
    dst_start: tuple[int, ...]


def copy_region(
    chunk: SourceChunk, region: Box, target: CopyTarget, stats: ReadStats, checks: RecordChecks | None = None
) -> None:
    """Read ``region`` (global box) of the stored chunk at ``chunk.offsets`` into the contiguous ``target`` shard
    at ``target.offsets``, reading only the region's bytes (plus, for non-row-major storage, its whole span).

    The bytes are CRC-checked: a record read whole at once, a part through ``checks`` (its register is kept
    there until ``checks.finish()`` has all the parts; without ``checks``, only whole records are checked)."""
    checks = RecordChecks() if checks is None else checks
    fd, source = chunk.fd, chunk.location
    item = source.dtype.itemsize
    stats.bytes_needed += math.prod(region[1]) * item
    if source.stride != _contiguous_strides(source.shape):
        _copy_region_strided(chunk, region, target, stats, checks)
        return
    region_offsets, sizes = region
    src_start = tuple(r - s for r, s in zip(region_offsets, chunk.offsets))
    dst_start = tuple(r - t for r, t in zip(region_offsets, target.offsets))
    src_shape, dst_shape = source.shape, tuple(target.tensor.shape)
    whole_record = (
        source.storage_offset == 0 and sizes == src_shape and math.prod(src_shape) * item == source.storage_nbytes
    )
    crc = None if not checks.needs_crc(source.path) else WholeCrc() if whole_record else PartCrc()
    split = _split_dim(sizes, src_shape, dst_shape)
    runs = _Runs(fd, source, src_start, sizes, split, target.tensor, dst_start)
    if _split_dim(sizes, src_shape, src_shape) != 0:
        _copy_runs_direct(runs, stats, crc)
    elif math.prod(sizes[split:]) * item >= SCATTER_RUN_BYTES:
        # One span of the file, runs of the target (e.g. half-rows into full rows): the kernel scatters it
        # straight into the target, up to IOV_MAX runs per read.
        _copy_span_scattered(runs, stats, crc)
    else:
        # Runs too short for a syscall vector each: few big reads into a bounded buffer, scattered by torch.
        _copy_span_buffered(runs, stats, crc)
    if isinstance(crc, WholeCrc):
        checks.whole(fd, source, crc.value, stats)
    elif crc is not None:
        checks.part(fd, source, (src_start, tuple(sizes)), crc.finish(source.storage_nbytes), stats)


def _split_dim(sizes, src_shape, dst_shape) -> int:
    """The dim k such that dims after k are whole in both shapes: each index over dims < k is one contiguous
    run (dim k partial, later dims whole) in both."""
    split = len(sizes)
    while split > 0 and sizes[split - 1] == src_shape[split - 1] == dst_shape[split - 1]:
        split -= 1
    return max(split - 1, 0)


def _run_elements(sizes, split, start, strides) -> list[int]:
    """Element offset of every run of a region (each run covers dims ``split..``) that starts at ``start`` in an
    array of ``strides``, in row-major order of the run index. Computed with tensors: a half-row copy has one
    run per row, tens of thousands per region."""
    offsets = torch.tensor([sum(begin * stride for begin, stride in zip(start, strides))], dtype=torch.int64)
    for size, stride in zip(sizes[:split], strides[:split]):
        offsets = (offsets[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    return offsets.tolist()


def _copy_runs_direct(runs: _Runs, stats: ReadStats, crc: WholeCrc | PartCrc | None) -> None:
    source, sizes, split = runs.source, runs.sizes, runs.split
    item = source.dtype.itemsize
    run = math.prod(sizes[split:])
    src_strides, dst_strides = _contiguous_strides(source.shape), _contiguous_strides(tuple(runs.target.shape))
    out = _as_bytes(runs.target)
    src_runs = _run_elements(sizes, split, runs.src_start, src_strides)
    for src_element, dst_element in zip(src_runs, _run_elements(sizes, split, runs.dst_start, dst_strides)):
        src_element += source.storage_offset
        view = out[dst_element * item : (dst_element + run) * item]
        _pread_exact(runs.fd, view, source.data_offset + src_element * item, source)
        stats.payload_bytes_read += len(view)
        if crc is not None:
            crc.feed(src_element * item, view)


def _copy_span_scattered(runs: _Runs, stats: ReadStats, crc: WholeCrc | PartCrc | None) -> None:
    """The region is one contiguous span of the file whose runs land apart in the target: ``preadv`` with one
    buffer per run, in file order, so the bytes go to their place with no staging copy."""
    source, sizes, split = runs.source, runs.sizes, runs.split
    item = source.dtype.itemsize
    run_bytes = math.prod(sizes[split:]) * item
    dst_strides = _contiguous_strides(tuple(runs.target.shape))
    out = _as_bytes(runs.target)
    src_element = source.storage_offset + sum(b * s for b, s in zip(runs.src_start, _contiguous_strides(source.shape)))
    offset = source.data_offset + src_element * item
    views: list[memoryview] = []

    def read_batch() -> None:
        nonlocal offset
        wanted = len(views) * run_bytes
        got = os.preadv(runs.fd, views, offset)
        if got != wanted:
            raise ValueError(
                f"{source.what}: truncated: wanted {wanted} bytes at offset {offset}, the file ended after {got}"
            )
        if crc is not None:
            at = offset - source.data_offset
            for view in views:
                crc.feed(at, view)
                at += len(view)
        offset += got
        stats.payload_bytes_read += got
        views.clear()

    for dst_element in _run_elements(sizes, split, runs.dst_start, dst_strides):
        dst_byte = dst_element * item
        views.append(out[dst_byte : dst_byte + run_bytes])
        if len(views) == _IOV_MAX:
            read_batch()
    if views:
        read_batch()


def _copy_span_buffered(runs: _Runs, stats: ReadStats, crc: WholeCrc | PartCrc | None) -> None:
    """The region is one contiguous span of the file (rows of the stored chunk): read it in blocks of whole
    dim-0 slices that fit the buffer, copying each block into the target's strided view."""
    source, sizes = runs.source, runs.sizes
    item = source.dtype.itemsize
    row_elements = math.prod(sizes[1:]) if sizes else 1
    rows = sizes[0] if sizes else 1
    rows_per_block = max(1, READ_BUFFER_BYTES // max(row_elements * item, 1))
    buffer = torch.empty(min(rows, rows_per_block) * row_elements, dtype=source.dtype)
    raw = _as_bytes(buffer)
    start_element = source.storage_offset + (runs.src_start[0] * math.prod(source.shape[1:]) if sizes else 0)
    for first in range(0, rows, rows_per_block):
        count = min(rows_per_block, rows - first)
        view = raw[: count * row_elements * item]
        at = (start_element + first * row_elements) * item
        _pread_exact(runs.fd, view, source.data_offset + at, source)
        stats.payload_bytes_read += len(view)
        if crc is not None:
            crc.feed(at, view)
        block = buffer[: count * row_elements].view(count, *sizes[1:]) if sizes else buffer.view(())
        index = tuple(
            slice(d + (first if dim == 0 else 0), d + (first + count if dim == 0 else n))
            for dim, (d, n) in enumerate(zip(runs.dst_start, sizes))
        )
        runs.target[index].copy_(block)


def _pread_exact(fd: int, view: memoryview, offset: int, source: TensorLocation) -> None:
    got = os.preadv(fd, [view], offset)
    if got != len(view):
        raise ValueError(
            f"{source.what}: truncated: wanted {len(view)} bytes at offset {offset}, the file ended after {got}"
        )


def _copy_region_strided(
    chunk: SourceChunk, region: Box, target: CopyTarget, stats: ReadStats, checks: RecordChecks
) -> None:
    """Non-row-major storage (e.g. a saved transpose): read the storage span once and slice it in memory."""
    fd, source = chunk.fd, chunk.location
    span = bytearray(source.storage_nbytes)
    got = os.preadv(fd, [span], source.data_offset)
    if got != len(span):
        raise ValueError(f"{source.what}: truncated: wanted {len(span)} bytes, the file ended after {got}")
    stats.payload_bytes_read += got
    if checks.needs_crc(source.path):
        checks.whole(fd, source, zlib.crc32(span), stats)
    stored = torch.frombuffer(span, dtype=torch.uint8).view(source.dtype)
    stored = stored.as_strided(source.shape, source.stride, source.storage_offset)
    region_offsets, sizes = region
    src_index = tuple(slice(r - s, r - s + n) for r, s, n in zip(region_offsets, chunk.offsets, sizes))
    dst_index = tuple(slice(r - t, r - t + n) for r, t, n in zip(region_offsets, target.offsets, sizes))
    target.tensor[dst_index] = stored[src_index]
