"""What a pickle claims - its memo indices and the lengths its opcodes give - bounded by its size before Python's
unpickler acts on them.

Python's C unpickler keeps its memo in an array indexed by the numbers the ``PUT``, ``BINPUT`` and ``LONG_BINPUT``
opcodes name, and on a number beyond the array grows it to twice that number and fills it. One changed byte that
turns any opcode into ``LONG_BINPUT`` (a 4-byte index follows) makes a 3 KiB file claim, and touch, gigabytes for
many seconds before the unpickler fails. A pickler numbers its memo entries from 0, at most one per opcode, so a
pickle of N bytes never names an index of N or more. Likewise a length (of a string, bytes, a bytearray or a
frame) never exceeds the bytes after it; the unpickler allocates some of them before reading (a bytearray claiming
gigabytes fails with ``MemoryError`` and prints a stray ``SystemError`` line). ``pickle_claim_fault`` walks the
opcodes (reading their arguments' lengths, building no object) and names the first claim beyond the data. The walk
stops where the unpickler would: at ``STOP``, at a byte that is no opcode, or at the end of the data (the
unpickler then refuses the pickle itself, after at most what the walk has checked).
"""

from __future__ import annotations

import pickletools
import re

__all__ = ["pickle_claim_fault"]

# What follows each opcode: a fixed number of bytes (>= 0), or one of these kinds of argument.
_LINE, _TWO_LINES = -1, -2  # text up to a newline; two such lines (GLOBAL, INST)
_COUNTED = {  # a length field of this many bytes (signed or not), then that many bytes
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}
_COUNTED_KINDS = {n: -3 - index for index, n in enumerate(_COUNTED)}  # their codes in the table: -3, -4, ...
_COUNTED_BY_KIND = {-3 - index: field for index, field in enumerate(_COUNTED.values())}


def _argument_kind(opcode: pickletools.OpcodeInfo) -> int:
    argument = opcode.arg
    if argument is None:
        return 0
    if argument.n >= 0:
        return argument.n
    if argument.n == pickletools.UP_TO_NEWLINE:
        return _TWO_LINES if argument.name == "stringnl_noescape_pair" else _LINE
    return _COUNTED_KINDS[argument.n]


_ARGUMENTS: list[int | None] = [None] * 256
for _opcode in pickletools.opcodes:
    _ARGUMENTS[ord(_opcode.code)] = _argument_kind(_opcode)
_PUT, _LONG_BINPUT, _STOP, _FRAME = ord("p"), ord("r"), ord("."), ord("\x95")
_MAX_DIGITS = 32  # a PUT's decimal index longer than this is beyond any pickle (and is not read as a number)
_TOO_MANY_DIGITS = 10**_MAX_DIGITS


def _run_of_fixed_arguments() -> re.Pattern[bytes]:
    """Any run of opcodes whose arguments have a fixed size (all but a few per hundred in DCP's metadata), but
    ``LONG_BINPUT``, ``FRAME`` and ``STOP``: the regular expression engine skips them at C speed; the walk handles the rest."""
    by_size: dict[int, list[int]] = {}
    for code, kind in enumerate(_ARGUMENTS):
        if kind is not None and kind >= 0 and code not in (_LONG_BINPUT, _STOP, _FRAME):
            by_size.setdefault(kind, []).append(code)
    alternatives = [
        b"[" + b"".join(re.escape(bytes([code])) for code in codes) + b"]" + (b".{%d}" % size if size else b"")
        for size, codes in sorted(by_size.items())
    ]
    return re.compile(b"(?:" + b"|".join(alternatives) + b")*", re.DOTALL)


_FIXED_RUN = _run_of_fixed_arguments()


def pickle_claim_fault(data: bytes) -> str | None:
    """The first memo index ``data`` names at or beyond its own length, or length beyond the bytes after it, in
    words; None when there is none."""
    end = len(data)
    position = _after_fixed(data, 0)
    while position < end:
        code = data[position]
        kind = _ARGUMENTS[code]
        if kind is None or code == _STOP:
            return None
        if code in (_LONG_BINPUT, _PUT):
            index, after = _put_index(data, position + 1, code)
            if index >= end:
                number = index if index < _TOO_MANY_DIGITS else f"of more than {_MAX_DIGITS} digits"
                return f"byte {position} stores memo entry {number}, beyond what a pickle of {end} bytes holds"
        elif code == _FRAME:
            after = position + 9
            length = int.from_bytes(data[position + 1 : after], "little")
            if length > end - after:
                return f"byte {position} starts a frame of {length} bytes, beyond the {end - after} bytes after it"
        elif kind >= 0:
            after = position + 1 + kind
        elif kind >= _TWO_LINES:
            after = _after_lines(data, position + 1, 2 if kind == _TWO_LINES else 1)
        else:
            width, signed = _COUNTED_BY_KIND[kind]
            length = int.from_bytes(data[position + 1 : position + 1 + width], "little", signed=signed)
            after = position + 1 + width + max(length, 0)
            if after > end:
                return f"byte {position} claims {length} bytes, beyond the {end - position - 1 - width} bytes after it"
        if after >= end:
            return None
        position = _after_fixed(data, after)
    return None


def _after_fixed(data: bytes, position: int) -> int:
    """Where the run of fixed-argument opcodes from ``position`` ends."""
    run = _FIXED_RUN.match(data, position)
    return position if run is None else run.end()  # (the pattern matches the empty run too)


def _put_index(data: bytes, position: int, code: int) -> tuple[int, int]:
    """The memo index a ``LONG_BINPUT`` (4 bytes) or ``PUT`` (a decimal line) at ``position`` names (-1 for text
    that is no index: the unpickler refuses it), and where its argument ends."""
    if code == _LONG_BINPUT:
        return int.from_bytes(data[position : position + 4], "little"), position + 4
    after = _after_lines(data, position, 1)
    text = data[position:after].strip()
    if len(text) > _MAX_DIGITS:
        return _TOO_MANY_DIGITS, after
    try:
        return int(text), after
    except ValueError:
        return -1, after


def _after_lines(data: bytes, position: int, lines: int) -> int:
    """Where the ``lines`` text arguments starting at ``position`` end (the data's end when they do not)."""
    for _ in range(lines):
        newline = data.find(b"\n", position)
        if newline < 0:
            return len(data)
        position = newline + 1
    return position
