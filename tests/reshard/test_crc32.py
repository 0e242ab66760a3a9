"""CRC-32 arithmetic used to check records read in parts, against zlib computing the CRC-32 of the whole."""

from __future__ import annotations

import random
import zlib

import pytest

from lightning_sink.reshard.integrity import (
    PartCrc,
    box_runs,
    complement_boxes,
    crc32_combine,
    record_crc,
)


@pytest.mark.parametrize("length2", [0, 1, 7, 4096, 1_000_003])
def test_combine_equals_zlib_of_the_concatenation(length2: int):
    generator = random.Random(length2)
    first, second = generator.randbytes(513), generator.randbytes(length2)
    assert crc32_combine(zlib.crc32(first), zlib.crc32(second), length2) == zlib.crc32(first + second)


def test_interleaved_parts_of_two_readers_give_the_record_crc():
    """Half-rows: one reader takes the first 40 bytes of each 100-byte row, the other the rest."""
    data = random.Random(1).randbytes(100 * 100)
    left, right = PartCrc(), PartCrc()
    for row in range(100):
        left.feed(row * 100, data[row * 100 : row * 100 + 40])
        right.feed(row * 100 + 40, data[row * 100 + 40 : row * 100 + 100])
    assert record_crc(left.finish(len(data)) ^ right.finish(len(data)), len(data)) == zlib.crc32(data)
    # A part missing (right's last row) gives another value: all parts are needed.
    partial = PartCrc()
    for row in range(99):
        partial.feed(row * 100 + 40, data[row * 100 + 40 : row * 100 + 100])
    assert record_crc(left.finish(len(data)) ^ partial.finish(len(data)), len(data)) != zlib.crc32(data)


@pytest.mark.parametrize(("offsets", "sizes"), [((1, 2, 3), (4, 2, 2)), ((0, 0, 0), (7, 5, 6)), ((6, 4, 5), (1, 1, 1))])
def test_a_box_and_its_complement_boxes_hold_every_byte_once(offsets, sizes):
    shape, seen = (7, 5, 6), []
    for box in [(offsets, sizes), *complement_boxes(offsets, sizes, shape)]:
        for start, length in box_runs(*box, shape, 2):
            seen.extend(range(start, start + length))
    assert sorted(seen) == list(range(7 * 5 * 6 * 2))
