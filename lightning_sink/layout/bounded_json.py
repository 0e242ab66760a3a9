"""JSON from files that may come from untrusted hands: size and depth bounded before parsing, every failure a
ValueError naming the file.

The depth check is one left-to-right pass over the text that tracks only whether it is inside a string (and after a
backslash there): linear in the size for any input, unlike a regular expression that strips strings first, which
backtracks quadratically on a quote followed by many escaped quotes.
"""

from __future__ import annotations

import json
import re

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "json_depth", "loads_bounded"]

# Layouts and manifests nest a few levels (a mesh of d dims: d + 3); anything deeper is not one of them, and
# parsing or walking it would recurse without bound.
MAX_JSON_DEPTH = 64
# The largest layout or manifest file read: a layout lists every chunk of every tensor, which for the largest
# meshes in use is some megabytes; anything much larger is not one, and its parsed objects would take many times
# its size in memory.
MAX_JSON_BYTES = 64 * 2**20

# The characters the depth scan stops at: quotes, backslashes and brackets. Everything between two of them is
# skipped by the regular expression engine in one step (a plain character class: no backtracking).
_SPECIAL = re.compile(r'["\\\[\]{}]')


def json_depth(text: str) -> int:
    """The deepest nesting of brackets outside strings, in one pass (brackets inside strings do not count)."""
    depth = deepest = 0
    in_string = escaped = False
    escape_at = -2
    for match in _SPECIAL.finditer(text):
        char = match.group()
        if in_string:
            if escaped:
                # A backslash escapes the next character: only if it is this special one, right after it.
                escaped = False
                if match.start() == escape_at + 1:
                    continue
            if char == "\\":
                escaped, escape_at = True, match.start()
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def loads_bounded(data: bytes | str, what: str) -> object:
    """``json.loads`` of a file's content, refusing (ValueError naming ``what``) more than ``MAX_JSON_BYTES``,
    undecodable text, invalid JSON and nesting deeper than ``MAX_JSON_DEPTH``, before the parser could recurse
    that deep. Time and memory are linear in the size."""
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"{what} holds {len(data)} bytes; at most {MAX_JSON_BYTES} are accepted")
    try:
        text = data.decode() if isinstance(data, bytes) else data
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} is not UTF-8 text: {error.reason} at byte {error.start}") from None
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{what} nests {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} is not valid JSON: {error.msg} (line {error.lineno} column {error.colno})") from None
    except (ValueError, RecursionError):  # e.g. an integer of more digits than Python converts
        raise ValueError(f"{what} is not valid JSON (a number too long, or nested too deeply)") from None
