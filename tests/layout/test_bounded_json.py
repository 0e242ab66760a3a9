"""The pre-parse check of untrusted JSON is linear: a quote followed by many escaped quotes (which made the old
string-stripping regular expression backtrack quadratically: 16 KB took seconds) costs about four times as much at
four times the size. Timing is asserted only as a ratio between two sizes of the same input, never as an absolute
time, and with room for a loaded machine: linear work gives about 4, quadratic work 16, the bound is 8."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from lightning_sink.layout import bounded_json
from lightning_sink.layout.bounded_json import MAX_JSON_DEPTH, loads_bounded


def adversarial(size: int) -> list[str]:
    """Inputs of about ``size`` characters that defeat a backtracking string matcher."""
    unit = size // 2
    return [
        '"' + '\\"' * unit,  # an unterminated string of escaped quotes
        '{"a": "' + '\\"' * unit,
        '["' + "\\\\" * unit + '\\"',  # escaped backslashes, then an escaped quote, never closed
        '"' + '\\"' * unit + '"' + "[" * 8,  # closed at the very end
    ]


def _seconds(text: str) -> float:
    """The best of five runs of the whole bounded parse (refusal included)."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        with contextlib.suppress(ValueError):
            loads_bounded(text, "manifest 'x'")
        best = min(best, time.perf_counter() - started)
    return best


@pytest.mark.parametrize("case", range(4))
def test_four_times_the_input_takes_about_four_times_the_time(case: int):
    small, large = adversarial(50_000)[case], adversarial(200_000)[case]
    ratio = _seconds(large) / max(_seconds(small), 1e-4)
    assert ratio < 8, f"4x the input took {ratio:.1f}x the time: not linear"


def test_the_old_quadratic_input_is_refused_quickly_naming_the_file():
    with pytest.raises(ValueError, match=r"^manifest 'x' is not valid JSON"):
        loads_bounded('"' + '\\"' * 32_000, "manifest 'x'")


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("[]", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('["[[[[", "]]"]', 1),  # brackets inside strings do not count
        ('["\\"[[[", 2]', 1),  # nor after an escaped quote inside a string
        ('["\\\\", [[]]]', 3),  # an escaped backslash ends before the closing quote
        ('["\\n[", []]', 2),  # an escape of an ordinary character
    ],
)
def test_depth_counts_brackets_outside_strings(text: str, depth: int):
    json.loads(text)  # each is valid JSON
    assert bounded_json.json_depth(text) == depth


def test_too_deep_and_too_large_and_not_json_are_one_line_errors():
    with pytest.raises(ValueError, match=rf"^layout 'f' nests {MAX_JSON_DEPTH + 1} levels deep"):
        loads_bounded("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "layout 'f'")
    with pytest.raises(ValueError, match=r"^layout 'f' is not UTF-8 text"):
        loads_bounded(b'{"a": "\xff"}', "layout 'f'")
    with pytest.raises(ValueError, match=r"^layout 'f' is not valid JSON \(a number too long"):
        loads_bounded("1" * 5000, "layout 'f'")
