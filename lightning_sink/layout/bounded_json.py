"""JSON from files that may come from untrusted hands: depth bounded before parsing, every failure a ValueError."""

from __future__ import annotations

import json
import re
from itertools import accumulate

__all__ = ["MAX_JSON_DEPTH", "loads_bounded"]

# Layouts and manifests nest a few levels (a mesh of d dims: d + 3); anything deeper is not one of them, and
# parsing or walking it would recurse without bound.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def loads_bounded(data: bytes | str, what: str) -> object:
    """``json.loads`` of a file's content, refusing (ValueError naming ``what``) undecodable text, invalid JSON and
    nesting deeper than ``MAX_JSON_DEPTH``, before the parser could recurse that deep."""
    try:
        text = data.decode() if isinstance(data, bytes) else data
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} is not UTF-8 text: {error}") from None
    brackets = _JSON_BRACKET.findall(_JSON_STRING.sub("", text))
    depth = max(accumulate(_DEPTH_STEP[b] for b in brackets), default=0)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{what} nests {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{what} is not valid JSON: {error}") from None
