"""Integrity of the source bytes a conversion copies: the CRC-32 of every ``torch.save`` record it reads from.

A record's CRC-32 (in the zip data descriptor after its bytes) covers the whole storage, but a target rank often
reads only part of a record (rows cut by a target boundary, half-rows of a column split). CRC-32 is linear over
GF(2): the CRC register of a record equals the XOR of the registers of records that hold one part each and zeros
elsewhere. So each part read contributes that *part register* (computed while its bytes pass, plus a zero shift
for the gaps, a 32x32 bit-matrix product), and :class:`RecordChecks` checks a record once the parts read by all
target ranks tile it; a record that the conversion read only partly (one target rank converted alone, a stored
replica read in pieces) is completed by reading its remaining bytes for checking only.

Records without a CRC-32 (this package's own rank files) are accepted only from files whose whole-file SHA-256
was checked against their manifest or sidecar (``verified_files``).
"""

from __future__ import annotations

import itertools
import math
import os
import struct
import zlib
from dataclasses import dataclass, field

from lightning_sink.regular_file import CLOEXEC

__all__ = [
    "MASK",
    "PartCrc",
    "RecordChecks",
    "WholeCrc",
    "box_runs",
    "complement_boxes",
    "crc32_combine",
    "crc32_shift",
    "record_crc",
]

MASK = 0xFFFFFFFF
_POLYNOMIAL = 0xEDB88320  # CRC-32 (zip, zlib), bit-reflected
_DATA_DESCRIPTOR_SIGNATURE = 0x08074B50
_CHECK_READ_BYTES = 16 * 2**20


def _times(matrix: list[int], vector: int) -> int:
    result, column = 0, 0
    while vector:
        if vector & 1:
            result ^= matrix[column]
        vector >>= 1
        column += 1
    return result


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, column) for column in matrix]


def _zero_byte_powers() -> list[list[int]]:
    """Operators on the CRC register for 2**k zero bytes, k = 0..63 (one zero bit is: shift right, and XOR the
    polynomial when the bit shifted out is set)."""
    operator = [_POLYNOMIAL] + [1 << (bit - 1) for bit in range(1, 32)]
    for _ in range(3):
        operator = _square(operator)
    powers = [operator]
    for _ in range(63):
        powers.append(_square(powers[-1]))
    return powers


_POWERS = _zero_byte_powers()


def crc32_shift(register: int, zero_bytes: int) -> int:
    """The CRC register after ``zero_bytes`` more zero bytes."""
    power = 0
    while zero_bytes and register:
        if zero_bytes & 1:
            register = _times(_POWERS[power], register)
        zero_bytes >>= 1
        power += 1
    return register


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """zlib's ``crc32_combine``: the CRC-32 of A + B from the CRC-32s of A and of B (``length2`` bytes)."""
    return crc32_shift(crc1, length2) ^ crc2


def record_crc(register: int, length: int) -> int:
    """A record's CRC-32 from the XOR of its parts' registers (each started at 0): zlib starts the register at
    all ones and inverts it at the end."""
    return crc32_shift(MASK, length) ^ register ^ MASK


class _Shift:
    """A fixed zero shift as four byte tables: the reader applies the same gap between thousands of runs."""

    def __init__(self, zero_bytes: int) -> None:
        columns = [crc32_shift(1 << bit, zero_bytes) for bit in range(32)]
        self.tables = []
        for lane in range(4):
            table = [0] * 256
            for byte in range(1, 256):
                low = byte & -byte
                table[byte] = table[byte ^ low] ^ columns[8 * lane + low.bit_length() - 1]
            self.tables.append(table)

    def __call__(self, register: int) -> int:
        t0, t1, t2, t3 = self.tables
        return t0[register & 255] ^ t1[(register >> 8) & 255] ^ t2[(register >> 16) & 255] ^ t3[register >> 24]


_SHIFTS: dict[int, _Shift] = {}


def _shift_cached(register: int, zero_bytes: int) -> int:
    shift = _SHIFTS.get(zero_bytes)
    if shift is None:
        if len(_SHIFTS) >= 256:
            _SHIFTS.clear()
        shift = _SHIFTS[zero_bytes] = _Shift(zero_bytes)
    return shift(register)


class WholeCrc:
    """The plain CRC-32 of a record read whole, front to back."""

    def __init__(self) -> None:
        self.value = 0

    def feed(self, offset: int, data) -> None:
        self.value = zlib.crc32(data, self.value)


class PartCrc:
    """The register of the record holding only the bytes fed (zeros elsewhere); fed at increasing offsets."""

    def __init__(self) -> None:
        self.value = 0
        self.position = 0

    def feed(self, offset: int, data) -> None:
        if offset < self.position:
            raise AssertionError(f"CRC parts fed out of order: {offset} < {self.position}")
        if offset > self.position and self.value:
            self.value = _shift_cached(self.value, offset - self.position)
        self.value = zlib.crc32(data, self.value ^ MASK) ^ MASK
        self.position = offset + len(data)

    def finish(self, length: int) -> int:
        """The register once the record's remaining ``length - position`` bytes (zeros here) have passed."""
        return crc32_shift(self.value, length - self.position)


def box_runs(offsets, sizes, shape, itemsize: int):
    """(byte offset, byte length) of each contiguous run of a box of a row-major array, in file order."""
    split = len(shape)
    while split > 0 and sizes[split - 1] == shape[split - 1]:
        split -= 1
    if split == 0:
        yield 0, math.prod(shape) * itemsize
        return
    last = split - 1
    strides = [math.prod(shape[dim + 1 :]) for dim in range(len(shape))]
    run = sizes[last] * strides[last]
    for index in itertools.product(*(range(o, o + s) for o, s in zip(offsets[:last], sizes[:last]))):
        start = sum(i * stride for i, stride in zip(index, strides)) + offsets[last] * strides[last]
        yield start * itemsize, run * itemsize


def complement_boxes(offsets, sizes, shape) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Disjoint boxes that, with the box (``offsets``, ``sizes``), tile an array of ``shape``: per dim, the slabs
    before and after the box within the box's range on the earlier dims."""
    boxes = []
    for dim, (offset, size, extent) in enumerate(zip(offsets, sizes, shape)):
        before_o, before_s = tuple(offsets[:dim]), tuple(sizes[:dim])
        rest_o, rest_s = (0,) * (len(shape) - dim - 1), tuple(shape[dim + 1 :])
        if offset > 0:
            boxes.append((before_o + (0,) + rest_o, before_s + (offset,) + rest_s))
        if offset + size < extent:
            boxes.append((before_o + (offset + size,) + rest_o, before_s + (extent - offset - size,) + rest_s))
    return [box for box in boxes if all(box[1])]


@dataclass
class _Record:
    """A stored record some of whose parts were read: ``parts`` maps (tensor geometry, box) to its register."""

    path: str
    data_offset: int
    nbytes: int
    stored_crc: int
    what: str
    parts: dict[tuple, int] = field(default_factory=dict)


class RecordChecks:
    """The CRC-32 checks of one conversion: records read whole are checked at once; parts are collected (across
    target ranks and worker processes, see ``merge``) and checked by ``finish`` before the output is committed."""

    def __init__(self, verified_files: set[str] | None = None) -> None:
        self.verified_files = set(verified_files or ())
        self.records: dict[tuple[str, int], _Record] = {}
        self._stored: dict[tuple[str, int], int] = {}

    def needs_crc(self, path) -> bool:
        """False for a file whose whole SHA-256 was checked: its bytes need no per-record check."""
        return str(path) not in self.verified_files

    def stored_crc(self, fd: int, location, stats) -> int:
        """The CRC-32 in the zip data descriptor after the record; a record without one cannot be checked."""
        key = (str(location.path), location.data_offset)
        if key not in self._stored:
            descriptor = os.pread(fd, 8, location.data_offset + location.storage_nbytes)
            stats.verify_bytes_read += len(descriptor)
            if len(descriptor) < 8:
                raise ValueError(f"{location.what}: truncated after the tensor data (no zip data descriptor)")
            signature, stored = struct.unpack("<II", descriptor)
            if signature != _DATA_DESCRIPTOR_SIGNATURE or (stored == 0 and location.storage_nbytes):
                raise ValueError(
                    f"{location.what}: the record carries no CRC-32 (and no manifest or .sha256 digest"
                    " covers the file): its integrity cannot be checked"
                )
            self._stored[key] = stored
        return self._stored[key]

    def whole(self, fd: int, location, crc: int, stats) -> None:
        """A record read whole: its CRC-32 must be the stored one."""
        stored = self.stored_crc(fd, location, stats)
        if crc != stored:
            raise ValueError(
                f"{location.what}: corrupt: CRC-32 of the tensor data is {crc:08x}, the zip record says {stored:08x}"
            )
        stats.records_crc_checked += 1

    def part(self, fd: int, location, box, register: int, stats) -> None:
        """A part (``box`` of the stored tensor, in its own coordinates) read, with its register."""
        key = (str(location.path), location.data_offset)
        record = self.records.get(key)
        if record is None:
            record = self.records[key] = _Record(
                str(location.path),
                location.data_offset,
                location.storage_nbytes,
                self.stored_crc(fd, location, stats),
                location.what,
            )
        geometry = (location.storage_offset, tuple(location.shape), location.dtype.itemsize)
        _add_part(record, (geometry, tuple(map(tuple, box))), register)

    def merge(self, other: RecordChecks) -> None:
        for key, record in other.records.items():
            mine = self.records.setdefault(
                key, _Record(record.path, record.data_offset, record.nbytes, record.stored_crc, record.what)
            )
            for part, register in record.parts.items():
                _add_part(mine, part, register)

    def to_json(self) -> list:
        return [
            [
                r.path,
                r.data_offset,
                r.nbytes,
                r.stored_crc,
                r.what,
                [
                    [list(geometry[:1]) + [list(geometry[1]), geometry[2]], [list(box[0]), list(box[1])], register]
                    for (geometry, box), register in r.parts.items()
                ],
            ]
            for r in self.records.values()
        ]

    @classmethod
    def from_json(cls, data: list) -> RecordChecks:
        checks = cls()
        for path, data_offset, nbytes, stored, what, parts in data:
            record = checks.records[(path, data_offset)] = _Record(path, data_offset, nbytes, stored, what)
            for (storage_offset, shape, itemsize), (offsets, sizes), register in parts:
                record.parts[((storage_offset, tuple(shape), itemsize), (tuple(offsets), tuple(sizes)))] = register
        return checks

    def finish(self, stats) -> None:
        """Check every record read in parts: from the parts' registers where they tile it, else reading the
        rest of it (for checking only). Raises ValueError naming the file and tensor of a corrupt record."""
        for record in self.records.values():
            register = _tiled_register(record)
            if register is None:
                register = _register_reading_the_rest(record, stats)
            crc = record_crc(register, record.nbytes)
            if crc != record.stored_crc:
                raise ValueError(
                    f"{record.what}: corrupt: CRC-32 of the tensor data is {crc:08x}, the zip record"
                    f" says {record.stored_crc:08x} (combined from the parts the target ranks read)"
                )
            stats.records_crc_checked += 1
        self.records.clear()


def _add_part(record: _Record, key: tuple, register: int) -> None:
    previous = record.parts.setdefault(key, register)
    if previous != register:  # the same bytes read twice, different: the file changed under the conversion
        raise ValueError(f"{record.what}: the same bytes read twice differ: the file changed during the conversion")


def _tiled_register(record: _Record) -> int | None:
    """The record's register from its parts if they are boxes of one tensor that covers the whole record and
    together hold all of its elements (distinct boxes of a validated target layout do not overlap)."""
    geometries = {geometry for geometry, _ in record.parts}
    if len(geometries) != 1:
        return None
    ((storage_offset, shape, itemsize),) = geometries
    if storage_offset != 0 or math.prod(shape) * itemsize != record.nbytes:
        return None
    if sum(math.prod(sizes) for _, (_, sizes) in record.parts) != math.prod(shape):
        return None
    register = 0
    for value in record.parts.values():
        register ^= value
    return register


def _register_reading_the_rest(record: _Record, stats) -> int:
    """One part of a whole-record tensor: read the boxes around it. Anything else: read the record whole."""
    fd = os.open(record.path, os.O_RDONLY | CLOEXEC)
    try:
        if len(record.parts) == 1:
            ((((storage_offset, shape, itemsize), (offsets, sizes)), register),) = record.parts.items()
            if storage_offset == 0 and math.prod(shape) * itemsize == record.nbytes:
                for box in complement_boxes(offsets, sizes, shape):
                    part = PartCrc()
                    for start, length in box_runs(*box, shape, itemsize):
                        _feed_range(fd, record, part, start, length, stats)
                    register ^= part.finish(record.nbytes)
                return register
        part = PartCrc()
        _feed_range(fd, record, part, 0, record.nbytes, stats)
        return part.finish(record.nbytes)
    finally:
        os.close(fd)


def _feed_range(fd: int, record: _Record, part: PartCrc, start: int, length: int, stats) -> None:
    """Bytes ``[start, start + length)`` of the record into ``part``, read in bounded blocks."""
    for block in range(start, start + length, _CHECK_READ_BYTES):
        count = min(_CHECK_READ_BYTES, start + length - block)
        data = os.pread(fd, count, record.data_offset + block)
        if len(data) != count:
            raise ValueError(f"{record.what}: truncated: wanted {count} bytes at offset {record.data_offset + block}")
        stats.verify_bytes_read += count
        part.feed(block, data)
